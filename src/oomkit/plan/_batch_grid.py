"""The batch sizes a search may try: any, multiples of N, or powers of two (times N).

``max_batch_size`` brackets and bisects over the indices of a ``Grid`` instead of sizes, so a
constrained search (``multiple_of=8``, ``power_of_two=True``) tries only allowed sizes and
answers the largest allowed size that fits.
"""

from __future__ import annotations

from dataclasses import dataclass

from oomkit.errors import ConfigError
from oomkit.plan.batch_probe import check_positive

__all__ = ["Grid", "grid_words", "search_grid"]


@dataclass(frozen=True)
class Grid:
    """The sizes a search may try, by index from 1: ``multiple_of * k``, or with
    ``power_of_two`` ``multiple_of * 2 ** (k - 1)``. The search runs over indices."""

    multiple_of: int = 1
    power_of_two: bool = False

    def size(self, index: int) -> int:
        """The batch size at ``index`` (from 1)."""
        return self.multiple_of * (2 ** (index - 1) if self.power_of_two else index)

    def index_at_most(self, batch: int) -> int:
        """The largest index whose size is at most ``batch`` (0: none)."""
        units = batch // self.multiple_of
        if self.power_of_two:
            return units.bit_length()
        return units

    def index_at_least(self, batch: int) -> int:
        """The smallest index whose size is at least ``batch``."""
        index = self.index_at_most(batch)
        return index if index and self.size(index) >= batch else index + 1


def search_grid(multiple_of: int | None, power_of_two: bool) -> Grid:
    """The grid of ``max_batch_size(multiple_of=..., power_of_two=...)``.

    Raises:
        ValueError: ``multiple_of`` is not a positive int, or not a power of two together
            with ``power_of_two``.
    """
    if multiple_of is not None:
        check_positive("multiple_of", multiple_of, "max_batch_size(build, multiple_of=8)")
    step = multiple_of or 1
    if power_of_two and step & (step - 1):
        raise ConfigError(
            f"power_of_two sizes are never multiples of {step} (not a power of two); drop one "
            "of them, or use multiple_of=8 with power_of_two=True"
        )
    return Grid(step, bool(power_of_two))


def grid_words(grid: Grid) -> str:
    """``a multiple of 8``, ``a power of two``, ``a power of two times 8``."""
    if grid.power_of_two:
        return "a power of two" + (f" times {grid.multiple_of}" if grid.multiple_of > 1 else "")
    return f"a multiple of {grid.multiple_of}"

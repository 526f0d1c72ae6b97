"""Runtime settings of the simulated allocator (ref §6, §7, §9.1 "Runtime changes", §9.5).

:class:`AllocatorSettings` turns an :class:`~oomkit.core.allocator.config.AllocatorConfig` and
the torch version's rules into the plain values malloc and free read, and models
``set_per_process_memory_fraction``. It is updated in place, so the allocator's parts share one.
"""

from __future__ import annotations

import math

from oomkit.core.allocator._config_parser import ASYNC_REFUSED
from oomkit.core.allocator.config import AllocatorConfig
from oomkit.core.allocator.constants import LARGE_BUFFER, SIZE_MAX
from oomkit.core.allocator.versions import TorchBehaviour
from oomkit.errors import AllocatorUsageError, ConfigError

__all__ = ["AllocatorSettings", "check_fraction"]


class AllocatorSettings:
    """The values the allocator reads on its paths (they change only through the settings API).

    Attributes:
        max_split: ``max_split_size`` in bytes; SIZE_MAX when unlimited.
        split_limited: ``max_split_size`` is set (``max_split`` < SIZE_MAX). The hot paths test
            this first: SIZE_MAX is past a native integer of a compiled build, so comparing a
            size with it is a big-integer comparison (issue 41).
        large_segment_size: the large-pool segment size and expandable page size (bytes).
        non_split_rounding: the slack an oversize request may take (bytes, §6).
        divisions: roundup_power2_divisions, or None when no bracket divides.
        gc_threshold: garbage_collection_threshold (a fraction).
        expandable: expandable_segments.
        reject_limit: MAIN26 throw_on_cudamalloc_oom limit in bytes, else None.
        limit: allowed_memory_maximum when a fraction limit is set, else None.
        gc_enabled: GC runs: a fraction limit and a threshold > 0 (§7). A field kept in step
            with ``limit`` and ``gc_threshold`` by the two ``apply_`` methods, not a property:
            every malloc reads it (issue 41).
    """

    __slots__ = (
        "rules",
        "capacity_bytes",
        "max_split",
        "split_limited",
        "large_segment_size",
        "non_split_rounding",
        "divisions",
        "gc_threshold",
        "expandable",
        "reject_limit",
        "limit",
        "gc_enabled",
    )

    def __init__(self, config: AllocatorConfig, rules: TorchBehaviour, capacity_bytes: int) -> None:
        if config.backend != "native":
            # A record built with backend="cudaMallocAsync" (parse refuses the string): the
            # simulator would answer for the native allocator instead.
            raise ConfigError(ASYNC_REFUSED.format(text=str(config)))
        self.rules = rules
        self.capacity_bytes = capacity_bytes
        self.limit: int | None = None
        self.apply_config(config)
        if config.per_process_memory_fraction is not None:
            # per_process_memory_fraction config: applied when the device allocator is created.
            self.apply_fraction(float(config.per_process_memory_fraction))

    def apply_config(self, cfg: AllocatorConfig) -> None:
        """Cache the config's values (the fraction limit is left as it is)."""
        rules = self.rules
        self.max_split = (
            SIZE_MAX if cfg.max_split_size_bytes is None else int(cfg.max_split_size_bytes)
        )
        self.split_limited = self.max_split != SIZE_MAX
        self.large_segment_size = (
            int(cfg.large_segment_size_bytes)
            if rules.configurable_large_segment_size
            else LARGE_BUFFER
        )
        if rules.configurable_non_split_rounding:
            # PR #136174: max_non_split_rounding_mb, default large_segment_size (§6).
            self.non_split_rounding = (
                int(cfg.max_non_split_rounding_bytes)
                if cfg.max_non_split_rounding_bytes is not None
                else self.large_segment_size
            )
        else:
            # V24 get_free_block: fixed kLargeBuffer slack for oversize reuse.
            self.non_split_rounding = LARGE_BUFFER
        divisions = tuple(int(d) for d in cfg.roundup_power2_divisions)
        self.divisions: tuple[int, ...] | None = (
            divisions if any(d > 1 for d in divisions) else None
        )
        self.gc_threshold = float(cfg.garbage_collection_threshold)
        self._update_gc()
        self.expandable = bool(cfg.expandable_segments)
        self.reject_limit: int | None = None
        if cfg.throw_on_cudamalloc_oom and rules.oom_rejection:
            # MAIN26 alloc_block: trunc(per_process_memory_fraction config (1.0 when unset) *
            # totalGlobalMem), read from the config, not from set_per_process_memory_fraction.
            fraction = cfg.per_process_memory_fraction
            fraction = 1.0 if fraction is None else float(fraction)
            self.reject_limit = int(fraction * float(self.capacity_bytes))

    def apply_fraction(self, fraction: float) -> None:
        """setMemoryFraction: set ``limit`` from a fraction of the capacity (§9.5)."""
        total = self.capacity_bytes
        if self.rules.fraction_limit_only_below_one:
            # MAIN26 setMemoryFraction: a limit only below 1.0, round(f * totalGlobalMem) (§9.5).
            self.limit = None if fraction >= 1.0 else math.floor(fraction * total + 0.5)
        else:
            # V24 setMemoryFraction: trunc(f * total) and set_fraction = true, even for 1.0.
            self.limit = int(fraction * float(total))
        self._update_gc()

    def _update_gc(self) -> None:
        """GC runs only with a fraction limit and a threshold > 0 (§7)."""
        self.gc_enabled = self.limit is not None and self.gc_threshold > 0.0


def check_fraction(fraction: object) -> float:
    """Validate a ``set_per_process_memory_fraction`` argument (§9.5, §4 step 6.2).

    Args:
        fraction: the share of ``capacity_bytes`` the allocator may reserve, in [0, 1].

    Returns:
        The fraction as a float.

    Raises:
        AllocatorUsageError: not a number in [0, 1].
    """
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
        raise AllocatorUsageError(
            f"fraction must be a float in [0, 1]; got {fraction!r}. Example: 0.5."
        )
    if not 0.0 <= fraction <= 1.0:
        raise AllocatorUsageError(
            f"fraction must be in [0, 1]; got {fraction}. Example: 0.5 for half the device."
        )
    return float(fraction)

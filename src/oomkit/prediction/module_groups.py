"""Repeated layers read as one row: ``h.0-11.mlp.c_fc (12 layers)`` instead of twelve rows.

A transformer's twelve blocks hold the same tensors at the peak, so a table of the largest
modules lists the same leaf module of each block, one row each, and leaves out everything else.
``group_modules`` merges the paths that differ only in their first numeric component (the layer
index of ``h.3.mlp.c_fc``, ``layers.10.self_attn``, ``layer1.2.conv1``), for consecutive layers
that hold the same bytes (within ``SAME_BYTES_RATIO``: the allocator's rounding of an unsplit
block makes identical layers differ slightly), into one group, and orders groups and paths
numerically (``h.2`` before ``h.10``). Layers that hold different amounts (part-way through
backward, say) stay separate runs. Reports (terminal, ``str()`` of a
prediction) show the largest groups and say how many rows they left out.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass

from oomkit.units import format_bytes

__all__ = ["SAME_BYTES_RATIO", "ModuleGroup", "group_modules", "natural_key"]

# Layers merge when the largest holds at most this much more than the smallest. Identical
# layers differ only by block rounding: a block left unsplit keeps up to 1 MiB more than its
# request (CUDACachingAllocator.cpp should_split: a large-pool remainder must exceed kSmallSize),
# about 1% of a GPT-2 block's 92 MiB at batch 8.
SAME_BYTES_RATIO = 1.05

_NUMBER = re.compile(r"(\d+)")


@functools.lru_cache(maxsize=4096)  # every breakdown of a prediction sorts the same names
def natural_key(path: str) -> tuple[tuple[int, int | str], ...]:
    """A sort key that orders the numbers inside ``path`` by value: ``h.2`` before ``h.10``."""
    return tuple(
        (0, int(part)) if part.isdigit() else (1, part) for part in _NUMBER.split(path) if part
    )


@dataclass(frozen=True)
class ModuleGroup:
    """Modules that are the same layer of repeated blocks, or one module on its own.

    Attributes:
        label: ``h.0-11.mlp.c_fc`` (consecutive layer indices), or the module's path when it
            stands alone (``""`` is the root module).
        paths: the member paths, in layer order.
        total_bytes: the members' bytes together.
        min_bytes: the smallest member's bytes.
        max_bytes: the largest member's bytes.
    """

    label: str
    paths: tuple[str, ...]
    total_bytes: int
    min_bytes: int
    max_bytes: int

    @property
    def layers(self) -> int:
        """How many modules the group holds."""
        return len(self.paths)

    def describe(self) -> str:
        """The label, and for a group ``(12 layers, 91.54 MiB each)`` (a range when unequal)."""
        if self.layers == 1:
            return self.label
        low, high = format_bytes(self.min_bytes), format_bytes(self.max_bytes)
        low_number, _, low_unit = low.partition(" ")
        high_number, _, high_unit = high.partition(" ")
        if low == high:
            each = low
        elif low_unit == high_unit:
            each = f"{low_number}-{high_number} {high_unit}"  # 91.54-92.41 MiB
        else:
            each = f"{low} to {high}"
        return f"{self.label} ({self.layers} layers, {each} each)"


def _split(path: str) -> tuple[str, int, str] | None:
    """``("h.", 3, ".mlp.c_fc")`` for ``h.3.mlp.c_fc``: the first dotted part that is a number."""
    parts = path.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            prefix = ".".join(parts[:i]) + "." if i else ""
            suffix = "." + ".".join(parts[i + 1 :]) if i + 1 < len(parts) else ""
            return prefix, int(part), suffix
    return None


def _runs(members: list[tuple[int, str, int]]) -> list[list[tuple[int, str, int]]]:
    """``(index, path, bytes)`` sorted by index, cut where an index is skipped or the bytes
    leave ``SAME_BYTES_RATIO`` of the run's smallest and largest."""
    runs: list[list[tuple[int, str, int]]] = []
    low = high = 0
    for member in members:
        index, _, nbytes = member
        if runs and index == runs[-1][-1][0] + 1:
            new_low, new_high = min(low, nbytes), max(high, nbytes)
            if new_high <= new_low * SAME_BYTES_RATIO:
                runs[-1].append(member)
                low, high = new_low, new_high
                continue
        runs.append([member])
        low = high = nbytes
    return runs


def group_modules(rows: Iterable[tuple[str, int]]) -> tuple[ModuleGroup, ...]:
    """Merge the rows of repeated layers; largest group first, ties in numeric path order.

    Args:
        rows: ``(module path, bytes)`` pairs, each path once (``PeakBreakdown.modules``).

    Returns:
        One group per run of consecutive layers of one pattern (the path with its layer index
        taken out) that hold the same bytes; paths without a numeric part, or alone, are groups
        of one.
    """
    patterns: dict[tuple[str, str], list[tuple[int, str, int]]] = {}
    alone: list[tuple[str, int]] = []
    for path, nbytes in rows:
        split = _split(path)
        if split is None:
            alone.append((path, nbytes))
        else:
            prefix, index, suffix = split
            patterns.setdefault((prefix, suffix), []).append((index, path, nbytes))
    groups = [ModuleGroup(path, (path,), n, n, n) for path, n in alone]
    for (prefix, suffix), members in patterns.items():
        members.sort()
        for run in _runs(members):
            sizes = [n for _, _, n in run]
            paths = tuple(path for _, path, _ in run)
            first, last = run[0][0], run[-1][0]
            label = paths[0] if len(run) == 1 else f"{prefix}{first}-{last}{suffix}"
            groups.append(ModuleGroup(label, paths, sum(sizes), min(sizes), max(sizes)))
    groups.sort(key=lambda g: (-g.total_bytes, natural_key(g.paths[0])))
    return tuple(groups)

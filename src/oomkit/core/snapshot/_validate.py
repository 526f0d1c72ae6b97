"""Checks that a normalised snapshot describes memory that can exist: sizes, overlaps, actions.

A file PyTorch wrote always passes: ``CUDACachingAllocator.cpp`` hands out blocks that tile
their segment (``Block`` splits keep ``ptr``/``size`` contiguous) and cudaMalloc never returns
overlapping ranges. A hand-made or damaged file that breaks these rules would give wrong figures
(a negative cache, more allocated than reserved), so it is refused with the rule it breaks.

Also a bounded ``show`` for putting untrusted values into messages: ``repr`` of a shared nested
list (a "memo bomb": 60 levels of ``[a, a]``) would never finish.
"""

from __future__ import annotations

import reprlib
from collections.abc import Mapping, Sequence
from typing import Any

from oomkit.core.snapshot.model import SnapshotSegment
from oomkit.core.trace import TraceEvent
from oomkit.core.trace.events import ACTIONS

__all__ = ["KNOWN_ACTIONS", "layout_problem", "show", "trace_problem", "unknown_actions"]

# c10/core/CachingDeviceAllocator.h TraceEntry::Action as _snapshot() spells them, MAIN26's
# annotate, and oomkit's own empty_cache (core/trace/events.py ACTIONS).
KNOWN_ACTIONS = frozenset(ACTIONS)

# Device addresses are 64-bit (CUdeviceptr); sizes are size_t.
_ADDRESS_LIMIT = 1 << 64

_repr = reprlib.Repr()
_repr.maxlevel = 3
_repr.maxstring = 60
_repr.maxother = 60


def show(value: Any) -> str:
    """A short repr of an untrusted value: bounded in depth, length and time."""
    try:
        return _repr.repr(value)
    except Exception:  # noqa: BLE001 - a value whose repr fails is shown by its type
        return f"<{type(value).__name__}>"


def layout_problem(segments: Sequence[SnapshotSegment]) -> str | None:
    """The first rule the segments and blocks break, in words; None when they can exist.

    Rules: sizes are positive, addresses non-negative and below 2**64; blocks lie inside their
    segment without overlapping; segments of one device do not overlap.
    """
    by_device: dict[int, list[tuple[int, int, int]]] = {}
    for index, seg in enumerate(segments):
        where = f"segment {index}"
        if seg.total_size <= 0:
            return f"{where} has total_size {seg.total_size}; a segment holds at least 1 byte"
        if seg.address < 0 or seg.address + seg.total_size > _ADDRESS_LIMIT:
            return f"{where} lies at {seg.address}, outside the 64-bit address space"
        if seg.device < 0:
            return f"{where} is on device {seg.device}; device indices are >= 0"
        end = seg.address + seg.total_size
        previous_end = seg.address
        for b_index, block in enumerate(sorted(seg.blocks, key=lambda b: b.address)):
            if block.size <= 0:
                return f"{where} block {b_index} has size {block.size}; a block holds at least 1 byte"
            if block.requested_size < 0:
                return f"{where} block {b_index} has requested_size {block.requested_size} < 0"
            if block.address < previous_end:
                return (
                    f"{where}: blocks overlap at {block.address:#x} (a block starts before the "
                    "one below it ends)"
                )
            if block.address + block.size > end:
                return (
                    f"{where}: block at {block.address:#x} ({block.size:,} B) runs past the "
                    f"segment's end {end:#x}"
                )
            previous_end = block.address + block.size
        by_device.setdefault(seg.device, []).append((seg.address, end, index))
    for ranges in by_device.values():
        ranges.sort()
        for (_, a_end, a_index), (b_start, _, b_index) in zip(ranges, ranges[1:], strict=False):
            if b_start < a_end:
                return f"segments {a_index} and {b_index} overlap at {b_start:#x}"
    return None


def trace_problem(device: int, events: Sequence[TraceEvent]) -> str | None:
    """The first trace entry with a negative size or address, in words; None when all are sane."""
    for index, event in enumerate(events):
        if event.size < 0 or event.address < 0:
            return (
                f"device_traces[{device}][{index}] ({show(event.action)}) has size {event.size} "
                f"and address {event.address}; both are unsigned in PyTorch's trace"
            )
    return None


def unknown_actions(events: Sequence[TraceEvent]) -> Mapping[str, int]:
    """How many entries each action oomkit does not know has (empty for PyTorch's own files)."""
    counts: dict[str, int] = {}
    for event in events:
        if event.action not in KNOWN_ACTIONS:
            counts[event.action] = counts.get(event.action, 0) + 1
    return counts

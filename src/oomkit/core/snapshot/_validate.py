"""Checks that a normalised snapshot describes memory that can exist: sizes, overlaps, actions.

A file PyTorch wrote always passes: ``CUDACachingAllocator.cpp`` hands out blocks that tile
their segment (``Block`` splits keep ``ptr``/``size`` contiguous) and cudaMalloc never returns
overlapping ranges. A hand-made or damaged file that breaks these rules would give wrong figures
(a negative cache, more allocated than reserved), so it is refused with the rule it breaks.

Also a bounded ``show`` for putting untrusted values into messages: ``repr`` of a shared nested
list (a "memo bomb": 60 levels of ``[a, a]``) would never finish.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Mapping, Sequence
from typing import Any

from oomkit.core.snapshot.model import SnapshotSegment
from oomkit.core.trace import TraceEvent
from oomkit.core.trace.events import ACTIONS

__all__ = [
    "KNOWN_ACTIONS",
    "layout_problem",
    "pool_id_problem",
    "settings_problem",
    "show",
    "trace_problem",
]

# c10/core/CachingDeviceAllocator.h TraceEntry::Action as _snapshot() spells them, MAIN26's
# annotate, and oomkit's own empty_cache (core/trace/events.py ACTIONS). A snapshot entry with
# another action is refused (_consistency.trace_contradiction), oomkit's own
# allocator_settings included: a snapshot records the settings once, at its dump.
KNOWN_ACTIONS = frozenset(ACTIONS) - {"allocator_settings"}

# Device addresses are 64-bit (CUdeviceptr); sizes are size_t; streams are cudaStream_t
# pointers; time_us is a time_t count (CUDACachingAllocator.h TraceEntry).
_ADDRESS_LIMIT = 1 << 64
# c10/core/Device.h DeviceIndex: int8_t (int16_t in older releases), so at most 32767.
_DEVICE_LIMIT = 1 << 15
# CUDACachingAllocator.cpp MempoolId_t: a pair of CaptureId_t / unsigned long long ids.
_POOL_ID_LIMIT = 1 << 64

# CUDAAllocatorConfig (CUDACachingAllocator.cpp DeviceCachingAllocator::snapshot's
# allocator_settings): the type of each field PyTorch records; a file that holds another is
# refused rather than read as the default setting (issue 36).
_SETTING_TYPES: dict[str, tuple[type, ...]] = {
    "PYTORCH_CUDA_ALLOC_CONF": (str,),
    "max_split_size": (int,),
    "garbage_collection_threshold": (int, float),
    "expandable_segments": (bool,),
    "pinned_num_register_threads": (int,),
    "release_lock_on_cudamalloc": (bool,),
    "pinned_use_cuda_host_register": (bool,),
    "graph_capture_record_stream_reuse": (bool,),
    "roundup_power2_divisions": (dict,),
}

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
            return (
                f"{where} has total_size {_short_int(seg.total_size)}; a segment holds at least "
                "1 byte"
            )
        if seg.address < 0 or seg.address + seg.total_size > _ADDRESS_LIMIT:
            return (
                f"{where} lies at {_short_int(seg.address)} with total_size "
                f"{_short_int(seg.total_size)}, outside the 64-bit address space"
            )
        if seg.device < 0 or seg.device >= _DEVICE_LIMIT:
            return (
                f"{where} is on device {_short_int(seg.device)}; device indices are 0 to "
                f"{_DEVICE_LIMIT - 1}"
            )
        for name, value in (
            ("stream", seg.stream),
            ("allocated_size", seg.allocated_size),
            ("active_size", seg.active_size),
            ("requested_size", seg.requested_size),
        ):
            if not 0 <= value < _ADDRESS_LIMIT:
                return f"{where} has {name} {_short_int(value)}; it must lie in 0 to 2**64 - 1"
        end = seg.address + seg.total_size
        previous_end = seg.address
        for b_index, block in enumerate(sorted(seg.blocks, key=lambda b: b.address)):
            if block.size <= 0:
                return (
                    f"{where} block {b_index} has size {_short_int(block.size)}; a block holds at "
                    "least 1 byte"
                )
            if block.requested_size < 0:
                return (
                    f"{where} block {b_index} has requested_size "
                    f"{_short_int(block.requested_size)} < 0"
                )
            if block.requested_size >= _ADDRESS_LIMIT:
                return (
                    f"{where} block {b_index} has requested_size "
                    f"{_short_int(block.requested_size)}, past 2**64"
                )
            if block.address < previous_end:
                return (
                    f"{where}: blocks overlap at {_hex(block.address)} (a block starts before the "
                    "one below it ends)"
                )
            if block.address + block.size > end:
                return (
                    f"{where}: block at {_hex(block.address)} ({_short_int(block.size)} B) runs "
                    f"past the segment's end {end:#x}"
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
    """The first trace entry with a size, address, stream or time outside 0 to 2**64 - 1, in
    words; None when all are sane."""
    limit = _ADDRESS_LIMIT
    for index, event in enumerate(events):
        if event.size < 0 or event.address < 0:
            return (
                f"device_traces[{device}][{index}] ({show(event.action)}) has size "
                f"{_short_int(event.size)} and address {_short_int(event.address)}; both are "
                "unsigned in PyTorch's trace"
            )
        if event.size >= limit or event.address >= limit or not 0 <= event.stream < limit:
            return (
                f"device_traces[{device}][{index}] ({show(event.action)}) has size "
                f"{_short_int(event.size)}, address {_short_int(event.address)} and stream "
                f"{_short_int(event.stream)}; each is a 64-bit value in PyTorch's trace"
            )
        if event.time_us is not None and not -limit < event.time_us < limit:
            return (
                f"device_traces[{device}][{index}] has time_us {_short_int(event.time_us)}, "
                "past a 64-bit time"
            )
    return None


def pool_id_problem(value: Any, where: str, key: str) -> str | None:
    """Why ``value`` is not a pool id (a pair of ints in 0 to 2**64 - 1); None when it is."""
    if (
        isinstance(value, (tuple, list))
        and len(value) == 2
        and all(type(p) is int and 0 <= p < _POOL_ID_LIMIT for p in value)
    ):
        return None
    return (
        f"{where}: {key!r} is {show(value)}; PyTorch records a pool id as a pair of "
        "non-negative ints, e.g. (0, 0) for the default pool"
    )


def settings_problem(settings: Mapping[Any, Any]) -> str | None:
    """The first ``allocator_settings`` field whose value has a type PyTorch never records, or
    a number that is not finite or out of range; None when every known field is sane."""
    for key, types in _SETTING_TYPES.items():
        if key not in settings:
            continue
        value = settings[key]
        if value is None:
            continue
        wrong = not isinstance(value, types) or (bool not in types and type(value) is bool)
        if not wrong and isinstance(value, float):
            wrong = not math.isfinite(value)
        if not wrong and type(value) is int:
            wrong = not -_ADDRESS_LIMIT < value < _ADDRESS_LIMIT
        if wrong:
            names = " or ".join(t.__name__ for t in types)
            return f"allocator_settings[{key!r}] is {show(value)}; PyTorch records a {names}"
    return None


def _hex(value: int) -> str:
    """An address for a message, in hex while it fits 64 bits."""
    return f"{value:#x}" if 0 <= value < _ADDRESS_LIMIT else _short_int(value)


def _short_int(value: int) -> str:
    """An int for a message: a 6,000-digit one would swamp it (and str() of a huge int is
    refused past sys.get_int_max_str_digits)."""
    if -(10**30) < value < 10**30:
        return str(value)
    return f"a {value.bit_length()}-bit number"

"""Normalised snapshot records: every snapshot generation is read into these (ref §11.2)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from oomkit.core.trace import Frame, TraceEvent

__all__ = [
    "BlockState",
    "FORMAT_GENERATIONS",
    "SegmentType",
    "Snapshot",
    "SnapshotBlock",
    "SnapshotSegment",
]

# DeviceCachingAllocator::snapshot block states (ref §11.2). The docstring's
# "active_awaiting_free" is read as "active_pending_free", the value actually emitted.
BlockState = Literal["active_allocated", "active_pending_free", "inactive"]
SegmentType = Literal["small", "large"]

# Snapshot.format_generation values, oldest first:
FORMAT_GENERATIONS: tuple[str, ...] = (
    # a bare list of segments (torch.cuda.memory_snapshot(), or _snapshot() up to 1.13)
    "list-of-segments",
    # a dict whose blocks carry `history` and no `address` (≈ 2.0)
    "segments-with-history",
    # a dict with `segments` only
    "segments-dict",
    # `device_traces`, then with `allocator_settings` and/or `external_annotations` (newer)
    "device-traces",
    "device-traces+settings",
    "device-traces+annotations",
    "device-traces+settings+annotations",
)


@dataclass(frozen=True, slots=True)
class SnapshotBlock:
    """One block of a segment, in address order.

    ``requested_size`` of a free block is stale: the last value it held (ref §11.2).
    ``frames`` is where the block's current (or last) allocation was made, when recorded.
    """

    address: int
    size: int
    requested_size: int
    state: str
    frames: tuple[Frame, ...] = ()


@dataclass(frozen=True, slots=True)
class SnapshotSegment:
    """One segment (or, for an expandable segment, one contiguous mapped run) at snapshot time.

    ``pool_id`` is PyTorch's ``segment_pool_id``: ``(0, 0)`` for the default pool, another
    pair for a private pool (CUDA graphs, MemPool).
    """

    device: int
    address: int
    total_size: int
    stream: int
    segment_type: str
    allocated_size: int
    active_size: int
    requested_size: int
    is_expandable: bool
    blocks: tuple[SnapshotBlock, ...]
    frames: tuple[Frame, ...] = ()
    pool_id: tuple[int, int] = (0, 0)


@dataclass(frozen=True)
class Snapshot:
    """A memory snapshot, whatever generation of PyTorch wrote it.

    Attributes:
        segments: every device's segments, each device's part in address order.
        device_traces: device index -> its trace events, oldest first. Every device the file
            lists a trace for is present, even when that trace is empty.
        allocator_settings: the recorded ``allocator_settings`` dict, or None (older files).
        external_annotations: ``record_function`` annotations (dicts with ``stage``, ``name``,
            ``device``, ``time_us``), empty when not recorded.
        user_metadata: a top-level ``user_metadata`` dict when the file has one.
        format_generation: one of ``FORMAT_GENERATIONS``; see ``infer_torch_version``.
        source: the file it was read from, or None when read from bytes.
        keys_seen: every key the file used, as ``"kind:key"`` with kind ``top``, ``segment``,
            ``block``, ``trace`` or ``settings`` (e.g. ``"block:history"``); the evidence
            ``infer_torch_version`` reads.
        warnings: what was assumed while reading (e.g. inferred block addresses).
        other_actions: every trace action other than ``alloc``, ``free_requested`` and
            ``free_completed`` (segment events, ``oom``, ``snapshot``, ``annotate``), of every
            device, as the reader noted them while it checked the traces; None when not noted
            (a snapshot built otherwise): ``infer_torch_version`` then reads the traces.
    """

    segments: tuple[SnapshotSegment, ...]
    device_traces: dict[int, tuple[TraceEvent, ...]]
    allocator_settings: dict[str, Any] | None = None
    external_annotations: tuple[Mapping[str, Any], ...] = ()
    user_metadata: dict[str, Any] | None = None
    format_generation: str = "device-traces+settings+annotations"
    source: str | None = None
    keys_seen: frozenset[str] = field(default=frozenset())
    warnings: tuple[str, ...] = field(default=())
    other_actions: frozenset[str] | None = None

    def devices(self) -> list[int]:
        """Devices with segments or trace events other than ``snapshot`` markers, ascending.

        PyTorch records a ``snapshot`` entry on every device each time a snapshot is taken, so
        a device whose trace holds only those was not used. When no device qualifies, the
        devices with any trace entry are listed instead.
        """
        used = {seg.device for seg in self.segments}
        for device, events in self.device_traces.items():
            if any(ev.action != "snapshot" for ev in events):
                used.add(device)
        if not used:
            used = {d for d, events in self.device_traces.items() if events}
        return sorted(used)

    def segments_for(self, device: int) -> tuple[SnapshotSegment, ...]:
        """The segments of one device, in address order."""
        return tuple(sorted((s for s in self.segments if s.device == device), key=_address))

    def trace_for(self, device: int) -> tuple[TraceEvent, ...]:
        """The trace events of one device, oldest first; empty when none were recorded."""
        return self.device_traces.get(device, ())


def _address(segment: SnapshotSegment) -> int:
    return segment.address

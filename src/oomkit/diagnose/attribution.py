"""Who held the memory: a snapshot's trace walked into allocation lifetimes, levels and live sets.

``trace_history`` turns one device's trace (oldest first) and its final segments into one record
per allocation (when it was made, when it was freed) and the allocated / reserved level after
every event; ``attribute`` then says, for one moment, what was live: bytes by category (where the
trace carries oomkit's ``category`` tags), the top allocation sites (the first user frame of each
allocation: file:line and function, skipping PyTorch's own C++ and Python frames; the ``module``
tag where the tracer recorded one) and the largest live tensors.

Sizes are block sizes, as ``memory_allocated`` counts them: an allocation still live at the end
takes its block's size from the final segments; one freed during the trace is rounded as the
recorded setting rounds it (``round_size``; CUDACachingAllocator.cpp round_size, ref §2.1).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypedDict

from oomkit.core.trace import Frame, TraceEvent

if TYPE_CHECKING:
    # An annotation only: `oomkit report` uses the site helpers without the snapshot reader.
    from oomkit.core.snapshot import SnapshotSegment

__all__ = [
    "AllocationRecord",
    "AllocationSite",
    "Attribution",
    "LiveTensor",
    "MIN_LEAK_BYTES",
    "TraceHistory",
    "attribute",
    "site_of",
    "trace_history",
]

# A leak must add up to at least this much (and 1% of the peak) to be reported, by the per-step
# leak test (memory_health) and the snapshot diagnosis' leak finding: smaller growth (a Python
# float kept as a 512-byte tensor per step) is real but never the cause of an OOM. Defined here,
# where both find it, so that the snapshot diagnosis does not import the per-step judges.
MIN_LEAK_BYTES = 2**20

# How many sites and tensors an attribution lists.
TOP_SITES = 10
TOP_TENSORS = 10

# Allocated-level changes per action (ref §11.2 trace table): ``memory_allocated`` drops at the
# free request (DeviceCachingAllocator::free), not when a cross-stream free completes.
_SEGMENT_UP = ("segment_alloc", "segment_map")
_SEGMENT_DOWN = ("segment_free", "segment_unmap")

# Path fragments of frames that belong to PyTorch (or oomkit's tracer), not to the user's code.
_INTERNAL_PARTS = ("/torch/", "\\torch\\", "/oomkit/", "\\oomkit\\", "<frozen ")


@dataclass(frozen=True, slots=True)
class AllocationRecord:
    """One allocation seen in the trace (or live before it began).

    Attributes:
        alloc_index: index of its ``alloc`` event; -1 when it was live before the trace began.
        address: the block's address.
        size_bytes: the block size it counted in ``memory_allocated``.
        requested_bytes: the size asked for (unrounded).
        freed_index: index of its ``free_requested`` event; None when still live at the end.
        frames: where it was allocated (innermost first), when recorded.
        tags: oomkit's tags of its alloc event (``category``, ``module``...).
    """

    alloc_index: int
    address: int
    size_bytes: int
    requested_bytes: int
    freed_index: int | None
    frames: tuple[Frame, ...] = ()
    tags: tuple[tuple[str, str], ...] = ()

    def live_at(self, index: int) -> bool:
        """Live just after event ``index``."""
        return self.alloc_index <= index and (self.freed_index is None or self.freed_index > index)


@dataclass(frozen=True)
class TraceHistory:
    """One device's trace as allocation lifetimes and levels.

    Attributes:
        events: the trace, oldest first.
        records: every allocation, in order of its alloc event (those live before the trace
            began first, with ``alloc_index`` -1).
        allocated_bytes: ``memory_allocated`` after each event.
        reserved_bytes: ``memory_reserved`` after each event.
        start_allocated_bytes: ``memory_allocated`` before the first event.
        start_reserved_bytes: ``memory_reserved`` before the first event.
    """

    events: tuple[TraceEvent, ...]
    records: tuple[AllocationRecord, ...]
    allocated_bytes: tuple[int, ...]
    reserved_bytes: tuple[int, ...]
    start_allocated_bytes: int
    start_reserved_bytes: int

    def peak_reserved_moment(self) -> int | None:
        """The event after which reserved memory is first at its peak; None with no events.

        The one moment at which oomkit measures fragmentation (``diff``, ``explain``): reserved
        minus allocated there is what the cache held but could not use when the device held
        most. As the predictor counts it (prediction/_replay.py after_event): the first alloc
        after which reserved is at its peak; in a recorded trace the segment_alloc comes
        first, so the moment right after it does not count the allocation that caused it yet.
        """
        if not self.reserved_bytes:
            return None
        peak = max(self.reserved_bytes)
        at_peak = [i for i, r in enumerate(self.reserved_bytes) if r == peak]
        return next((i for i in at_peak if self.events[i].action == "alloc"), at_peak[0])


@dataclass(frozen=True)
class AllocationSite:
    """Live bytes grouped by where they were allocated.

    Attributes:
        filename: the user's source file, or None when no user frame was recorded.
        line: its line.
        function: the function name.
        module: the ``nn.Module`` path (oomkit's tracer tags), where known.
        live_bytes: bytes live at the moment from this site.
        count: live allocations from this site.
    """

    filename: str | None
    line: int | None
    function: str | None
    module: str | None
    live_bytes: int
    count: int

    @property
    def label(self) -> str:
        """``file.py:12 in step`` (with ``[module]``), ``module h.0.mlp``, or a placeholder."""
        if self.filename is None:
            return f"module {self.module}" if self.module else "(no user frame recorded)"
        where = f"{self.filename}:{self.line} in {self.function}"
        return where + (f" [{self.module}]" if self.module else "")


@dataclass(frozen=True)
class LiveTensor:
    """One live allocation at the moment.

    Attributes:
        address: its block address.
        size_bytes: its block size.
        requested_bytes: the size asked for.
        site: where it was allocated (``AllocationSite.label``).
        category: oomkit's category tag, where known.
    """

    address: int
    size_bytes: int
    requested_bytes: int
    site: str
    category: str | None = None


@dataclass(frozen=True)
class Attribution:
    """What was live at one moment.

    Attributes:
        moment: ``"oom"`` (the recorded OOM), ``"peak"`` (peak allocated) or ``"final"``.
        event_index: the moment's trace index; None for the final state without a trace.
        allocated_bytes: live bytes then.
        by_category_bytes: live bytes by oomkit category tag, largest first; empty when the
            trace carries no tags (PyTorch's own recordings).
        top_sites: the ``TOP_SITES`` sites holding most live bytes, largest first.
        largest_tensors: the ``TOP_TENSORS`` largest live allocations, largest first.
    """

    moment: str
    event_index: int | None
    allocated_bytes: int
    by_category_bytes: Mapping[str, int] = field(default_factory=dict)
    top_sites: tuple[AllocationSite, ...] = ()
    largest_tensors: tuple[LiveTensor, ...] = ()


class _RecordFields(TypedDict):
    """An ``AllocationRecord`` while the walk still fills it in (its size and free event)."""

    alloc_index: int
    address: int
    size_bytes: int
    requested_bytes: int
    freed_index: int | None
    frames: tuple[Frame, ...]
    tags: tuple[tuple[str, str], ...]


# An allocation site's key: file, line, function and module tag (AllocationSite's first fields).
_SiteKey = tuple[str | None, int | None, str | None, str | None]


def _is_internal(frame: Frame) -> bool:
    name = frame.filename
    if not name.endswith(".py") or frame.line <= 0:
        return True  # C++ frames ("??", "CUDACachingAllocator.cpp") and unknown files
    return any(part in name for part in _INTERNAL_PARTS)


def site_of(frames: Sequence[Frame]) -> Frame | None:
    """The innermost user frame: not PyTorch's C++ or Python, preferring code outside packages.

    PyTorch records frames innermost first (CapturedTraceback). A frame in ``site-packages``
    (transformers, a training library) is used only when no frame of the user's own files is.
    """
    candidates = [f for f in frames if not _is_internal(f)]
    for frame in candidates:
        if "site-packages" not in frame.filename and "dist-packages" not in frame.filename:
            return frame
    return candidates[0] if candidates else None


def thin_timeline(
    points: Sequence[tuple[float, int, int]], max_points: int
) -> tuple[tuple[float, int, int], ...]:
    """At most ``max_points`` ``(x, allocated, reserved)`` points: consecutive points merged
    into one at the run's last x with the run's highest levels, so no peak is lost."""
    count = len(points)
    if count <= max_points:
        return tuple(points)
    per = -(-count // max_points)
    out = []
    for start in range(0, count, per):
        run = points[start : start + per]
        out.append((run[-1][0], max(p[1] for p in run), max(p[2] for p in run)))
    return tuple(out)


def trace_history(
    events: Sequence[TraceEvent],
    final_segments: Sequence[SnapshotSegment],
    round_size: Callable[[int], int],
) -> TraceHistory:
    """Walk one device's trace into allocation records and per-event levels.

    Args:
        events: the device's trace, oldest first (any pool; private-pool allocations count in
            ``memory_allocated`` too).
        final_segments: the device's segments at snapshot time.
        round_size: the recorded setting's block rounding, for allocations freed in the trace.

    Returns:
        The history; its levels end at the final segments' allocated and reserved bytes.
    """
    final_blocks = {
        b.address: b for seg in final_segments for b in seg.blocks if b.state == "active_allocated"
    }
    open_records: dict[int, _RecordFields] = {}
    done: list[_RecordFields] = []
    before: list[_RecordFields] = []
    alloc_delta = [0] * len(events)
    reserved_delta = [0] * len(events)
    for i, ev in enumerate(events):
        action = ev.action
        if action == "alloc":
            rec: _RecordFields = {
                "alloc_index": i,
                "address": ev.address,
                "size_bytes": round_size(ev.size) if ev.size > 0 else 0,
                "requested_bytes": ev.size,
                "freed_index": None,
                "frames": ev.frames,
                "tags": ev.tags,
            }
            stale = open_records.pop(ev.address, None)
            if stale is not None:  # an address reused without a recorded free: freed here
                stale["freed_index"] = i
                alloc_delta[i] -= stale["size_bytes"]
            open_records[ev.address] = rec
            done.append(rec)
        elif action == "free_requested":
            known = open_records.pop(ev.address, None)
            if known is not None:
                rec = known
            else:  # allocated before the trace began (ring buffer or late start)
                rec = {
                    "alloc_index": -1,
                    "address": ev.address,
                    "size_bytes": round_size(ev.size) if ev.size > 0 else 0,
                    "requested_bytes": ev.size,
                    "freed_index": i,
                    "frames": (),
                    "tags": (),
                }
                before.append(rec)
            rec["freed_index"] = i
            alloc_delta[i] = -rec["size_bytes"]
        elif action in _SEGMENT_UP:
            reserved_delta[i] = ev.size
        elif action in _SEGMENT_DOWN:
            reserved_delta[i] = -ev.size
    # Allocations still live at the end take their exact block size from the final state.
    for address, rec in open_records.items():
        block = final_blocks.get(address)
        if block is not None:
            rec["size_bytes"] = block.size
    for rec in done:
        if rec["alloc_index"] >= 0:
            alloc_delta[rec["alloc_index"]] += rec["size_bytes"]
    open_addresses = set(open_records)
    # Blocks live at the end and never seen in the trace were live throughout.
    for address, block in final_blocks.items():
        if address not in open_addresses:
            before.append(
                {
                    "alloc_index": -1,
                    "address": address,
                    "size_bytes": block.size,
                    "requested_bytes": block.requested_size,
                    "freed_index": None,
                    "frames": block.frames,
                    "tags": (),
                }
            )
    final_allocated = sum(b.size for b in final_blocks.values())
    final_reserved = sum(seg.total_size for seg in final_segments)
    start_allocated = final_allocated - sum(alloc_delta)
    start_reserved = final_reserved - sum(reserved_delta)
    allocated: list[int] = []
    reserved: list[int] = []
    level_a, level_r = start_allocated, start_reserved
    for da, dr in zip(alloc_delta, reserved_delta, strict=True):
        level_a += da
        level_r += dr
        allocated.append(level_a)
        reserved.append(level_r)
    records = tuple(AllocationRecord(**rec) for rec in [*before, *done])
    return TraceHistory(
        events=tuple(events),
        records=records,
        allocated_bytes=tuple(allocated),
        reserved_bytes=tuple(reserved),
        start_allocated_bytes=start_allocated,
        start_reserved_bytes=start_reserved,
    )


def attribute(history: TraceHistory, index: int | None, moment: str) -> Attribution:
    """What was live just after event ``index`` (None: the final state).

    Args:
        history: from ``trace_history``.
        index: the moment's event index; None for the end of the trace.
        moment: ``"oom"``, ``"peak"`` or ``"final"``, carried into the result.

    Returns:
        Bytes by category, top sites and largest tensors at that moment.
    """
    at = len(history.events) if index is None else index
    live = [r for r in history.records if r.live_at(at)]
    by_category: dict[str, int] = {}
    sites: dict[_SiteKey, list[int]] = {}
    tensors: list[LiveTensor] = []
    for rec in live:
        tags = dict(rec.tags)
        category = tags.get("category")
        if category is not None:
            by_category[category] = by_category.get(category, 0) + rec.size_bytes
        frame = site_of(rec.frames)
        key: _SiteKey = (
            frame.filename if frame else None,
            frame.line if frame else None,
            frame.name if frame else None,
            tags.get("module"),
        )
        entry = sites.setdefault(key, [0, 0])
        entry[0] += rec.size_bytes
        entry[1] += 1
        site = AllocationSite(*key, live_bytes=rec.size_bytes, count=1)
        tensors.append(
            LiveTensor(rec.address, rec.size_bytes, rec.requested_bytes, site.label, category)
        )
    top_sites = sorted(
        (AllocationSite(*key, live_bytes=v[0], count=v[1]) for key, v in sites.items()),
        key=lambda s: (-s.live_bytes, s.label),
    )[:TOP_SITES]
    tensors.sort(key=lambda t: (-t.size_bytes, t.address))
    return Attribution(
        moment=moment,
        event_index=index,
        allocated_bytes=sum(r.size_bytes for r in live),
        by_category_bytes=dict(sorted(by_category.items(), key=lambda kv: (-kv[1], kv[0]))),
        top_sites=tuple(top_sites),
        largest_tensors=tuple(tensors[:TOP_TENSORS]),
    )

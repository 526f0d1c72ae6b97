"""The replay behind a prediction: one pass through the simulator, then the live set at a moment.

The pass is ``oomkit.core.replay``'s engine (as ``simulate_events`` runs it) with hooks that also
keep, for every alloc, the bytes the allocator counted for it (its rounded block size, read as
the change in ``allocated_bytes.all.current``), where the peaks happened, per-step peaks and a
bounded timeline. The breakdown at a moment is computed afterwards by walking the events up to
it, so the hot loop stays cheap.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from oomkit.core.allocator import AllocatorConfig, CachingAllocator, SimulatedOutOfMemoryError
from oomkit.core.allocator.stats import ALLOCATED_BYTES, CUR, RESERVED_BYTES
from oomkit.core.replay import ReplayEngine, ReplayHooks
from oomkit.core.trace import TraceEvent
from oomkit.prediction.module_groups import natural_key

__all__ = [
    "MAX_TIMELINE_POINTS",
    "ReplayPass",
    "TimelinePoint",
    "StepPeak",
    "LiveBreakdown",
    "replay_for_prediction",
    "category_levels",
    "live_breakdown",
    "step_of",
]

# Enough points to draw a step's memory curve; the timeline of a long trace is bucketed so that
# each point holds the maximum of its bucket (peaks are never sampled away).
MAX_TIMELINE_POINTS = 1000

# Where a module tag is absent (parameters tracked before the step, gradients accumulated by
# autograd, optimizer state) the bytes are not attributed to a module.
_NO_CATEGORY = "unknown"

# The current-value slots of the two levels in a pool's stat list (stats.py).
_ALLOCATED = ALLOCATED_BYTES + CUR
_RESERVED = RESERVED_BYTES + CUR


@dataclass(frozen=True)
class TimelinePoint:
    """The most memory in use over a run of consecutive events.

    Attributes:
        event_index: the last event of the run (index into the recording's events).
        step: the step of that event, counted from 1 as users count; ``None`` before the first
            step.
        allocated_bytes: the highest ``allocated_bytes.all.current`` over the run.
        reserved_bytes: the highest ``reserved_bytes.all.current`` over the run.
        by_category_bytes: allocated block bytes by category tag just after ``event_index``
            (filled by :func:`category_levels`; empty until then).
    """

    event_index: int
    step: int | None
    allocated_bytes: int
    reserved_bytes: int
    by_category_bytes: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class StepPeak:
    """The peaks of one recorded step.

    Attributes:
        step: the step's number, counted from 1 (the first recorded step is step 1).
        first_event_index: index of the step's first event.
        peak_allocated_bytes: highest allocated bytes during the step.
        peak_reserved_bytes: highest reserved bytes during the step.
    """

    step: int
    first_event_index: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int


@dataclass(frozen=True)
class LiveBreakdown:
    """What was allocated at one moment, by category, by module and by CUDA stream id (block
    sizes, rounded)."""

    by_category_bytes: dict[str, int]
    by_module_bytes: dict[str, int]
    unattributed_bytes: int
    by_stream_category_bytes: dict[int, dict[str, int]] = field(default_factory=dict)


@dataclass
class ReplayPass:
    """What one pass through the simulator found (mutable while the pass runs)."""

    events: int = 0
    peak_allocated_bytes: int = 0
    peak_allocated_index: int | None = None
    reserved_at_peak_allocated_bytes: int = 0
    peak_reserved_bytes: int = 0
    peak_reserved_index: int | None = None
    block_bytes: dict[int, int] = field(default_factory=dict)  # alloc event index -> bytes
    # (last event index, allocated, reserved) per timeline bucket: category_levels makes them
    # TimelinePoints (with the step and the categories).
    timeline: list[tuple[int, int, int]] = field(default_factory=list)
    step_peaks: list[StepPeak] = field(default_factory=list)
    oom_index: int | None = None
    oom_error: SimulatedOutOfMemoryError | None = None
    num_device_alloc: int = 0
    num_device_free: int = 0
    num_alloc_retries: int = 0
    # set_per_process_memory_fraction's limit on what the allocator reserves; None: no limit.
    allowed_bytes: int | None = None

    def usable_bytes(self, device_usable_bytes: int) -> int:
        """What PyTorch may reserve: the device's usable memory, or less under a fraction."""
        if self.allowed_bytes is None:
            return device_usable_bytes
        return min(device_usable_bytes, self.allowed_bytes)


def step_of(step_starts: Sequence[int], index: int) -> int | None:
    """The step that event ``index`` belongs to, counted from 1 as users count (the first
    recorded step is step 1, as ``oomkit fit`` and the reports say); ``None`` before it."""
    step = bisect_right(step_starts, index)
    return None if step == 0 else step


def replay_for_prediction(
    events: Sequence[TraceEvent],
    step_starts: Sequence[int],
    config: AllocatorConfig,
    *,
    capacity_bytes: int,
    reserved_outside_bytes: int,
    torch_version: str | None,
    max_points: int = MAX_TIMELINE_POINTS,
    memory_fraction: float | None = None,
) -> ReplayPass:
    """Replay a recording's requests and note peaks, per-alloc bytes and a bounded timeline.

    Args:
        events: the recording's events, in order.
        step_starts: index of each step's first event.
        config: allocator settings.
        capacity_bytes: the device's total memory.
        reserved_outside_bytes: memory held outside the allocator (CUDA context).
        torch_version: the PyTorch version whose allocator to model; ``None`` is the newest.
        max_points: the most timeline points to keep.
        memory_fraction: the step's ``torch.cuda.set_per_process_memory_fraction``, applied
            before the first request (``CachingAllocator.set_per_process_memory_fraction``).

    Returns:
        The pass; it stops at the first request the simulator cannot serve (``oom_index``).

    Raises:
        TraceFormatError: the events free an id that is not live or allocate a live id twice.
    """
    allocator = CachingAllocator(
        config,
        capacity_bytes=capacity_bytes,
        reserved_outside_bytes=reserved_outside_bytes,
        torch_version=torch_version,
    )
    out = ReplayPass()
    if memory_fraction is not None:
        allocator.set_per_process_memory_fraction(memory_fraction)
    # The limit of either fraction: the step's call, or the setting's per_process_memory_fraction,
    # applied when the device allocator is created (ref §14 table; not by a runtime update).
    out.allowed_bytes = allocator.allowed_memory_maximum
    hooks = _PredictionHooks(allocator, out, len(events), step_starts, max_points)
    engine = ReplayEngine(allocator, hooks)
    engine.run(events)
    hooks.close_step()
    out.oom_index, out.oom_error = engine.oom_index, engine.oom_error
    out.events = engine.replayed if engine.oom_index is None else engine.oom_index
    stats = allocator.memory_stats()
    out.num_device_alloc = stats["num_device_alloc"]
    out.num_device_free = stats["num_device_free"]
    out.num_alloc_retries = stats["num_alloc_retries"]
    return out


class _PredictionHooks(ReplayHooks):
    """The engine's hooks for a prediction: per-alloc bytes, peaks, per-step peaks, a timeline.

    ``after_event`` runs for every event, so most events take a short path (issue 19: the hooks
    cost as much as the allocator did). Only an ``alloc`` raises ``allocated_bytes`` or
    ``reserved_bytes`` (a free lowers allocated and leaves reserved; ``empty_cache`` lowers
    reserved): after any other event the levels are no higher than after the event before it.
    So such an event cannot raise a peak or a running maximum, unless it is the first of a
    timeline bucket (whose maxima start from nothing); a step's maxima start from the levels
    just before its first event, which it cannot exceed either. Those events only note the
    allocated level (the next alloc's block bytes are the change from it), except at a *mark*:
    a bucket's first or last event, the event before a step's first, or the trace's last
    event, where the whole bookkeeping runs. ``tests/prediction/test_replay_hooks.py`` compares
    every field with the plain every-event bookkeeping.
    """

    def __init__(
        self,
        allocator: CachingAllocator,
        out: ReplayPass,
        num_events: int,
        step_starts: Sequence[int],
        max_points: int,
    ) -> None:
        self.out = out
        # allocated_bytes.all.current is small[ALLOCATED] + large[ALLOCATED] (stats.py).
        self.small, self.large = allocator.pool_stat_lists()
        self.num_events = num_events
        # Timeline buckets: each point is the maximum over its bucket of events.
        self.bucket = max(1, -(-num_events // max(1, max_points)))
        self.bucket_alloc = self.bucket_res = 0
        self.starts = list(step_starts)
        self.next_start = 0
        self.step: int | None = None
        self.step_alloc = self.step_res = 0
        # allocated_bytes.all.current after the previous event: an alloc's block bytes are the
        # change from it.
        self.level = allocator.memory_allocated()
        # The events that take the whole bookkeeping whatever their action, in order, and the
        # next of them (-1: none left).
        self.marks = iter(_marks(num_events, self.bucket, self.starts))
        self.mark = next(self.marks, -1)
        if num_events:
            self._maybe_open_step(0, self.level, allocator.memory_reserved())

    def _maybe_open_step(self, index: int, now_alloc: int, now_res: int) -> None:
        """Start the next step if event ``index`` is its first (levels: just before it)."""
        starts = self.starts
        if self.next_start < len(starts) and index == starts[self.next_start]:
            self.close_step()
            self.step = self.next_start
            self.next_start += 1
            self.step_alloc, self.step_res = now_alloc, now_res

    def close_step(self) -> None:
        """Record the peaks of the running step, if any."""
        if self.step is not None:
            step = self.step  # an index into the step starts; the record counts from 1
            self.out.step_peaks.append(
                StepPeak(step + 1, self.starts[step], self.step_alloc, self.step_res)
            )

    def after_event(self, index: int, event: TraceEvent) -> None:
        small, large = self.small, self.large
        now_alloc = small[_ALLOCATED] + large[_ALLOCATED]
        is_alloc = event.action == "alloc"
        if not is_alloc and index != self.mark:
            self.level = now_alloc
            return
        now_res = small[_RESERVED] + large[_RESERVED]
        if is_alloc:
            out = self.out
            out.block_bytes[index] = now_alloc - self.level
            if now_alloc > out.peak_allocated_bytes:
                out.peak_allocated_bytes, out.peak_allocated_index = now_alloc, index
                out.reserved_at_peak_allocated_bytes = now_res
            if now_res > out.peak_reserved_bytes:
                out.peak_reserved_bytes, out.peak_reserved_index = now_res, index
        self.level = now_alloc
        # Running maxima (comparisons, not max(): this runs for most events).
        if now_alloc > self.bucket_alloc:
            self.bucket_alloc = now_alloc
        if now_res > self.bucket_res:
            self.bucket_res = now_res
        if now_alloc > self.step_alloc:
            self.step_alloc = now_alloc
        if now_res > self.step_res:
            self.step_res = now_res
        if index == self.mark:
            self._at_mark(index, now_alloc, now_res)

    def _at_mark(self, index: int, now_alloc: int, now_res: int) -> None:
        """A mark's bookkeeping beyond the maxima: the timeline point, the next step."""
        after = index + 1
        if after % self.bucket == 0 or after == self.num_events:
            # (event index, allocated, reserved): category_levels makes the TimelinePoint.
            self.out.timeline.append((index, self.bucket_alloc, self.bucket_res))
            self.bucket_alloc = self.bucket_res = 0
        if after < self.num_events:
            self._maybe_open_step(after, now_alloc, now_res)
        self.mark = next(self.marks, -1)


def _marks(num_events: int, bucket: int, step_starts: Sequence[int]) -> list[int]:
    """The events after which a prediction's hooks do all their bookkeeping, in order: each
    timeline bucket's first event (its maxima start from nothing) and last (its point is
    taken), the event before each step's first (the step opens with the levels after it) and
    the trace's last event."""
    if num_events <= 0:
        return []
    marks = {num_events - 1}
    for first in range(0, num_events, bucket):
        marks.add(first)
        marks.add(min(first + bucket, num_events) - 1)
    marks.update(start - 1 for start in step_starts if 0 < start < num_events)
    return sorted(marks)


def category_levels(
    events: Sequence[TraceEvent],
    block_bytes: dict[int, int],
    points: Sequence[tuple[int, int, int]],
    step_starts: Sequence[int],
) -> list[TimelinePoint]:
    """The timeline points, each with its step and the live bytes of each category just after
    its event.

    One pass over the events (as :func:`live_breakdown` walks them, but once for every point).

    Args:
        events: the recording's events.
        block_bytes: per alloc event index, the bytes the allocator counted (``ReplayPass``).
        points: ``ReplayPass.timeline``: (event index, allocated, reserved), in event order.
        step_starts: index of each step's first event.
    """
    live: dict[int, tuple[str, int]] = {}  # recording id -> (category, block bytes)
    levels: dict[str, int] = {}
    out: list[TimelinePoint] = []
    index = 0
    count = len(events)
    # The levels as a point shows them; points between which nothing changed share one.
    shown: dict[str, int] = {}
    changed = True
    # Written out (no per-event calls): a prediction runs it over every event (issue 19).
    for event_index, allocated_bytes, reserved_bytes in points:
        stop = min(event_index + 1, count)
        while index < stop:
            event = events[index]
            action = event.action
            if action == "alloc":
                nbytes = block_bytes.get(index, 0)
                if nbytes:
                    category = _NO_CATEGORY
                    for name, text in event.tags:  # event.tag("category"): the last one
                        if name == "category":
                            category = text
                    live[event.address] = (category, nbytes)
                    levels[category] = levels.get(category, 0) + nbytes
                    changed = True
            elif action == "free_completed" and event.address in live:
                category, nbytes = live.pop(event.address)
                levels[category] -= nbytes
                changed = True
            index += 1
        if changed:
            # _sorted's order (largest first, ties by natural_key, then as inserted: its sort
            # is stable), each key made once per item.
            ranked = sorted(
                [(-v, natural_key(k), i, k) for i, (k, v) in enumerate(levels.items()) if v]
            )
            shown = {k: -negative for negative, _, _, k in ranked}
            changed = False
        out.append(
            TimelinePoint(
                event_index,
                step_of(step_starts, event_index),
                allocated_bytes,
                reserved_bytes,
                shown,
            )
        )
    return out


def live_breakdown(
    events: Sequence[TraceEvent], block_bytes: dict[int, int], upto_index: int | None
) -> LiveBreakdown:
    """What was allocated just after event ``upto_index``, by category and module.

    Args:
        events: the recording's events.
        block_bytes: per alloc event index, the bytes the allocator counted (``ReplayPass``).
        upto_index: the last event to include; ``None`` for the moment before any event.

    Returns:
        Block bytes of every live allocation, summed by its ``category`` tag and by its
        ``module`` tag (allocations without a module tag go to ``unattributed_bytes``).
    """
    live: dict[int, int] = {}  # recording id -> alloc event index
    if upto_index is not None:
        for index in range(upto_index + 1):
            event = events[index]
            if event.action == "alloc":
                live[event.address] = index
            elif event.action == "free_completed":
                live.pop(event.address, None)
    by_category: dict[str, int] = {}
    by_module: dict[str, int] = {}
    by_stream: dict[int, dict[str, int]] = {}
    unattributed = 0
    for index in live.values():
        nbytes = block_bytes.get(index, 0)
        if not nbytes:
            continue
        tags = dict(events[index].tags)
        category = tags.get("category", _NO_CATEGORY)
        on_stream = by_stream.setdefault(events[index].stream, {})
        on_stream[category] = on_stream.get(category, 0) + nbytes
        by_category[category] = by_category.get(category, 0) + nbytes
        module = tags.get("module")
        if module is None:
            unattributed += nbytes
        else:
            by_module[module] = by_module.get(module, 0) + nbytes
    return LiveBreakdown(
        _sorted(by_category),
        _sorted(by_module),
        unattributed,
        {stream: _sorted(by_stream[stream]) for stream in sorted(by_stream)},
    )


def _sorted(counts: dict[str, int]) -> dict[str, int]:
    # Largest first; ties in numeric order of the names (h.2 before h.10).
    return dict(sorted(counts.items(), key=lambda item: (-item[1], natural_key(item[0]))))

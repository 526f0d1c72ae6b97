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
    timeline: list[TimelinePoint] = field(default_factory=list)
    step_peaks: list[StepPeak] = field(default_factory=list)
    oom_index: int | None = None
    oom_error: SimulatedOutOfMemoryError | None = None
    num_device_alloc: int = 0
    num_device_free: int = 0
    num_alloc_retries: int = 0


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
    """The engine's hooks for a prediction: per-alloc bytes, peaks, per-step peaks, a timeline."""

    def __init__(
        self,
        allocator: CachingAllocator,
        out: ReplayPass,
        num_events: int,
        step_starts: Sequence[int],
        max_points: int,
    ) -> None:
        self.out = out
        self.allocated = allocator.memory_allocated
        self.reserved = allocator.memory_reserved
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
        self.level = self.allocated()
        if num_events:
            self._maybe_open_step(0, self.level, self.reserved())

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
        out = self.out
        now_alloc, now_res = self.allocated(), self.reserved()
        if event.action == "alloc":
            out.block_bytes[index] = now_alloc - self.level
            if now_alloc > out.peak_allocated_bytes:
                out.peak_allocated_bytes, out.peak_allocated_index = now_alloc, index
                out.reserved_at_peak_allocated_bytes = now_res
            if now_res > out.peak_reserved_bytes:
                out.peak_reserved_bytes, out.peak_reserved_index = now_res, index
        self.level = now_alloc
        # Running maxima (comparisons, not max(): this runs once per event).
        if now_alloc > self.bucket_alloc:
            self.bucket_alloc = now_alloc
        if now_res > self.bucket_res:
            self.bucket_res = now_res
        if now_alloc > self.step_alloc:
            self.step_alloc = now_alloc
        if now_res > self.step_res:
            self.step_res = now_res
        if (index + 1) % self.bucket == 0 or index + 1 == self.num_events:
            out.timeline.append(
                TimelinePoint(index, step_of(self.starts, index), self.bucket_alloc, self.bucket_res)
            )
            self.bucket_alloc = self.bucket_res = 0
        if index + 1 < self.num_events:
            self._maybe_open_step(index + 1, now_alloc, now_res)


def category_levels(
    events: Sequence[TraceEvent], block_bytes: dict[int, int], points: Sequence[TimelinePoint]
) -> list[TimelinePoint]:
    """The timeline points with the live bytes of each category just after their event.

    One pass over the events (as :func:`live_breakdown` walks them, but once for every point).

    Args:
        events: the recording's events.
        block_bytes: per alloc event index, the bytes the allocator counted (``ReplayPass``).
        points: timeline points in event order.
    """
    live: dict[int, tuple[str, int]] = {}  # recording id -> (category, block bytes)
    levels: dict[str, int] = {}
    out: list[TimelinePoint] = []
    index = 0
    # The levels as a point shows them; points between which nothing changed share one.
    shown: dict[str, int] = {}
    changed = True
    for point in points:
        while index <= point.event_index and index < len(events):
            event = events[index]
            if event.action == "alloc":
                nbytes = block_bytes.get(index, 0)
                if nbytes:
                    category = event.tag("category", _NO_CATEGORY)
                    live[event.address] = (category, nbytes)
                    levels[category] = levels.get(category, 0) + nbytes
                    changed = True
            elif event.action == "free_completed" and event.address in live:
                category, nbytes = live.pop(event.address)
                levels[category] -= nbytes
                changed = True
            index += 1
        if changed:
            shown = _sorted({k: v for k, v in levels.items() if v})
            changed = False
        out.append(
            TimelinePoint(
                point.event_index, point.step, point.allocated_bytes, point.reserved_bytes, shown
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

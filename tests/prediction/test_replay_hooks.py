"""The prediction pass's hooks (prediction/_replay.py) against the plain every-event bookkeeping.

The hooks skip most events that are not allocs (issue 19): such an event cannot raise a level,
so only marks (bucket ends, the event before a step, the last event) take the whole
bookkeeping. The reference here does it for every event, reading the levels through the
allocator's public calls, as the hooks did before; every field of the pass must be the same.
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from oomkit.core.allocator import AllocatorConfig, CachingAllocator
from oomkit.core.replay import ReplayEngine, ReplayHooks
from oomkit.core.trace import TraceEvent
from oomkit.prediction._replay import (
    ReplayPass,
    StepPeak,
    _marks,
    replay_for_prediction,
)

MiB = 2**20


class _PlainHooks(ReplayHooks):
    """Every event: both levels read, every maximum and peak checked, the timeline and steps."""

    def __init__(self, allocator, out, num_events, step_starts, max_points):
        self.allocator, self.out, self.n = allocator, out, num_events
        self.bucket = max(1, -(-num_events // max(1, max_points)))
        self.starts, self.next_start, self.step = list(step_starts), 0, None
        self.bucket_alloc = self.bucket_res = self.step_alloc = self.step_res = 0
        self.level = allocator.memory_allocated()
        if num_events:
            self.open_step(0, self.level, allocator.memory_reserved())

    def open_step(self, index, now_alloc, now_res):
        if self.next_start < len(self.starts) and index == self.starts[self.next_start]:
            self.close_step()
            self.step, self.next_start = self.next_start, self.next_start + 1
            self.step_alloc, self.step_res = now_alloc, now_res

    def close_step(self):
        if self.step is not None:
            self.out.step_peaks.append(
                StepPeak(self.step + 1, self.starts[self.step], self.step_alloc, self.step_res)
            )

    def after_event(self, index, event):
        out = self.out
        now_alloc = self.allocator.memory_allocated()
        now_res = self.allocator.memory_reserved()
        if event.action == "alloc":
            out.block_bytes[index] = now_alloc - self.level
            if now_alloc > out.peak_allocated_bytes:
                out.peak_allocated_bytes, out.peak_allocated_index = now_alloc, index
                out.reserved_at_peak_allocated_bytes = now_res
            if now_res > out.peak_reserved_bytes:
                out.peak_reserved_bytes, out.peak_reserved_index = now_res, index
        self.level = now_alloc
        self.bucket_alloc = max(self.bucket_alloc, now_alloc)
        self.bucket_res = max(self.bucket_res, now_res)
        self.step_alloc = max(self.step_alloc, now_alloc)
        self.step_res = max(self.step_res, now_res)
        if (index + 1) % self.bucket == 0 or index + 1 == self.n:
            out.timeline.append((index, self.bucket_alloc, self.bucket_res))
            self.bucket_alloc = self.bucket_res = 0
        if index + 1 < self.n:
            self.open_step(index + 1, now_alloc, now_res)


def _plain(events, step_starts, capacity_bytes, max_points) -> ReplayPass:
    allocator = CachingAllocator(AllocatorConfig(), capacity_bytes=capacity_bytes)
    out = ReplayPass()
    hooks = _PlainHooks(allocator, out, len(events), step_starts, max_points)
    engine = ReplayEngine(allocator, hooks)
    engine.run(events)
    hooks.close_step()
    out.oom_index = engine.oom_index
    out.events = engine.replayed if engine.oom_index is None else engine.oom_index
    return out


def _fields(p: ReplayPass) -> tuple:
    return (
        p.events,
        p.peak_allocated_bytes,
        p.peak_allocated_index,
        p.reserved_at_peak_allocated_bytes,
        p.peak_reserved_bytes,
        p.peak_reserved_index,
        p.block_bytes,
        p.timeline,
        p.step_peaks,
        p.oom_index,
    )


def _same(events: Sequence[TraceEvent], starts, capacity_bytes, max_points) -> ReplayPass:
    fast = replay_for_prediction(
        events,
        starts,
        AllocatorConfig(),
        capacity_bytes=capacity_bytes,
        reserved_outside_bytes=0,
        torch_version=None,
        max_points=max_points,
    )
    assert _fields(fast) == _fields(_plain(events, starts, capacity_bytes, max_points))
    return fast


def test_a_free_that_opens_a_bucket_sets_its_maxima():
    """Bucket 2 of 2 events each starts with a free: its maxima are the levels after it, not
    the higher ones before (which belong to bucket 1)."""
    events = [
        TraceEvent("alloc", 1, 3 * MiB),
        TraceEvent("alloc", 2, MiB),
        TraceEvent("free_completed", 1, 3 * MiB),
        TraceEvent("free_completed", 2, MiB),
    ]
    p = _same(events, (0,), 80 * 2**30, max_points=2)
    assert p.timeline == [
        (1, 4 * MiB, 22 * MiB),  # a 20 MiB large segment (kLargeBuffer) and a 2 MiB small one
        (3, MiB, 22 * MiB),
    ]
    assert p.block_bytes == {0: 3 * MiB, 1: MiB}


def test_a_step_opened_after_frees_starts_from_the_level_before_it():
    """One timeline bucket (marks: the first and last event only, and the event before step 2,
    a free): step 2 opens after it, its maxima starting from the level it left."""
    events = [
        TraceEvent("alloc", 1, 4 * MiB),
        TraceEvent("free_completed", 1, 4 * MiB),
        TraceEvent("alloc", 2, MiB),
        TraceEvent("free_completed", 2, MiB),
    ]
    p = _same(events, (0, 2), 80 * 2**30, max_points=1)
    assert [(s.step, s.first_event_index, s.peak_allocated_bytes) for s in p.step_peaks] == [
        (1, 0, 4 * MiB),
        (2, 2, MiB),
    ]


def test_marks_cover_bucket_ends_steps_and_the_last_event():
    assert _marks(7, 3, (0, 5)) == [0, 2, 3, 4, 5, 6]
    assert _marks(1, 1, (0,)) == [0]
    assert _marks(0, 1, ()) == []


_ops = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "alloc", "free", "free", "empty_cache"]),
        st.integers(1, 12),  # which id
        st.sampled_from([1, 512, 4096, MiB - 1, MiB, 3 * MiB, 11 * MiB, 25 * MiB]),
    ),
    min_size=20,
    max_size=120,
)


@settings(max_examples=200, deadline=None)
@given(
    ops=_ops,
    max_points=st.sampled_from([1, 2, 3, 5, 40]),
    step_every=st.integers(1, 50),
    capacity_mib=st.sampled_from([64, 200, 4096]),
)
def test_every_field_equals_the_plain_bookkeeping(ops, max_points, step_every, capacity_mib):
    """Random allocs, frees and cache releases, any bucket size, steps and capacity (an OOM
    stops both passes at the same event)."""
    events: list[TraceEvent] = []
    live: dict[int, int] = {}
    for action, ident, size in ops:
        if action == "alloc" and ident not in live:
            live[ident] = size
            events.append(TraceEvent("alloc", ident, size))
        elif action == "free" and ident in live:
            events.append(TraceEvent("free_requested", ident, live[ident]))
            events.append(TraceEvent("free_completed", ident, live.pop(ident)))
        elif action == "empty_cache":
            events.append(TraceEvent("empty_cache", 0, 0))
    starts = tuple(range(0, len(events), step_every)) or (0,)
    _same(events, starts, capacity_mib * MiB, max_points)


def test_category_levels_order_is_the_breakdowns_order():
    """Largest first; equal bytes in the numbers' order (h.2 before h.10), then as first seen
    (h.01 and h.1 have one natural key): the order _sorted gives a breakdown."""
    from oomkit.prediction._replay import _sorted, category_levels

    tags = ["h.10", "h.2", "h.1", "h.01", "big"]
    events = [
        TraceEvent("alloc", i, 512, tags=(("category", name),)) for i, name in enumerate(tags)
    ]
    block_bytes = {0: 512, 1: 512, 2: 512, 3: 512, 4: 2048}
    (point,) = category_levels(events, block_bytes, [(4, 4096, 2 * MiB)], (0,))
    expected = _sorted({name: block_bytes[i] for i, name in enumerate(tags)})
    assert list(point.by_category_bytes.items()) == list(expected.items())
    assert list(point.by_category_bytes) == ["big", "h.1", "h.01", "h.2", "h.10"]
    assert (point.event_index, point.step, point.allocated_bytes) == (4, 1, 4096)

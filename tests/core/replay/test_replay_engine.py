"""The one replay loop: id resolution, the two free semantics, hooks, OOM and errors."""

from __future__ import annotations

import gc

import pytest

from oomkit.core.allocator import CachingAllocator, SimulatedOutOfMemoryError
from oomkit.core.replay import ReplayEngine, ReplayHooks, simulate_events
from oomkit.core.trace import TraceEvent
from oomkit.errors import AllocatorUsageError, OomkitError, TraceFormatError

MiB = 2**20


def _alloc(i: int, size: int) -> TraceEvent:
    return TraceEvent("alloc", i, size)


def _req(i: int) -> TraceEvent:
    return TraceEvent("free_requested", i, 0)


def _done(i: int) -> TraceEvent:
    return TraceEvent("free_completed", i, 0)


class _Levels(ReplayHooks):
    """Notes allocated bytes after every event and the pointer of every alloc."""

    def __init__(self, allocator: CachingAllocator) -> None:
        self.allocator = allocator
        self.levels: list[tuple[int, int]] = []
        self.ptrs: list[tuple[int, int]] = []

    def after_event(self, index: int, event: TraceEvent) -> None:
        self.levels.append((index, self.allocator.memory_allocated()))

    def after_alloc(self, index: int, event: TraceEvent, ptr: int) -> None:
        self.ptrs.append((index, ptr))


def _engine(deferred: bool, capacity_bytes: int = 80 * 2**30) -> tuple[ReplayEngine, _Levels]:
    allocator = CachingAllocator(capacity_bytes=capacity_bytes)
    hooks = _Levels(allocator)
    return ReplayEngine(allocator, hooks, deferred_frees=deferred), hooks


def test_request_only_trace_keeps_a_block_allocated_until_its_completion():
    """deferred_frees=False: free_requested changes nothing; free_completed frees the block."""
    engine, hooks = _engine(deferred=False)
    engine.run([_alloc(1, 4 * MiB), _req(1), _alloc(2, 4 * MiB), _done(1)])
    assert hooks.levels == [(0, 4 * MiB), (1, 4 * MiB), (2, 8 * MiB), (3, 4 * MiB)]
    assert engine.live == {2: hooks.ptrs[1][1]} and engine.pending == {}
    assert engine.replayed == 4 and engine.oom_index is None


def test_completion_without_request_frees_a_live_id_in_one_step():
    """deferred_frees=False: a free_completed alone frees the live id."""
    engine, hooks = _engine(deferred=False)
    engine.run([_alloc(7, 2 * MiB), _done(7)])
    assert hooks.levels == [(0, 2 * MiB), (1, 0)]
    assert engine.live == {} and engine.pending == {}


def test_recorded_trace_drops_allocated_at_request_and_reuses_at_completion():
    """deferred_frees=True (§15.8): allocated drops at request; reuse waits for completion."""
    engine, hooks = _engine(deferred=True)
    events = [_alloc(1, 4 * MiB), _req(1), _alloc(2, 4 * MiB), _done(1), _alloc(3, 4 * MiB)]
    engine.run(events)
    assert hooks.levels == [(0, 4 * MiB), (1, 0), (2, 4 * MiB), (3, 4 * MiB), (4, 8 * MiB)]
    first, second, third = (ptr for _, ptr in hooks.ptrs)
    assert second == first + 4 * MiB  # the pending block was not reusable
    assert third == first  # completed, then reused (best fit, lowest address)


def test_request_followed_by_its_completion_is_one_free():
    """A request directly followed by its completion is one free; after_event sees both."""
    engine, hooks = _engine(deferred=True)
    engine.run([_alloc(1, 4 * MiB), _req(1), _done(1), _alloc(2, 4 * MiB)])
    assert hooks.levels == [(0, 4 * MiB), (1, 0), (2, 0), (3, 4 * MiB)]
    assert hooks.ptrs[0][1] == hooks.ptrs[1][1]
    assert engine.replayed == 4


def test_completes_later_leaves_the_pair_deferred():
    """completes_later True: the pair frees deferred, so the block is not reused at once."""

    class Later(_Levels):
        def completes_later(self, index: int) -> bool:
            self.asked = index
            return True

    allocator = CachingAllocator()
    hooks = Later(allocator)
    engine = ReplayEngine(allocator, hooks, deferred_frees=True)
    engine.run([_alloc(1, 4 * MiB), _req(1), _done(1), _alloc(2, 4 * MiB)])
    assert hooks.asked == 2
    # The block was not reusable: the second alloc went next to it.
    assert hooks.ptrs[1][1] == hooks.ptrs[0][1] + 4 * MiB


@pytest.mark.parametrize("deferred", [False, True])
def test_free_of_unknown_id_raises_with_the_event_index(deferred):
    """By default a free of an id that is not live is a TraceFormatError naming the 0-based index."""
    engine, _ = _engine(deferred)
    with pytest.raises(TraceFormatError, match=r"event 1: free_requested of id 0x9, which is not live"):
        engine.run([_alloc(1, MiB), _req(9)])


def test_alloc_of_a_pending_id_raises():
    """An alloc of an id awaiting its free_completed is a TraceFormatError (default hooks)."""
    engine, _ = _engine(deferred=False)
    with pytest.raises(TraceFormatError, match=r"event 2: id 0x1 is allocated twice"):
        engine.run([_alloc(1, MiB), _req(1), _alloc(1, MiB)])


def test_simulate_events_names_the_zero_based_event_index():
    """simulate_events' trace errors count events from 0, as every other replay message does."""
    with pytest.raises(TraceFormatError, match=r"event 1: free_completed of id 0x5"):
        simulate_events([_alloc(1, MiB), _done(5)])


def test_out_of_memory_stops_the_replay_and_is_its_outcome():
    """The failing event counts as replayed; oom_index and the error are kept; no after_event."""
    engine, hooks = _engine(deferred=False, capacity_bytes=64 * MiB)
    engine.run([_alloc(1, 20 * MiB), _alloc(2, 100 * MiB), _alloc(3, MiB)])
    assert engine.replayed == 2
    assert engine.oom_index == 1
    assert isinstance(engine.oom_error, SimulatedOutOfMemoryError)
    assert [i for i, _ in hooks.levels] == [0]
    result = engine.result(alloc_conf="", torch_version=None)
    assert (result.events, result.oom, result.oom_event_index) == (2, True, 1)
    assert result.oom_message == str(engine.oom_error)
    assert result.peak_allocated_bytes == 20 * MiB


def test_out_of_memory_hook_can_decline_the_outcome_and_failed_can_stop_quietly():
    """out_of_memory False leaves oom_index unset; an overridden failed() stops quietly."""
    seen: list[tuple[str, int]] = []

    class Quiet(ReplayHooks):
        def out_of_memory(self, index, event, error):
            seen.append(("oom", index))
            return False

        def failed(self, index: int, event: TraceEvent, error: OomkitError) -> None:
            seen.append(("failed", index))

    engine = ReplayEngine(CachingAllocator(capacity_bytes=64 * MiB), Quiet())
    engine.run([_alloc(1, 100 * MiB)])
    assert (engine.oom_index, engine.replayed) == (None, 1)
    engine = ReplayEngine(CachingAllocator(), Quiet())
    engine.run([_alloc(1, MiB), _req(2), _alloc(3, MiB)])
    assert engine.replayed == 2 and list(engine.live) == [1]
    assert seen == [("oom", 0), ("failed", 1)]


def test_segment_and_oom_entries_go_to_their_hooks():
    """segment_free/unmap and oom entries reach their hooks; segment_alloc and snapshot do not."""
    calls: list[tuple[str, int]] = []

    class Recorder(ReplayHooks):
        def segment_release(self, index: int, event: TraceEvent) -> None:
            calls.append((event.action, index))

        def oom_event(self, index: int, event: TraceEvent) -> None:
            calls.append((event.action, index))

    events = [
        TraceEvent("segment_alloc", 0x1000, 2 * MiB),
        TraceEvent("segment_free", 0x1000, 2 * MiB),
        TraceEvent("segment_unmap", 0x2000, 2 * MiB),
        TraceEvent("snapshot", 0, 0),
        TraceEvent("oom", 0, 3 * MiB),
    ]
    engine = ReplayEngine(CachingAllocator(), Recorder())
    engine.run(events)
    assert calls == [("segment_free", 1), ("segment_unmap", 2), ("oom", 4)]
    assert engine.replayed == 5


def test_empty_cache_releases_the_cached_segment():
    """An empty_cache entry releases unused segments (reserved drops to 0)."""
    allocator = CachingAllocator()
    engine = ReplayEngine(allocator)
    engine.run(iter([_alloc(1, 4 * MiB), _done(1), TraceEvent("empty_cache", 0, 0)]))
    result = engine.result(alloc_conf="", torch_version="2.5")
    assert result.peak_reserved_bytes == 20 * MiB  # requests < 10 MiB get a 20 MiB segment
    assert result.final_reserved_bytes == 0
    assert result.segment_events == (
        ("segment_alloc", result.segment_events[0][1], 20 * MiB),
        ("segment_free", result.segment_events[0][1], 20 * MiB),
    )
    assert (result.events, result.torch_version, result.num_device_free) == (3, "2.5", 1)


def test_empty_trace_replays_nothing():
    """No events: nothing replayed, no OOM."""
    engine = ReplayEngine(CachingAllocator(), deferred_frees=True)
    engine.run([])
    assert (engine.replayed, engine.oom_index) == (0, None)


class _GcSeen(ReplayHooks):
    """Notes whether the cyclic garbage collector was on at every event."""

    def __init__(self) -> None:
        self.enabled: list[bool] = []

    def after_event(self, index: int, event: TraceEvent) -> None:
        self.enabled.append(gc.isenabled())


def test_the_garbage_collector_is_paused_during_a_replay_and_back_on_after():
    """Issue 41: the loop runs with gc off (collections walked every live object) and leaves it
    as it found it."""
    assert gc.isenabled()
    hooks = _GcSeen()
    ReplayEngine(CachingAllocator(), hooks).run([_alloc(1, 512), _done(1), _alloc(2, MiB)])
    assert hooks.enabled == [False, False, False]
    assert gc.isenabled()


def test_the_garbage_collector_comes_back_on_after_an_error_and_stays_off_if_it_was():
    engine = ReplayEngine(CachingAllocator())
    with pytest.raises(TraceFormatError):
        engine.run([_done(7)])
    assert gc.isenabled()
    gc.disable()
    try:
        ReplayEngine(CachingAllocator()).run([_alloc(1, 512)])
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_hold_seeded_holds_live_and_pending_blocks_by_address():
    """hold_seeded: each (address, pending) is held with its address as id; a pending one is
    first freed with its completion deferred, so its bytes stay allocated-active until the
    trace's free_completed, and the live one is freed by the trace's free_requested."""
    allocator = CachingAllocator()
    live = allocator.malloc(3 * MiB)
    pending = allocator.malloc(5 * MiB)
    engine = ReplayEngine(allocator, ReplayHooks(), deferred_frees=True)
    engine.hold_seeded([(live, False), (pending, True)])
    assert engine.live == {live: live}
    assert engine.pending == {pending: pending}
    stats = allocator.memory_stats()
    assert stats["allocated_bytes.all.current"] == 3 * MiB  # the pending free left allocated
    assert stats["active_bytes.all.current"] == 8 * MiB
    engine.run([_done(pending), _req(live), _done(live)])
    stats = allocator.memory_stats()
    assert stats["active_bytes.all.current"] == 0
    assert stats["allocated_bytes.all.current"] == 0


@pytest.mark.parametrize("order", ["seeded", "reversed", "one missing"])
def test_hold_seeded_finds_each_block_in_order_or_not(order):
    """hold_seeded finds the blocks by their place when ``held`` lists them in the order they
    became active, and by a map of its own otherwise; the allocator never makes its map by
    address, and an address it does not hold is refused."""
    allocator = CachingAllocator()
    ptrs = [allocator.serve_block(size, 0).ptr for size in (3 * MiB, 512, 5 * MiB)]
    held = [(ptr, i == 1) for i, ptr in enumerate(ptrs)]
    if order == "reversed":
        held.reverse()
    engine = ReplayEngine(allocator, ReplayHooks(), deferred_frees=True)
    if order == "one missing":
        with pytest.raises(AllocatorUsageError, match="no block at 0x1000"):
            engine.hold_seeded([*held, (0x1000, False)])
        return
    engine.hold_seeded(held)
    assert engine.live == {ptrs[0]: ptrs[0], ptrs[2]: ptrs[2]}
    assert engine.pending == {ptrs[1]: ptrs[1]}
    assert allocator.active_blocks.by_address is None
    assert allocator.memory_stats()["allocated_bytes.all.current"] == 8 * MiB

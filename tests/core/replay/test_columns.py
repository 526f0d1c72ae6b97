"""The trace as integer columns (issue 41): codes, id slots, and what malloc still judges."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oomkit.core.allocator import CachingAllocator
from oomkit.core.replay import ReplayEngine, simulate_events
from oomkit.core.replay import engine as engine_module
from oomkit.core.replay.columns import (
    ALLOC,
    CHECKED_ALLOC,
    FREE_COMPLETED,
    FREE_REQUESTED,
    OTHER,
    trace_columns,
)
from oomkit.core.trace import TraceEvent
from oomkit.errors import AllocatorUsageError

MiB = 2**20


def test_codes_slots_and_values():
    """Equal ids share a slot (dict equality: 7 and 7.0 are one id), numbered by first
    appearance; only allocs with int fields and a positive size are ALLOC; sizes, streams and
    addresses have an entry per alloc only."""
    events = [
        TraceEvent("alloc", 0x1000, 4096, stream=3),
        TraceEvent("alloc", 7, 512),
        TraceEvent("free_requested", 0x1000, 4096),
        TraceEvent("free_completed", 7.0, 512),  # type: ignore[arg-type]
        TraceEvent("segment_alloc", 0x1000, 2 * MiB),
        TraceEvent("alloc", 9, 0),
        TraceEvent("alloc", 10, 1.5),  # type: ignore[arg-type]
        TraceEvent("oom", 123, 4096),
    ]
    c = trace_columns(events)
    assert c.actions == [
        ALLOC,
        ALLOC,
        FREE_REQUESTED,
        FREE_COMPLETED,
        OTHER,
        CHECKED_ALLOC,
        CHECKED_ALLOC,
        OTHER,
    ]
    assert c.slots == [0, 1, 0, 1, 0, 2, 3, 4]
    # One entry per alloc; the two malloc must judge hold placeholders.
    assert (c.sizes, c.streams) == ([4096, 512, 0, 0], [3, 0, 0, 0])
    assert c.addresses == [0x1000, 7, -1, -1]
    assert c.slot_of == {0x1000: 0, 7: 1, 9: 2, 10: 3, 123: 4}


@pytest.mark.parametrize(
    ("size", "message"),
    [
        (1.5, "malloc size must be a non-negative int of bytes; got 1.5"),
        (-512, "malloc size must be a non-negative int of bytes; got -512"),
        (True, "malloc size must be a non-negative int of bytes; got True"),
    ],
)
def test_an_alloc_malloc_refuses_raises_malloc_s_own_error(size, message):
    """A CHECKED_ALLOC goes through malloc's checks: the same AllocatorUsageError as before the
    columns, at its event."""
    with pytest.raises(AllocatorUsageError, match=message):
        simulate_events([TraceEvent("alloc", 1, MiB), TraceEvent("alloc", 2, size)])


def test_a_zero_byte_alloc_is_served_at_zero_and_its_free_is_a_no_op():
    """malloc(0) returns 0 without touching the allocator; freeing id 2 then frees nothing."""
    result = simulate_events(
        [
            TraceEvent("alloc", 1, MiB),
            TraceEvent("alloc", 2, 0),
            TraceEvent("free_completed", 2, 0),
        ]
    )
    assert (result.events, result.final_allocated_bytes) == (3, MiB)


def _trace(ops: list[tuple[int, int]]) -> list[TraceEvent]:
    """Allocs of ids 0..n and frees of live ids, from hypothesis' choices."""
    events: list[TraceEvent] = []
    live: list[int] = []
    next_id = 0
    for choice, size in ops:
        if choice == 0 or not live:
            events.append(TraceEvent("alloc", next_id, size))
            live.append(next_id)
            next_id += 1
        else:
            ident = live.pop(choice % len(live))
            events.append(TraceEvent("free_requested", ident, 0))
            events.append(TraceEvent("free_completed", ident, 0))
    return events


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(1, 30 * MiB)), max_size=40))
def test_a_trace_read_in_chunks_replays_as_the_whole_sequence(ops):
    """An iterator is read a few events at a time (ids numbered on across chunks, a free's
    request and completion in different chunks included): the record equals the list's."""
    events = _trace(ops)
    whole = simulate_events(events)
    saved = engine_module._CHUNK_EVENTS
    engine_module._CHUNK_EVENTS = 3  # (65,536 otherwise)
    try:
        chunked = simulate_events(iter(events))
    finally:
        engine_module._CHUNK_EVENTS = saved
    assert chunked == whole


def test_ids_held_before_the_run_are_freed_by_it_and_read_back():
    """hold(): a seeded live id is freed by the trace; one the trace never names stays held."""
    allocator = CachingAllocator()
    ptr = allocator.malloc(MiB)
    other = allocator.malloc(MiB)
    engine = ReplayEngine(allocator)
    engine.hold(0xA, ptr)
    engine.hold(0xB, other)
    engine.run([TraceEvent("free_completed", 0xA, 0), TraceEvent("alloc", 0xC, 512)])
    assert allocator.memory_allocated() == MiB + 512
    assert engine.live == {0xB: other, 0xC: engine.live[0xC]} and engine.pending == {}


def test_an_iterator_is_read_one_chunk_ahead_at_most():
    """When the first alloc is served only its chunk has been read from the iterator."""
    from oomkit.core.replay import ReplayHooks

    consumed = []
    seen_at_first_alloc = []

    def events():
        for i in range(10):
            consumed.append(i)
            yield TraceEvent("alloc", i, 512)

    class Hooks(ReplayHooks):
        def after_alloc(self, index, event, ptr):
            if not seen_at_first_alloc:
                seen_at_first_alloc.append(len(consumed))

    saved = engine_module._CHUNK_EVENTS
    engine_module._CHUNK_EVENTS = 4
    try:
        engine = ReplayEngine(CachingAllocator(), Hooks())
        engine.run(events())
    finally:
        engine_module._CHUNK_EVENTS = saved
    assert seen_at_first_alloc == [4]
    assert engine.replayed == 10 and len(engine.live) == 10


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["alloc", "free_requested", "free_completed", "segment_alloc", "oom"]),
            st.integers(0, 2**64 - 1),
            st.sampled_from([0, 1, 512, 2 * MiB, 2**63]),
            st.integers(0, 3),
        ),
        max_size=40,
    )
)
def test_columns_of_int_fields_are_the_same_without_the_type_check(entries):
    """``ints=True`` (a trace the snapshot reader read: every field a plain int) gives the
    columns the type check gives: only zero-byte allocs are left to malloc's checks."""
    events = [TraceEvent(a, address, size, stream) for a, address, size, stream in entries]
    known = trace_columns(events, ints=True)
    checked = trace_columns(events)
    for name in ("actions", "slots", "sizes", "streams", "addresses", "slot_of"):
        assert getattr(known, name) == getattr(checked, name), name
    assert known.actions.count(CHECKED_ALLOC) == sum(
        a == "alloc" and size == 0 for a, _, size, _ in entries
    )


def test_a_loaded_snapshot_s_trace_fields_are_plain_ints():
    """What ``ints=True`` relies on: the reader refuses an entry whose size is not an int."""
    import pickle

    from oomkit.core.snapshot import load_snapshot
    from oomkit.errors import SnapshotFormatError

    segment = {"device": 0, "address": 0, "total_size": 2 * MiB, "stream": 0,
               "segment_type": "small", "blocks": [{"address": 0, "size": 2 * MiB,
                                                     "state": "inactive"}]}
    for bad in (1.0, True, "512"):
        data = {"segments": [segment], "device_traces": [
            [{"action": "alloc", "addr": 0, "size": bad, "stream": 0}]]}
        with pytest.raises(SnapshotFormatError):
            load_snapshot(pickle.dumps(data))
    good = {"segments": [segment], "device_traces": [
        [{"action": "alloc", "addr": 0, "size": 512, "stream": 0}]]}
    (event,) = load_snapshot(pickle.dumps(good)).trace_for(0)
    assert (type(event.size), type(event.address), type(event.stream)) == (int, int, int)

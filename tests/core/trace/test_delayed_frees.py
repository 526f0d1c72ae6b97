"""Frees moved later in a trace (the upper end of the GPU's timing), within their step."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from oomkit.core.trace import TraceEvent
from oomkit.core.trace.delayed_frees import GPU_LAG_ALLOCATIONS, delayed_frees

A, FR, FC = "alloc", "free_requested", "free_completed"


def _event(action: str, address: int) -> TraceEvent:
    return TraceEvent(action, address, 512)


def test_free_moves_after_the_lagged_alloc_within_the_step() -> None:
    """A free of a listed id goes after the lag-th next alloc, and never past its step's end."""
    events = [_event(A, 1), _event(FR, 1), _event(FC, 1), _event(A, 2), _event(A, 3),
              _event(A, 4), _event(A, 5), _event(FR, 5), _event(FC, 5), _event(A, 6)]
    moved = delayed_frees(events, [0, 6], {1, 5}, lag_allocations=2)
    assert [(e.action, e.address) for e in moved] == [
        (A, 1), (A, 2), (A, 3), (FR, 1), (FC, 1), (A, 4), (A, 5), (A, 6), (FR, 5), (FC, 5)
    ]


def test_no_lag_or_no_ids_changes_nothing() -> None:
    """Lag 0 (the GPU keeps up) and an empty id set give the events unchanged."""
    events = [_event(A, 1), _event(FR, 1), _event(FC, 1), _event(A, 2)]
    assert delayed_frees(events, [0], {1}, lag_allocations=0) == tuple(events)
    assert delayed_frees(events, [0], set()) == tuple(events)
    assert GPU_LAG_ALLOCATIONS == 1024  # the launch queue's depth, in allocations


def test_negative_lag_is_refused() -> None:
    """A negative lag is a ValueError naming the argument."""
    with pytest.raises(ValueError, match="lag_allocations must be at least 0; got -1"):
        delayed_frees([], [0], {1}, lag_allocations=-1)


@st.composite
def _traces(draw: st.DrawFn) -> tuple[list[TraceEvent], list[int], set[int], int]:
    events: list[TraceEvent] = []
    starts: list[int] = []
    next_id = 1
    for _ in range(draw(st.integers(1, 3))):
        starts.append(len(events))
        live: list[int] = []
        for _ in range(draw(st.integers(0, 12))):
            if live and draw(st.booleans()):
                address = live.pop(draw(st.integers(0, len(live) - 1)))
                events += [_event(FR, address), _event(FC, address)]
            else:
                events.append(_event(A, next_id))
                live.append(next_id)
                next_id += 1
        for address in live:
            events += [_event(FR, address), _event(FC, address)]
    ids = draw(st.sets(st.integers(1, max(1, next_id - 1))))
    return events, starts, ids, draw(st.integers(0, 5))


@given(_traces())
def test_moved_trace_is_a_permutation_that_keeps_steps_and_order(
    trace: tuple[list[TraceEvent], list[int], set[int], int],
) -> None:
    """Same events, each step's events stay in it, allocs keep their order, frees follow allocs."""
    events, starts, ids, lag = trace
    moved = delayed_frees(events, starts, ids, lag)
    bounds = [*starts, len(events)]
    for start, stop in zip(bounds, bounds[1:], strict=False):
        assert sorted(map(id, moved[start:stop])) == sorted(map(id, events[start:stop]))
    assert [e for e in moved if e.action == A] == [e for e in events if e.action == A]
    seen: set[int] = set()
    for position, event in enumerate(moved):
        if event.action == A:
            seen.add(event.address)
        else:
            assert event.address in seen
        if event.action == FR:
            assert moved[position + 1] == _event(FC, event.address)

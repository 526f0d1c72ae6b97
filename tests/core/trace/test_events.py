"""Tests for the trace event records."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import oomkit.core.trace as trace
from oomkit.core.trace import (
    ACTIONS,
    TRACE_FORMAT_VERSION,
    Frame,
    TraceEvent,
    TraceHeader,
    new_trace_event,
)


def test_every_public_name_imports():
    """Every name in oomkit.core.trace.__all__ exists."""
    for name in trace.__all__:
        assert hasattr(trace, name), name


def test_event_defaults_and_positional_order():
    """TraceEvent takes (action, address, size, stream, time_us, frames, tags) with defaults."""
    ev = TraceEvent("alloc", 1, 1000)
    assert (ev.stream, ev.time_us, ev.frames, ev.tags) == (0, None, (), ())
    full = TraceEvent("free_requested", 2, 10, 7, 123, (Frame("a.py", 3, "f"),), (("k", "v"),))
    assert [f.name for f in dataclasses.fields(full)] == [
        "action",
        "address",
        "size",
        "stream",
        "time_us",
        "frames",
        "tags",
    ]


def test_records_are_frozen_and_slotted():
    """Frame and TraceEvent cannot be changed and carry no __dict__."""
    ev = TraceEvent("alloc", 1, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ev.size = 3  # type: ignore[misc]
    assert not hasattr(ev, "__dict__")
    assert not hasattr(Frame("a", 1, "b"), "__dict__")


def test_actions_are_pytorchs_and_oomkit_s_own_two():
    """ACTIONS holds PyTorch's ten trace actions (tests/core/snapshot/test_reader.py loads each
    without a warning) and oomkit's own ``empty_cache`` and ``allocator_settings``, each once."""
    assert len(ACTIONS) == len(set(ACTIONS)) == 12
    assert {"empty_cache", "allocator_settings"} <= set(ACTIONS)


def test_header_defaults():
    """A header needs nothing but has the current format version and empty metadata."""
    h = TraceHeader(source="tracer")
    assert h.format_version == TRACE_FORMAT_VERSION == 1
    assert (h.device, h.torch_version, h.allocator_settings, h.capacity_bytes) == (
        0,
        None,
        None,
        None,
    )
    assert h.metadata == {}


def test_tag_reads_one_tag_as_a_dict_of_the_tags_would():
    """The value of a key (the last one, as dict(tags) keeps), else the default."""
    event = TraceEvent(
        "alloc",
        1,
        512,
        tags=(("category", "activation"), ("module", "h.0"), ("category", "temporary")),
    )
    assert event.tag("category") == dict(event.tags)["category"] == "temporary"
    assert event.tag("module") == "h.0"
    assert event.tag("op") is None and event.tag("op", "unknown") == "unknown"
    assert TraceEvent("free_completed", 1, 512).tag("category", "x") == "x"


@settings(max_examples=200, deadline=None)
@given(
    action=st.sampled_from(["alloc", "free_requested", "free_completed", "segment_alloc", "oom"]),
    address=st.integers(min_value=0, max_value=2**64),
    size=st.integers(min_value=0, max_value=2**50),
    stream=st.integers(min_value=0, max_value=2**32),
    time_us=st.none() | st.integers(min_value=0, max_value=2**62),
    frames=st.lists(
        st.builds(Frame, st.text(max_size=8), st.integers(0, 10**6), st.text(max_size=8)),
        max_size=3,
    ).map(tuple),
    tags=st.lists(st.tuples(st.text(max_size=6), st.text(max_size=6)), max_size=3).map(tuple),
)
def test_new_trace_event_is_the_same_record(action, address, size, stream, time_us, frames, tags):
    """new_trace_event (the loader's and the recorder's faster constructor) makes the record
    TraceEvent(...) makes: equal, same hash and repr, still frozen."""
    fast = new_trace_event(action, address, size, stream, time_us, frames, tags)
    plain = TraceEvent(action, address, size, stream, time_us, frames, tags)
    assert fast == plain and hash(fast) == hash(plain) and repr(fast) == repr(plain)
    assert type(fast) is TraceEvent
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.size = size + 1  # type: ignore[misc]

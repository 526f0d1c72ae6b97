"""Tests for the streaming trace file reader and writer."""

import collections.abc
import gzip
import json
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oomkit.core.trace import Frame, TraceEvent, TraceHeader, read_trace, write_trace
from oomkit.errors import TraceFormatError

STACK_A = (Frame("model.py", 10, "forward"), Frame("train.py", 3, "<module>"))
STACK_B = (Frame("optim.py", 7, "step"),)

EVENTS = [
    TraceEvent("segment_alloc", 0x7F0000000000, 20 * 2**20, 0, 1_700_000_000_000_000),
    TraceEvent("alloc", 0x7F0000000000, 1000, 0, 1_700_000_000_000_001, STACK_A),
    TraceEvent("alloc", 0x7F0000000400, 3, 5, None, STACK_A, (("category", "activation"),)),
    TraceEvent("free_requested", 0x7F0000000000, 1000, 0, None, STACK_B),
    TraceEvent("free_completed", 0x7F0000000000, 1000),
    TraceEvent("oom", 123456, 2**31, 0, 9),
    TraceEvent("empty_cache", 0, 0),
    TraceEvent("annotate", 1, 2, 0, None, (), (("user_metadata", 'ünïcode "quoted"\n'),)),
]

HEADER = TraceHeader(
    format_version=1,
    source="tracer",
    device=1,
    torch_version="2.5",
    allocator_settings="expandable_segments:True",
    capacity_bytes=80 * 2**30,
    metadata={"model": "gpt2", "batch": 8},
)


@pytest.mark.parametrize("name", ["t.jsonl", "t.jsonl.gz"])
def test_round_trip(tmp_path, name):
    """Events and header come back equal, with and without gzip."""
    path = tmp_path / name
    assert write_trace(path, iter(EVENTS), HEADER) == len(EVENTS)
    header, events = read_trace(path)
    assert header == HEADER
    assert list(events) == EVENTS


def test_gz_suffix_compresses_and_plain_does_not(tmp_path):
    """A .gz name gives a gzip file; any other name gives plain JSON Lines."""
    write_trace(tmp_path / "a.jsonl.gz", EVENTS, HEADER)
    write_trace(tmp_path / "a.jsonl", EVENTS, HEADER)
    assert (tmp_path / "a.jsonl.gz").read_bytes()[:2] == b"\x1f\x8b"
    first = json.loads((tmp_path / "a.jsonl").read_text().splitlines()[0])
    assert first["format"] == "oomkit-trace" and first["version"] == 1


def test_gzip_output_is_deterministic(tmp_path):
    """Writing the same events twice gives a byte-identical gzip file (no timestamp in it)."""
    path = tmp_path / "a.gz"
    write_trace(path, EVENTS, HEADER)
    first = path.read_bytes()
    write_trace(path, EVENTS, HEADER)
    assert path.read_bytes() == first


def test_repeated_stacks_are_written_once_and_shared_when_read(tmp_path):
    """A stack used by many events is stored once and read back as one shared tuple."""
    path = tmp_path / "t.jsonl"
    events = [TraceEvent("alloc", i, 8, 0, None, tuple(STACK_A)) for i in range(100)]
    write_trace(path, events, HEADER)
    assert path.read_text().count("forward") == 1
    _, read = read_trace(path)
    stacks = {id(ev.frames) for ev in read}
    assert len(stacks) == 1


def test_events_line_is_compact(tmp_path):
    """Default fields are left out of event lines."""
    path = tmp_path / "t.jsonl"
    write_trace(path, [TraceEvent("alloc", 1, 1000)], HEADER)
    assert path.read_text().splitlines()[1] == '{"a":"alloc","p":1,"s":1000}'


def test_read_trace_streams_with_bounded_memory(tmp_path):
    """Reading a 9 MB trace yields an iterator and never holds the file in memory.

    Each event carries a 512-character note, so that 16k events make a file over 8 MB:
    tracemalloc's cost is per allocation, and 200k short events made the same 10 MB file for
    4 s of reading under it. Holding the events (list(read): 3.9 MB) or the file fails."""
    path = tmp_path / "big.jsonl"
    n = 16_000
    note = (("user_metadata", "x" * 512),)
    events = (
        TraceEvent("alloc" if i % 2 == 0 else "free_completed", i // 2, 512, 0, i, STACK_A, note)
        for i in range(n)
    )
    assert write_trace(path, events, HEADER) == n
    file_bytes = path.stat().st_size
    tracemalloc.start()
    try:
        header, read = read_trace(path)
        assert isinstance(read, collections.abc.Iterator)
        assert not isinstance(read, (list, tuple))
        count = sum(1 for _ in read)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert count == n
    assert file_bytes > 8_000_000
    assert peak < 1_000_000, f"peak {peak} bytes while reading a {file_bytes}-byte file"


def test_write_trace_consumes_a_generator_once(tmp_path):
    """write_trace streams from a generator and returns how many events it wrote."""
    gen = (TraceEvent("alloc", i, 1) for i in range(1000))
    assert write_trace(tmp_path / "g.jsonl", gen, HEADER) == 1000
    assert next(gen, None) is None


# ---------------------------------------------------------------------------- errors


def _write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_newer_version_is_refused_with_upgrade_hint(tmp_path):
    """A trace of a newer format version names the file, line 1 and says to upgrade."""
    path = _write_lines(
        tmp_path / "new.jsonl", ['{"format":"oomkit-trace","version":99}', '{"end":0}']
    )
    with pytest.raises(TraceFormatError, match=r"new\.jsonl: line 1: .*version 99.*Upgrade oomkit"):
        read_trace(path)


def test_non_oomkit_json_is_refused(tmp_path):
    """A JSON Lines file without the oomkit header is not a trace."""
    path = _write_lines(tmp_path / "other.jsonl", ['{"hello": 1}'])
    with pytest.raises(TraceFormatError, match=r"other\.jsonl: line 1: .*not an oomkit trace"):
        read_trace(path)


def test_text_file_is_refused(tmp_path):
    """A line that is not JSON is refused at once, naming line 1."""
    path = _write_lines(tmp_path / "x.jsonl", ["not json"])
    with pytest.raises(TraceFormatError, match=r"line 1: is not JSON"):
        read_trace(path)


def test_empty_file_is_refused(tmp_path):
    """An empty file is refused as empty."""
    path = tmp_path / "empty.jsonl"
    path.write_bytes(b"")
    with pytest.raises(TraceFormatError, match=r"empty\.jsonl: line 1: the file is empty"):
        read_trace(path)


def test_binary_file_is_refused(tmp_path):
    """Random bytes are refused as unreadable."""
    path = tmp_path / "r.jsonl"
    path.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(TraceFormatError, match=r"r\.jsonl: line 1"):
        read_trace(path)


def test_corrupt_event_line_names_its_line(tmp_path):
    """A damaged event line is reported with its line number while iterating."""
    path = tmp_path / "c.jsonl"
    write_trace(path, [TraceEvent("alloc", i, 8) for i in range(5)], HEADER)
    lines = path.read_text().splitlines()
    lines[3] = lines[3][:10]
    _write_lines(path, lines)
    _, events = read_trace(path)
    assert next(events) == TraceEvent("alloc", 0, 8)
    assert next(events) == TraceEvent("alloc", 1, 8)
    with pytest.raises(TraceFormatError, match=r"c\.jsonl: line 4: is not valid JSON"):
        next(events)


@pytest.mark.parametrize(
    ("event_line", "end_line", "error"),
    [
        pytest.param(
            '{"a":"alloc","p":1,"s":"big"}', '{"end":1}',
            r"line 2: an event field has the wrong type", id="size-not-an-int",
        ),
        pytest.param(
            '{"a":"alloc","p":1,"s":2,"f":3}', '{"end":1}',
            r"line 2: .*unknown stack", id="stack-never-defined",
        ),
        pytest.param(
            '{"a":"alloc","p":1,"s":2}', '{"end":5}',
            r"line 3: the end line says 5 events but 1", id="end-count-disagrees",
        ),
    ],
)
def test_corrupt_event_or_end_line_is_refused(tmp_path, event_line, end_line, error):
    """A size that is not an int, a stack never defined, or an end line whose count disagrees
    with the events read: corrupt, at the line that shows it."""
    path = _write_lines(
        tmp_path / "c.jsonl", ['{"format":"oomkit-trace","version":1}', event_line, end_line]
    )
    _, events = read_trace(path)
    with pytest.raises(TraceFormatError, match=error):
        list(events)


def test_missing_end_line_means_truncated(tmp_path):
    """A file cut at a line boundary is reported truncated after its last event."""
    path = tmp_path / "t.jsonl"
    write_trace(path, [TraceEvent("alloc", i, 8) for i in range(3)], HEADER)
    lines = path.read_text().splitlines()[:-1]
    _write_lines(path, lines)
    _, events = read_trace(path)
    with pytest.raises(TraceFormatError, match=r"t\.jsonl: line 4: .*truncated"):
        list(events)


def test_truncated_gzip_is_refused(tmp_path):
    """A gzip trace cut short is reported as truncated or corrupt, naming the file."""
    path = tmp_path / "t.jsonl.gz"
    write_trace(path, [TraceEvent("alloc", i, 8) for i in range(20_000)], HEADER)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    _, events = read_trace(path)
    with pytest.raises(TraceFormatError, match=r"t\.jsonl\.gz: line \d+: .*truncated"):
        list(events)


def test_gzip_is_detected_without_the_suffix(tmp_path):
    """A gzip-compressed trace reads even when its name lacks .gz."""
    path = tmp_path / "t.jsonl"
    write_trace(tmp_path / "t.gz", EVENTS, HEADER)
    path.write_bytes((tmp_path / "t.gz").read_bytes())
    _, events = read_trace(path)
    assert list(events) == EVENTS


def test_bad_header_field_is_refused(tmp_path):
    """A header whose device is not an int is corrupt."""
    path = _write_lines(
        tmp_path / "h.jsonl", ['{"format":"oomkit-trace","version":1,"device":"x"}']
    )
    with pytest.raises(TraceFormatError, match=r"line 1: the header's 'device'"):
        read_trace(path)


def test_non_int_event_field_is_refused_on_write(tmp_path):
    """write_trace refuses an event whose size is not an int, so files stay readable."""
    with pytest.raises(TypeError, match="must be int"):
        write_trace(tmp_path / "x.jsonl", [TraceEvent("alloc", 1, 2.5)], HEADER)  # type: ignore[arg-type]


def test_unserialisable_metadata_is_refused(tmp_path):
    """Header metadata that JSON cannot hold is a TypeError naming metadata."""
    with pytest.raises(TypeError, match="metadata"):
        write_trace(tmp_path / "x.jsonl", [], TraceHeader(metadata={"x": object()}))


_text = st.text(max_size=12)
_frames = st.tuples(*[st.builds(Frame, _text, st.integers(0, 10**6), _text)] * 2)
_events = st.builds(
    TraceEvent,
    st.sampled_from(["alloc", "free_requested", "free_completed", "segment_alloc", "x-new"]),
    st.integers(0, 2**64 - 1),
    st.integers(0, 2**48),
    st.integers(0, 2**64 - 1),
    st.none() | st.integers(0, 2**62),
    st.just(()) | _frames,
    st.lists(st.tuples(_text, _text), max_size=2).map(tuple),
)


@settings(max_examples=50, deadline=None)
@given(st.lists(_events, max_size=20))
def test_round_trip_property(tmp_path_factory, events):
    """Any events, including odd strings and huge ints, survive a write/read round trip."""
    path = tmp_path_factory.mktemp("prop") / "p.jsonl.gz"
    write_trace(path, events, HEADER)
    _, read = read_trace(path)
    assert list(read) == events


def test_gzip_reader_closes_file(tmp_path):
    """Closing the iterator early closes the file."""
    path = tmp_path / "t.jsonl.gz"
    write_trace(path, EVENTS, HEADER)
    _, events = read_trace(path)
    next(events)
    events.close()
    with gzip.open(path, "rt") as f:
        assert f.readline().startswith('{"format"')

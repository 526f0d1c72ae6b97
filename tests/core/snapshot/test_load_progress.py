"""load_snapshot(progress=...): the file's bytes, then the trace entries, reported as they are read."""

from __future__ import annotations

import pickle

import pytest

from oomkit.core.snapshot import load_snapshot, snapshot_to_data, write_snapshot
from oomkit.core.trace import TraceEvent

ADDRESS = 0x7000_0000_0000
SEGMENTS = [
    {
        "address": ADDRESS,
        "total_size": 2**21,
        "segment_type": "small",
        "blocks": [{"address": ADDRESS, "size": 2**21, "state": "inactive"}],
    }
]


def _events(count: int) -> list[TraceEvent]:
    actions = ("alloc", "free_requested", "free_completed")
    return [TraceEvent(actions[i % 3], ADDRESS, 512) for i in range(count)]


@pytest.fixture(scope="module")
def big_file(tmp_path_factory):
    """A snapshot of 70,000 trace entries (more than one progress interval of 65,536)."""
    path = tmp_path_factory.mktemp("progress") / "big.pickle"
    write_snapshot(path, SEGMENTS, [_events(70_000)])
    return path


def test_the_file_then_the_trace_is_reported(big_file):
    calls: list[tuple[str, int, int]] = []
    snapshot = load_snapshot(big_file, progress=lambda *call: calls.append(call))
    size = big_file.stat().st_size
    reading = [(done, total) for what, done, total in calls if what == "reading the file"]
    entries = [(done, total) for what, done, total in calls if what != "reading the file"]
    # The file first, to its last byte, never going back; then the entries not read while the
    # file was (the trace is drained as it is unpickled: all but the batches of its last frame).
    assert calls[: len(reading)] == [("reading the file", d, t) for d, t in reading]
    assert reading[-1] == (size, size) and {t for _, t in reading} == {size}
    assert [d for d, _ in reading] == sorted(d for d, _ in reading)
    assert 65_536 <= entries[0][0] < 70_000 and entries[1:] == [(70_000, 70_000)]
    assert {what for what, _, _ in calls} == {"reading the file", "reading device 0's trace"}
    assert snapshot == load_snapshot(big_file)


def test_an_unframed_pickle_reports_its_entries_only(tmp_path):
    """A protocol-2 pickle (no frames: read an opcode at a time) is not wrapped for bytes."""
    path = tmp_path / "old.pickle"
    path.write_bytes(pickle.dumps(snapshot_to_data(SEGMENTS, [_events(6)]), protocol=2))
    calls: list[tuple[str, int, int]] = []
    snapshot = load_snapshot(path, progress=lambda *call: calls.append(call))
    assert calls == [("reading device 0's trace", 0, 6), ("reading device 0's trace", 6, 6)]
    assert len(snapshot.trace_for(0)) == 6


def test_bytes_report_their_entries_only(big_file):
    calls: list[tuple[str, int, int]] = []
    load_snapshot(big_file.read_bytes(), progress=lambda *call: calls.append(call))
    # The entries not drained while the bytes were unpickled, and the end.
    assert [c[0] for c in calls] == ["reading device 0's trace"] * 2


def test_a_progress_callback_that_raises_stops_the_load(big_file):
    """The caller's callback is called as is: what it raises comes out of load_snapshot."""

    def stop(what: str, done: int, total: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        load_snapshot(big_file, progress=stop)

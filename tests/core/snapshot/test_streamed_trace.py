"""load_snapshot reads a large trace while the file is unpickled (TraceDrain): same records, less memory."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from oomkit.core.snapshot import load_snapshot, snapshot_from_data
from oomkit.core.snapshot._drain import TraceDrain, read_stack
from oomkit.core.snapshot.reader import _Normaliser
from oomkit.errors import SnapshotFormatError

ADDRESS = 0x7F00_0000_0000
# Enough entries for a file of several MiB: the drain first looks for the trace at 1 MiB.
ENTRIES = 60_000


def _pytorch_like(entries: int = ENTRIES) -> dict[str, Any]:
    """As _dump_snapshot writes: each frame one dict shared by every stack holding it, and a
    block's stack list shared by its alloc, free_requested and free_completed entries (and by
    the segment's block for the live ones)."""
    frames = [{"filename": f"model/layer_{k}.py", "line": k, "name": f"fn_{k}"} for k in range(40)]
    stacks = [[frames[(s + k) % 40] for k in range(12)] for s in range(25)]
    live_stack = stacks[3]
    segment = {
        "address": ADDRESS,
        "total_size": 20 * 2**20,
        "segment_type": "large",
        "blocks": [
            {"address": ADDRESS, "size": 2**20, "state": "active_allocated", "frames": live_stack},
            {"address": ADDRESS + 2**20, "size": 19 * 2**20, "state": "inactive", "frames": []},
        ],
    }
    trace = [
        {
            "action": "alloc",
            "addr": ADDRESS,
            "size": 2**20,
            "stream": 0,
            "time_us": 0,
            "frames": live_stack,
        }
    ]
    for i in range(1, entries // 3):
        stack = list(stacks[i % 25])  # one list per block, shared by its three entries
        address = ADDRESS + 2**20 + 512 * (i % 7)
        for action in ("alloc", "free_requested", "free_completed"):
            trace.append(
                {
                    "action": action,
                    "addr": address,
                    "size": 512,
                    "stream": 0,
                    "time_us": i,
                    "frames": stack,
                }
            )
    return {"segments": [segment], "device_traces": [trace]}


def test_a_streamed_trace_is_read_as_a_whole_one():
    """Every record, warning and key seen is what the tree read after the load gives."""
    raw = pickle.dumps(_pytorch_like(), protocol=4)
    assert len(raw) > 2 * 2**20
    streamed = load_snapshot(raw)
    whole = snapshot_from_data(pickle.loads(raw), name="<bytes>")
    assert streamed == whole
    assert len(streamed.trace_for(0)) == 3 * (ENTRIES // 3) - 2
    assert streamed.trace_for(0)[-1].frames == whole.trace_for(0)[-1].frames
    assert len(streamed.trace_for(0)[-1].frames) == 12


def test_the_drain_reads_the_trace_while_the_file_is_read(monkeypatch):
    """All but the last frame's entries are read before the unpickler returns."""
    raw = pickle.dumps(_pytorch_like(), protocol=4)
    read_while_loading: list[int] = []
    drain = TraceDrain._drain

    def counting(self, key, entries, events):
        drain(self, key, entries, events)
        read_while_loading.append(len(events))

    monkeypatch.setattr(TraceDrain, "_drain", counting)
    assert len(load_snapshot(raw).trace_for(0)) == ENTRIES - 2
    assert ENTRIES - 2 - 2_000 <= max(read_while_loading) < ENTRIES - 2


def test_the_trace_is_looked_for_from_1_mib_on():
    """The memo is searched once the bytes read pass 1 MiB, for a list of action dicts."""
    trace = _pytorch_like(30)["device_traces"][0]

    class _Memo:
        def copy(self):
            return {0: [], 1: ["x"], 2: [{"filename": "a"}], 3: trace}

    class _Unpickler:
        memo = _Memo()

    drain = TraceDrain(lambda entries, stop, events: 0)
    drain(_Unpickler(), 2**20 - 1)  # type: ignore[arg-type]
    assert drain.read == {}
    drain(_Unpickler(), 2**20)  # type: ignore[arg-type]
    assert list(drain.read) == [id(trace)]


def test_a_read_entry_is_emptied_and_its_shared_stack_kept():
    """After a drain: the entry dict is empty, its stack list holds only its frames, and the
    entries that share that list (the frees) read the same frames from it."""
    data = _pytorch_like(30)
    trace = data["device_traces"][0]
    shared = trace[1]["frames"]
    first = trace[:2]
    rest = trace[2:]
    normaliser = _Normaliser("<test>", True)
    drain = TraceDrain(normaliser.read_entries)
    batch = list(first)

    class _Memo:
        def copy(self):
            return {0: batch}

    class _Unpickler:
        memo = _Memo()

    drain(_Unpickler(), 2**20)  # type: ignore[arg-type]
    assert batch == [] and first[0] == {} and first[1] == {}
    assert len(shared) == 1 and read_stack(shared) == shared[0] and len(shared[0]) == 12
    events = drain.read[id(batch)][1]
    assert [e.action for e in events] == ["alloc", "alloc"]
    later = normaliser.frames(rest[0]["frames"])  # the free_requested of trace[1]
    assert later == events[1].frames and len(later) == 12


def test_a_malformed_entry_after_the_drain_began_is_named_by_its_index():
    """The drain stops before it; the message gives its index in the whole trace."""
    data = _pytorch_like()
    data["device_traces"][0][50_000]["size"] = "big"
    raw = pickle.dumps(data, protocol=4)
    with pytest.raises(SnapshotFormatError, match=r"device_traces\[0\]\[50000\]: 'size' is 'big'"):
        load_snapshot(raw)


def test_an_entry_referred_to_twice_is_refused():
    """PyTorch writes each entry once; one dict appended twice far apart is read once, and its
    second reference (emptied by then) is refused as an entry without an action."""
    data = _pytorch_like()
    trace = data["device_traces"][0]
    trace.append(trace[10])
    raw = pickle.dumps(data, protocol=4)
    with pytest.raises(
        SnapshotFormatError, match=rf"device_traces\[0\]\[{len(trace) - 1}\] has no"
    ):
        load_snapshot(raw)


def test_refused_extras_after_the_drain_began_are_named_by_their_index():
    """An entry whose compile_context is not a string stops the drain; the message names it."""
    data = _pytorch_like()
    data["device_traces"][0][50_000]["compile_context"] = 5
    raw = pickle.dumps(data, protocol=4)
    with pytest.raises(
        SnapshotFormatError,
        match=r"device_traces\[0\]\[50000\]: 'compile_context' is 5; PyTorch records a string",
    ):
        load_snapshot(raw)

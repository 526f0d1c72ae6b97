"""Self-contradicting snapshots and wrong types: refused as such, before any analysis (issue 36).

A snapshot whose trace cannot have happened (an unknown action, a double free, a free of an
address never allocated, two live allocations at one address, an allocation outside every
segment, a free completed before it was requested) or whose fields have types PyTorch never
writes (NaN or strings as pool ids, ``is_expandable: 'no'``, a NaN recorded
``PYTORCH_CUDA_ALLOC_CONF``, 2**20000 as a size) must be refused with the first contradiction,
never explained ("no OOM") or replayed ("diverged") as if it were a recording.
"""

from __future__ import annotations

import math
import pickle
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oomkit.core.snapshot import load_snapshot
from oomkit.errors import SnapshotFormatError

sys.path.insert(0, str(Path(__file__).parent))
from _cli_bounds import SNAPSHOT_COMMANDS, refused_by_every_command  # noqa: E402
from _hostile_support import (  # noqa: E402
    BASE_ADDRESS,
    MiB,
    assert_within_bounds,
    base_snapshot,
    run_bounded,
)

A = BASE_ADDRESS
SEGMENT_END = A + 20 * MiB
FEW = settings(
    max_examples=8,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
ACTIONS_PYTORCH_RECORDS = {
    "alloc",
    "free_requested",
    "free_completed",
    "segment_alloc",
    "segment_free",
    "segment_map",
    "segment_unmap",
    "oom",
    "snapshot",
    "empty_cache",
    "annotate",
}

# Base trace (see base_snapshot): 0 segment_alloc A, 1 alloc A (5 MiB, live at the end),
# 2 alloc A+5MiB (4 MiB), 3 free_requested A+5MiB, 4 free_completed A+5MiB.


def _entry(action: str, address: int, size: int = MiB) -> dict:
    return {"action": action, "addr": address, "size": size, "stream": 0}


def _refusal(data: dict) -> str:
    """The SnapshotFormatError text load_snapshot gives ``data`` (bounded in time and memory)."""
    result = run_bounded(lambda: load_snapshot(pickle.dumps(data)))
    assert_within_bounds(result)
    assert isinstance(result.error, SnapshotFormatError), result.error
    text = str(result.error)
    assert len(text) < 1500
    assert "_record_memory_history" in text  # what to do
    return text


def _outside() -> st.SearchStrategy[int]:
    """An address no segment of the base snapshot covers."""
    return st.one_of(st.integers(0, A - 1), st.integers(SEGMENT_END, 2**64 - 1))


# --------------------------------------------------------------------- the contradictions


def unknown_action(action: str, position: int) -> tuple[dict, int, str]:
    data = base_snapshot()
    data["device_traces"][0].insert(position, _entry(action, A))
    return data, position, "is not one PyTorch records"


def double_free(which: int, position: int) -> tuple[dict, int, str]:
    """Entry 3 or 4 (the free of A+5MiB) recorded again after entry 4."""
    data = base_snapshot()
    trace = data["device_traces"][0]
    trace.insert(position, dict(trace[which]))
    return data, position, "double free of 0x7f0000500000"


def free_never_allocated(action: str, address: int, position: int) -> tuple[dict, int, str]:
    data = base_snapshot()
    data["device_traces"][0].insert(position, _entry(action, address))
    return data, position, f"free of {address:#x}, an address never allocated"


def two_live_allocations(address: int, position: int) -> tuple[dict, int, str]:
    """A second alloc at A (live from entry 1 on) or at A+5MiB (live in entries 2-3)."""
    data = base_snapshot()
    data["device_traces"][0].insert(position, _entry("alloc", address))
    return data, position, f"two live allocations at {address:#x}"


def allocation_outside_segments(address: int, position: int) -> tuple[dict, int, str]:
    data = base_snapshot()
    data["device_traces"][0].insert(position, _entry("alloc", address))
    return data, position, f"the allocation at {address:#x} lies outside every segment"


def completed_before_requested() -> tuple[dict, int, str]:
    data = base_snapshot()
    trace = data["device_traces"][0]
    trace[3], trace[4] = trace[4], trace[3]
    return data, 3, "free_completed of 0x7f0000500000 before its free_requested"


CONTRADICTIONS = {
    "unknown_action": st.builds(
        unknown_action,
        st.text(min_size=1, max_size=12).filter(lambda a: a not in ACTIONS_PYTORCH_RECORDS),
        st.integers(0, 5),
    ),
    "double_free": st.builds(double_free, st.sampled_from([3, 4]), st.integers(5, 5)),
    "free_never_allocated": st.builds(
        free_never_allocated,
        st.sampled_from(["free_requested", "free_completed"]),
        _outside(),
        st.integers(0, 5),
    ),
    "two_live_allocations": st.one_of(
        st.builds(two_live_allocations, st.just(A), st.integers(2, 5)),
        st.builds(two_live_allocations, st.just(A + 5 * MiB), st.integers(3, 3)),
    ),
    "allocation_outside_segments": st.builds(
        allocation_outside_segments, _outside(), st.integers(0, 5)
    ),
    "completed_before_requested": st.builds(completed_before_requested),
}


@pytest.mark.parametrize("name", sorted(CONTRADICTIONS))
def test_a_contradiction_is_refused_at_its_entry(name):
    """Each contradiction, wherever it is placed: 'inconsistent at entry K' naming it."""

    @FEW
    @given(CONTRADICTIONS[name])
    def check(case):
        data, index, words = case
        text = _refusal(data)
        assert f"inconsistent at entry {index} of device_traces[0]: " in text
        assert words in text

    check()


def test_a_double_free_anywhere_after_the_free_is_refused():
    """The second free_requested of a block, after its free completed: the entry is named."""
    data, index, words = double_free(3, 5)
    data["device_traces"][0].append(_entry("snapshot", 0, 0))
    text = _refusal(data)
    assert f"inconsistent at entry {index} " in text and "entry 4 already freed it" in text


def test_frees_of_blocks_allocated_before_the_recording_are_not_contradictions():
    """The ring buffer drops the oldest entries: a block freed in the window without its alloc
    (inside a segment), or completed without its request, loads as the recording it is."""
    data = base_snapshot()
    trace = data["device_traces"][0]
    # A 2 MiB block at A+16MiB was allocated before the window and is freed in it; the free of
    # A+10MiB was requested before the window and completes in it.
    trace.insert(1, _entry("free_requested", A + 16 * MiB, 2 * MiB))
    trace.insert(2, _entry("free_completed", A + 16 * MiB, 2 * MiB))
    trace.insert(3, _entry("free_completed", A + 10 * MiB, 2 * MiB))
    snapshot = load_snapshot(pickle.dumps(data))
    assert [e.action for e in snapshot.trace_for(0)][:4] == [
        "segment_alloc",
        "free_requested",
        "free_completed",
        "free_completed",
    ]


def test_every_real_snapshot_still_loads():
    """The real snapshots in ../shared/snapshots are all consistent (nothing PyTorch wrote is
    refused by these checks)."""
    root = Path(__file__).resolve().parents[2].parent / "shared" / "snapshots"
    files = sorted(root.glob("*/*.p*"))
    if not files:
        pytest.skip("../shared/snapshots is not present")
    for path in files:
        snapshot = load_snapshot(path)
        assert snapshot.segments or snapshot.device_traces, path


# --------------------------------------------------------------------- wrong types, absurd sizes

NOT_A_POOL_ID = st.one_of(
    st.just((math.nan, 0)),
    st.just("0,0"),
    st.text(max_size=8),
    st.floats(allow_nan=True),
    st.lists(st.integers(0, 9), max_size=4).filter(lambda v: len(v) != 2),
    st.tuples(st.integers(-(2**70), -1), st.integers(0, 5)),
    st.tuples(st.integers(0, 5), st.integers(2**64, 2**70)),
    st.tuples(st.text(max_size=3), st.integers(0, 5)),
)
NOT_A_BOOL = st.one_of(
    st.sampled_from(["no", "False", "", "yes"]), st.integers(0, 1), st.floats(allow_nan=True)
)
NOT_A_STRING = st.one_of(
    st.floats(allow_nan=True), st.integers(), st.lists(st.integers(), min_size=1, max_size=3)
)
ABSURD = st.one_of(
    st.just(2**20000), st.integers(2**64, 2**200), st.integers(-(2**200), -1), st.just(-(2**20000))
)


def _segment(d):
    return d["segments"][0]


def _trace_entry(d):
    return d["device_traces"][0][2]


WRONG_TYPES = {
    "segment_pool_id": (
        NOT_A_POOL_ID,
        lambda d, v: _segment(d).update(segment_pool_id=v),
        "'segment_pool_id' is ",
    ),
    "trace_pool_id": (
        NOT_A_POOL_ID,
        lambda d, v: _trace_entry(d).update(pool_id=v),
        "'pool_id' is ",
    ),
    "is_expandable": (
        NOT_A_BOOL,
        lambda d, v: _segment(d).update(is_expandable=v),
        "'is_expandable' is ",
    ),
    "recorded_alloc_conf": (
        NOT_A_STRING,
        lambda d, v: d.update(allocator_settings={"PYTORCH_CUDA_ALLOC_CONF": v}),
        "allocator_settings['PYTORCH_CUDA_ALLOC_CONF'] is ",
    ),
    "gc_threshold": (
        st.one_of(st.just(math.nan), st.just(math.inf), st.text(max_size=4)),
        lambda d, v: d.update(allocator_settings={"garbage_collection_threshold": v}),
        "allocator_settings['garbage_collection_threshold'] is ",
    ),
    "compile_context": (
        NOT_A_STRING,
        lambda d, v: _trace_entry(d).update(compile_context=v),
        "'compile_context' is ",
    ),
    "segment_total_size": (ABSURD, lambda d, v: _segment(d).update(total_size=v), "segment 0 "),
    "segment_allocated_size": (
        ABSURD,
        lambda d, v: _segment(d).update(allocated_size=v),
        "segment 0 ",
    ),
    "block_size": (ABSURD, lambda d, v: _segment(d)["blocks"][1].update(size=v), "segment 0"),
    "block_requested_size": (
        ABSURD,
        lambda d, v: _segment(d)["blocks"][0].update(requested_size=v),
        "requested_size",
    ),
    "trace_size": (ABSURD, lambda d, v: _trace_entry(d).update(size=v), "device_traces[0][2]"),
    "trace_address": (ABSURD, lambda d, v: _trace_entry(d).update(addr=v), "device_traces[0][2]"),
    "trace_time": (
        st.one_of(st.just(2**20000), st.integers(2**64, 2**200), st.integers(-(2**200), -(2**64))),
        lambda d, v: _trace_entry(d).update(time_us=v),
        "device_traces[0][2]",
    ),
}


@pytest.mark.parametrize("name", sorted(WRONG_TYPES))
def test_a_wrong_type_or_absurd_number_is_refused_naming_the_field(name):
    """NaN, strings, lists, bools-as-strings and 2**20000 where PyTorch writes ids, flags and
    sizes: SnapshotFormatError naming where, short (no 6,000-digit number in it)."""
    values, put, words = WRONG_TYPES[name]

    @FEW
    @given(values)
    def check(value):
        data = base_snapshot()
        put(data, value)
        assert words in _refusal(data)

    check()


# --------------------------------------------------------------------- every command, exit 2

CLI_CASES = {
    "unknown_action": (unknown_action("frobnicate", 2), "inconsistent at entry 2"),
    "double_free": (double_free(3, 5), "inconsistent at entry 5"),
    "free_never_allocated": (free_never_allocated("free_requested", 0xDEAD000, 5), "entry 5"),
    "two_live_allocations": (two_live_allocations(A, 5), "inconsistent at entry 5"),
    "allocation_outside_segments": (allocation_outside_segments(0x1000, 1), "entry 1"),
    "completed_before_requested": (completed_before_requested(), "inconsistent at entry 3"),
    "nan_pool_id": (
        (lambda d: (_segment(d).update(segment_pool_id=(math.nan, 0)), d)[1])(base_snapshot()),
        "'segment_pool_id' is (nan, 0)",
    ),
    "string_pool_id": (
        (lambda d: (_trace_entry(d).update(pool_id="a,b"), d)[1])(base_snapshot()),
        "'pool_id' is 'a,b'",
    ),
    "is_expandable_no": (
        (lambda d: (_segment(d).update(is_expandable="no"), d)[1])(base_snapshot()),
        "'is_expandable' is 'no'",
    ),
    "nan_alloc_conf": (
        (lambda d: (d.update(allocator_settings={"PYTORCH_CUDA_ALLOC_CONF": math.nan}), d)[1])(
            base_snapshot()
        ),
        "PYTORCH_CUDA_ALLOC_CONF'] is nan",
    ),
    "size_2_20000": (
        (lambda d: (_trace_entry(d).update(size=2**20000), d)[1])(base_snapshot()),
        "a 20001-bit number",
    ),
}


@pytest.mark.parametrize("name", sorted(CLI_CASES))
def test_every_snapshot_command_exits_2_and_leaves_the_file(tmp_path, name):
    """explain, replay, replay --verify, tune, diff and doctor: exit 2, one line naming the
    problem, no traceback, no diagnosis, and the file unchanged."""
    case, words = CLI_CASES[name]
    data = case[0] if isinstance(case, tuple) else case
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(data))
    results = refused_by_every_command(path, SNAPSHOT_COMMANDS, words)
    for result in results:
        assert "no OOM" not in result.stdout + result.stderr
        assert "diverge" not in result.stdout + result.stderr


# --------------------------------------------------------------------- any edit of the trace

EDITS = st.lists(
    st.tuples(
        st.sampled_from(["delete", "duplicate", "swap", "move_address", "resize"]),
        st.integers(0, 7),
        st.integers(0, 7),
        st.integers(-(2**21), 2**21),
    ),
    min_size=1,
    max_size=3,
)


def _apply(trace: list[dict], edit: tuple[str, int, int, int]) -> None:
    kind, i, j, delta = edit
    if not trace:
        return
    i, j = i % len(trace), j % len(trace)
    if kind == "delete":
        del trace[i]
    elif kind == "duplicate":
        trace.insert(j, dict(trace[i]))
    elif kind == "swap":
        trace[i], trace[j] = trace[j], trace[i]
    elif kind == "move_address":
        trace[i] = {**trace[i], "addr": max(0, trace[i]["addr"] + delta)}
    else:
        trace[i] = {**trace[i], "size": max(0, trace[i]["size"] + delta)}


@settings(max_examples=25, deadline=None, derandomize=True)
@given(edits=EDITS)
def test_any_edit_of_the_trace_is_answered_or_refused_never_a_crash(edits):
    """Entries deleted, duplicated, swapped, moved or resized: the snapshot is either refused
    (SnapshotFormatError) or loads, replays and is diagnosed; nothing else is raised."""
    from oomkit.core.replay import replay_snapshot
    from oomkit.diagnose.snapshot_diagnosis import diagnose_snapshot
    from oomkit.errors import OomkitError

    data = base_snapshot()
    for edit in edits:
        _apply(data["device_traces"][0], edit)

    def analyse() -> None:
        snapshot = load_snapshot(pickle.dumps(data))
        replay_snapshot(snapshot, verify=True)
        diagnose_snapshot(snapshot, price_settings=False)

    result = run_bounded(analyse)
    assert_within_bounds(result, memory_bytes=512 * MiB)
    assert result.error is None or isinstance(result.error, OomkitError), repr(result.error)

"""The bound on a pickle's expansion (issue 36): lists shared over and over fail fast, with the bound."""

from __future__ import annotations

import os
import pickle
import resource
import subprocess
import sys
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oomkit.core.snapshot import load_snapshot
from oomkit.core.snapshot.reader import expansion_limit
from oomkit.errors import SnapshotFormatError

ADDRESS = 0x7F00_0000_0000
FRAME = {"filename": "train.py", "line": 7, "name": "step"}
# What the bomb must not get past: the reader's own time, and a command's (CPU, start-up included).
READER_LIMIT_S = 5.0


def _entry(index: int, frames: list) -> dict[str, Any]:
    return {
        "action": "alloc",
        "addr": ADDRESS + 512 * index,
        "size": 512,
        "stream": 0,
        "frames": frames,
    }


def _segment(blocks: list) -> dict[str, Any]:
    return {"address": ADDRESS, "total_size": 2**21, "segment_type": "small", "blocks": blocks}


def _bomb(shape: str, outer: int, inner: int) -> dict[str, Any]:
    """A snapshot of a few KB whose lists are the same list referred to ``outer`` times, each
    ``inner`` long: ``outer * inner`` entries once expanded."""
    block = {"address": ADDRESS, "size": 2**21, "state": "inactive"}
    if shape == "device traces":
        trace = [_entry(i, []) for i in range(inner)]
        return {"segments": [], "device_traces": [trace] * outer}
    if shape == "entries of one trace":
        one = _entry(0, [])
        return {"segments": [], "device_traces": [[one] * inner] * outer}
    if shape == "stack frames":
        stack = [FRAME] * inner
        return {"segments": [], "device_traces": [[_entry(i, stack) for i in range(outer)]]}
    if shape == "segments":
        return {"segments": [_segment([block] * inner)] * outer, "device_traces": []}
    raise AssertionError(shape)


SHAPES = st.sampled_from(["device traces", "entries of one trace", "stack frames", "segments"])
# outer * inner >= 1.2M, above the 1M floor; the files stay under 200 KB.
SIZES = st.integers(min_value=1_100, max_value=2_000)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=SHAPES, outer=SIZES, inner=SIZES)
def test_a_memo_bomb_fails_fast_with_the_bound(shape, outer, inner):
    """A few KB expanding to millions of entries: refused in under 5 s, naming the bound."""
    raw = pickle.dumps(_bomb(shape, outer, inner), protocol=pickle.HIGHEST_PROTOCOL)
    assert len(raw) < 200_000
    start = time.process_time()
    with pytest.raises(SnapshotFormatError, match=r"expands to more than 1,000,000 entries"):
        load_snapshot(raw)
    assert time.process_time() - start < READER_LIMIT_S


def test_the_bound_scales_with_the_file():
    """4 entries a byte above the floor of 1M (PyTorch's files give at most 0.42)."""
    assert expansion_limit(1_000) == 1_000_000
    assert expansion_limit(250_000) == 1_000_000
    assert expansion_limit(1_000_000_000) == 4_000_000_000


def test_a_large_shared_stack_within_the_bound_loads():
    """One stack of 100 frames shared by 5,000 entries (500k frames read): within the bound."""
    stack = [dict(FRAME, line=k) for k in range(100)]
    data = {"segments": [], "device_traces": [[_entry(i, stack) for i in range(5_000)]]}
    snapshot = load_snapshot(pickle.dumps(data, protocol=pickle.HIGHEST_PROTOCOL))
    trace = snapshot.trace_for(0)
    assert len(trace) == 5_000 and {len(e.frames) for e in trace} == {100}


@pytest.mark.parametrize("command", ["explain", "replay"])
def test_the_cli_refuses_a_memo_bomb_with_exit_2(tmp_path, command):
    """`python -m oomkit explain|replay BOMB`: exit 2, one line naming the bound, in bounded CPU."""
    path = tmp_path / "bomb.pickle"
    path.write_bytes(pickle.dumps(_bomb("device traces", 2_000, 2_000), protocol=4))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(
        [sys.executable, "-m", "oomkit", command, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "expands to more than 1,000,000 entries" in lines[0]
    assert "Traceback" not in done.stderr
    # The command's start-up (imports) is counted too; the bound itself is instant.
    assert cpu_s < 2 * READER_LIMIT_S
    assert path.stat().st_size < 200_000


_MARK = "DEEP_HERE"


def _with_deep_list(data: dict[str, Any], depth: int) -> bytes:
    """``data`` pickled (protocol 2: no frames), each ``_MARK`` string replaced by a list nested
    ``depth`` deep (pickle itself would recurse that deep): ``depth`` empty lists pushed, then
    each appended to the one below it."""
    raw = pickle.dumps(data, protocol=2)
    marker = b"X" + len(_MARK).to_bytes(4, "little") + _MARK.encode()
    assert marker in raw
    return raw.replace(marker, b"]" * depth + b"a" * (depth - 1))


PLACES = st.sampled_from(["trace entry", "stack", "segment", "compile context", "pool id"])


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(place=PLACES, depth=st.integers(min_value=1_000, max_value=100_000))
def test_deep_nesting_is_answered_fast(place, depth):
    """A list nested up to 100,000 deep anywhere: refused naming where, or (as a stack's item)
    skipped, fast."""
    entry = _entry(0, [FRAME])
    data: dict[str, Any] = {"segments": [], "device_traces": [[entry]]}
    if place == "trace entry":
        data["device_traces"][0].append(_MARK)
    elif place == "stack":
        entry["frames"] = [FRAME, _MARK]
    elif place == "segment":
        data["segments"].append(_MARK)
    elif place == "compile context":
        entry["compile_context"] = _MARK
    else:
        entry["pool_id"] = _MARK
    raw = _with_deep_list(data, depth)
    start = time.process_time()
    refusals = {
        "trace entry": "device_traces[0][1] is a list, not a dict",
        "segment": "segment 0 is a list, not a dict",
        "compile context": "'compile_context' is [[[[...]]]]; PyTorch records a string",
        "pool id": "device_traces[0][0]",
    }
    try:
        snapshot = load_snapshot(raw)
    except SnapshotFormatError as exc:
        assert refusals[place] in str(exc)
    else:
        assert place == "stack"  # an item of a stack that is not a frame dict is skipped
        assert [f.name for f in snapshot.trace_for(0)[0].frames] == ["step"]
    assert time.process_time() - start < READER_LIMIT_S

"""replay --verify never reports success on nothing: 0 of 0 is "nothing to verify" (exit 4)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from oomkit.core.replay import replay_snapshot
from oomkit.core.snapshot import load_snapshot, write_snapshot
from oomkit.interfaces.cli import main
from oomkit.interfaces.cli.replay import EXIT_NOTHING_TO_VERIFY

sys.path.insert(0, str(Path(__file__).parents[2] / "diagnose"))
from cases.oom_cases import GiB, MiB, Recorder  # noqa: E402


def _no_trace(tmp_path: Path) -> Path:
    """One 20 MiB segment holding a live 5 MiB block, and an empty trace."""
    recorder = Recorder(capacity_bytes=GiB, outside_bytes=0)
    recorder.alloc(5 * MiB)
    path = tmp_path / "empty_trace.pickle"
    return write_snapshot(path, recorder.allocator.snapshot(), {0: []}, {})


def _cached_only(tmp_path: Path) -> Path:
    """A trace that starts after the segment was made: 2 allocs served from the cache, no
    segment event."""
    recorder = Recorder(capacity_bytes=GiB, outside_bytes=0)
    first = recorder.alloc(5 * MiB)
    recorder.free(first)
    start = len(recorder.events)
    recorder.alloc(3 * MiB)
    recorder.alloc(2 * MiB)
    recorder.events = recorder.events[start:]
    return recorder.write(tmp_path / "cached.pickle")


def test_verify_with_nothing_to_compare_exits_4(tmp_path, capsys, monkeypatch):
    """An empty trace: 'nothing to verify', never 'reproduced exactly: 0/0', exit 4."""
    monkeypatch.setenv("COLUMNS", "200")
    assert EXIT_NOTHING_TO_VERIFY == 4
    assert main(["replay", str(_no_trace(tmp_path)), "--verify"]) == 4
    out = capsys.readouterr().out
    assert "Verify: nothing to verify: the trace holds no segment decision and no allocation" in out
    assert "reproduced" not in out and "0/0" not in out


def test_verify_json_says_verified_false(tmp_path, capsys):
    """--json: verified false, reproduced null, 0 decisions and 0 placements checked."""
    assert main(["replay", str(_no_trace(tmp_path)), "--verify", "--json"]) == 4
    out = json.loads(capsys.readouterr().out)
    assert out["verified"] is False and out["reproduced"] is None
    assert (out["segment_events_recorded"], out["allocs_checked"]) == (0, 0)
    assert out["readings_tried"] == 1


def test_plain_replay_of_an_empty_trace_still_exits_0(tmp_path, capsys):
    """Without --verify, replaying an empty trace is not a failure (exit 0), but says so."""
    assert main(["replay", str(_no_trace(tmp_path))]) == 0
    assert "nothing to verify" in capsys.readouterr().out


def test_block_placements_count_when_no_segment_event(tmp_path, capsys, monkeypatch):
    """Allocs served from the cache: 0/0 segment decisions, yet 2/2 placements checked: exit 0."""
    monkeypatch.setenv("COLUMNS", "200")
    path = _cached_only(tmp_path)
    assert main(["replay", str(path), "--verify", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["verified"] is True and out["reproduced"] is True
    assert (out["segment_events_recorded"], out["segment_events_matched"]) == (0, 0)
    assert (out["allocs_checked"], out["allocs_misplaced"]) == (2, 0)
    assert main(["replay", str(path), "--verify"]) == 0
    text = capsys.readouterr().out
    assert "reproduced exactly: 0/0 segment decisions, 2/2 block placements match." in text
    assert "readings of the trace tried: 1 (the best is kept)." in text


def test_result_record_counts(tmp_path):
    """The API record: verified/reproduced properties and the counts behind them."""
    empty = replay_snapshot(load_snapshot(_no_trace(tmp_path)), verify=True)
    assert (empty.verified, empty.reproduced, empty.allocs_checked) == (False, False, 0)
    cached = replay_snapshot(load_snapshot(_cached_only(tmp_path)), verify=True)
    assert (cached.verified, cached.reproduced, cached.allocs_checked) == (True, True, 2)
    assert cached.readings_tried == 1
    what_if = replay_snapshot(load_snapshot(_cached_only(tmp_path)), capacity_bytes=GiB)
    assert (what_if.verified, what_if.allocs_checked, what_if.readings_tried) == (None, None, None)

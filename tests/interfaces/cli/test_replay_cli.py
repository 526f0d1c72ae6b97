"""`oomkit replay SNAPSHOT`: the report, --json and --verify on a snapshot oomkit wrote."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from oomkit.interfaces.cli import main

sys.path.insert(0, str(Path(__file__).parents[2] / "diagnose"))
from cases.oom_cases import GiB, MiB, Recorder  # noqa: E402


def _snapshot(directory: Path) -> Path:
    """300 MiB (its own segment), 5 MiB (a 20 MiB segment), free the 300 MiB, 200 MiB (split
    from the cached 300 MiB block), 1000 B (a 2 MiB small segment): 3 cudaMallocs, 322 MiB."""
    recorder = Recorder(capacity_bytes=GiB, outside_bytes=0)
    first = recorder.alloc(300 * MiB)
    recorder.alloc(5 * MiB)
    recorder.free(first)
    recorder.alloc(200 * MiB)
    recorder.alloc(1000)
    return recorder.write(directory / "s.pickle")


REPLAY_GOLDEN = """\
Verify: reproduced exactly: 3/3 segment decisions match, final state matches.
             Replay of s.pickle
┏━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┳━━━━━━━━━━━━┓
┃ metric                      ┃      value ┃
┡━━━━━━━━━━━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━━━━┩
│ events replayed             │          9 │
│ peak allocated              │ 305.00 MiB │
│ peak reserved               │ 322.00 MiB │
│ peak reserved (as recorded) │ 322.00 MiB │
│ cudaMalloc / cudaFree       │      3 / 0 │
│ alloc retries               │          0 │
└─────────────────────────────┴────────────┘
"""


def test_replay_verify_human_output_golden(tmp_path, capsys, monkeypatch):
    """100 columns, no colour: the verify line, then the replay table."""
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.chdir(tmp_path)
    _snapshot(tmp_path)
    assert main(["replay", "s.pickle", "--verify"]) == 0
    out = capsys.readouterr().out
    assert "\n".join(line.rstrip() for line in out.splitlines()) + "\n" == REPLAY_GOLDEN


def test_replay_json_exact_bytes(tmp_path, capsys):
    """Peak 300 + 5 MiB allocated; 300 + 20 + 2 MiB reserved; at the end 200 MiB + 5 MiB + 1 KiB."""
    path = _snapshot(tmp_path)
    assert main(["replay", str(path), "--verify", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["peak_allocated_bytes"] == 305 * MiB
    assert out["peak_reserved_bytes"] == out["recorded_peak_reserved_bytes"] == 322 * MiB
    assert out["final_allocated_bytes"] == 205 * MiB + 1024
    assert (out["num_device_alloc"], out["num_device_free"]) == (3, 0)
    assert (out["segment_events_recorded"], out["segment_events_matched"]) == (3, 3)
    assert out["final_state_matches"] is True and out["oom"] is False


def test_replay_of_a_corrupt_file_is_one_line_exit_2(tmp_path, capsys):
    """Not a pickle: exit 2 and one line saying how to produce a valid snapshot."""
    bad = tmp_path / "bad.pickle"
    bad.write_text("garbage\n")
    assert main(["replay", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith(f"oomkit: error: {bad}: cannot be read as a memory snapshot")
    assert "_dump_snapshot" in err[0]

"""`oomkit replay SNAPSHOT`: the report, --json and --verify on a snapshot oomkit wrote."""

from __future__ import annotations

import json

from _replay_snapshot import MiB, replay_snapshot

from oomkit.interfaces.cli import main

REPLAY_GOLDEN = """\
Verify: reproduced exactly: 3/3 segment decisions, 4/4 block placements match.
  final state matches; readings of the trace tried: 1 (the best is kept).
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
    replay_snapshot(tmp_path)
    assert main(["replay", "s.pickle", "--verify"]) == 0
    out = capsys.readouterr().out
    assert "\n".join(line.rstrip() for line in out.splitlines()) + "\n" == REPLAY_GOLDEN


def test_replay_json_exact_bytes(tmp_path, capsys):
    """Peak 300 + 5 MiB allocated; 300 + 20 + 2 MiB reserved; at the end 200 MiB + 5 MiB + 1 KiB."""
    path = replay_snapshot(tmp_path)
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


# What torch.cuda.get_device_properties().total_memory reports on an RTX 4090 (the catalog).
RTX4090_TOTAL_BYTES = 25_756_696_576


def _spy_replay(monkeypatch) -> list[dict]:
    """Record the verify flag and capacity each replay_snapshot call gets (then run it)."""
    import oomkit.core.replay as replay_module

    calls: list[dict] = []
    real = replay_module.replay_snapshot

    def spy(snapshot, device, **kwargs):
        calls.append({"verify": kwargs["verify"], "capacity_bytes": kwargs["capacity_bytes"]})
        return real(snapshot, device, **kwargs)

    monkeypatch.setattr(replay_module, "replay_snapshot", spy)
    return calls


def test_replay_verify_with_alloc_conf_is_refused(tmp_path, capsys):
    """--verify replays the recorded setting: with --alloc-conf it exits 2 with one line."""
    path = replay_snapshot(tmp_path)
    code = main(["replay", str(path), "--verify", "--alloc-conf", "expandable_segments:True"])
    assert code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.strip().splitlines()
    assert line.startswith(
        "oomkit: error: --verify replays the snapshot under the setting it was recorded with, "
        "so it cannot take --alloc-conf."
    )


def test_replay_gpu_name_equals_capacity_of_its_total_bytes(tmp_path, capsys, monkeypatch):
    """`--gpu rtx4090` is a what-if at the 4090's total memory, as `--capacity <those bytes>`."""
    path = replay_snapshot(tmp_path)
    calls = _spy_replay(monkeypatch)
    assert main(["replay", str(path), "--gpu", "rtx4090", "--json"]) == 0
    by_name = capsys.readouterr().out
    assert main(["replay", str(path), "--capacity", str(RTX4090_TOTAL_BYTES), "--json"]) == 0
    assert capsys.readouterr().out == by_name
    assert calls == [{"verify": False, "capacity_bytes": RTX4090_TOTAL_BYTES}] * 2
    assert json.loads(by_name)["peak_reserved_bytes"] == 322 * MiB


def test_replay_gpu_size_and_capacity_alias_agree(tmp_path, capsys):
    """At 320 MiB the 322 MiB replay runs out of memory (exit 1), by either flag; at 400 it fits."""
    path = replay_snapshot(tmp_path)
    assert main(["replay", str(path), "--gpu", "320MiB", "--json"]) == 1
    by_gpu = json.loads(capsys.readouterr().out)
    assert main(["replay", str(path), "--capacity", "320MiB", "--json"]) == 1
    assert json.loads(capsys.readouterr().out) == by_gpu
    assert by_gpu["oom"] is True
    assert main(["replay", str(path), "--gpu", "400MiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["oom"] is False


def test_replay_verify_with_gpu_verifies_at_its_capacity(tmp_path, capsys, monkeypatch):
    """--verify --gpu still verifies (3/3 decisions), sizing reservations by that GPU's memory."""
    path = replay_snapshot(tmp_path)
    calls = _spy_replay(monkeypatch)
    assert main(["replay", str(path), "--verify", "--gpu", "rtx4090", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["segment_events_recorded"], out["segment_events_matched"]) == (3, 3)
    assert out["final_state_matches"] is True
    assert calls == [{"verify": True, "capacity_bytes": RTX4090_TOTAL_BYTES}]


def test_replay_unknown_gpu_is_one_line_exit_2(tmp_path, capsys):
    """A GPU name with a typo exits 2 and names the catalog GPU it is close to."""
    path = replay_snapshot(tmp_path)
    assert main(["replay", str(path), "--gpu", "rtx4091"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("oomkit: error: unknown GPU 'rtx4091'. Did you mean 'RTX 4090'")

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
# Its CUDA context as predict assumes it (lazy loading, Ada Lovelace: oomkit.core.gpus.overhead).
RTX4090_CONTEXT_BYTES = 430 * MiB
# The context the model gives a plain size (a typical GPU, lazy loading).
SIZE_CONTEXT_BYTES = 400 * MiB
# The device keys each replay --json carries when --gpu or --capacity names a device.
DEVICE_KEYS = ("gpu", "capacity_bytes", "context_overhead_bytes", "usable_bytes", "cuda_context")


def _spy_replay(monkeypatch) -> list[dict]:
    """Record the verify flag, capacity and outside memory of each replay_snapshot call."""
    import oomkit.core.replay as replay_module

    calls: list[dict] = []
    real = replay_module.replay_snapshot

    def spy(snapshot, device, **kwargs):
        calls.append(
            {
                "verify": kwargs["verify"],
                "capacity_bytes": kwargs["capacity_bytes"],
                "reserved_outside_bytes": kwargs["reserved_outside_bytes"],
            }
        )
        return real(snapshot, device, **kwargs)

    monkeypatch.setattr(replay_module, "replay_snapshot", spy)
    return calls


def _replay_part(out: dict) -> dict:
    """A replay's --json without the device keys: what the allocator did."""
    return {key: value for key, value in out.items() if key not in DEVICE_KEYS}


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


def test_replay_gpu_name_is_the_device_less_its_context(tmp_path, capsys, monkeypatch):
    """`--gpu rtx4090` replays on the 4090: its total memory, its 430 MiB CUDA context held
    outside the allocator, which may reserve the rest, as `--capacity <total - context>`."""
    path = replay_snapshot(tmp_path)
    calls = _spy_replay(monkeypatch)
    assert main(["replay", str(path), "--gpu", "rtx4090", "--json"]) == 0
    by_name = json.loads(capsys.readouterr().out)
    usable = RTX4090_TOTAL_BYTES - RTX4090_CONTEXT_BYTES
    assert main(["replay", str(path), "--capacity", str(usable), "--json"]) == 0
    by_limit = json.loads(capsys.readouterr().out)
    assert calls == [
        {"verify": False, "capacity_bytes": RTX4090_TOTAL_BYTES,
         "reserved_outside_bytes": RTX4090_CONTEXT_BYTES},
        {"verify": False, "capacity_bytes": usable, "reserved_outside_bytes": 0},
    ]
    assert _replay_part(by_name) == _replay_part(by_limit)
    assert by_name["peak_reserved_bytes"] == 322 * MiB
    assert (by_name["gpu"], by_name["capacity_bytes"]) == ("RTX 4090", RTX4090_TOTAL_BYTES)
    assert by_name["context_overhead_bytes"] == RTX4090_CONTEXT_BYTES
    assert by_name["usable_bytes"] == by_limit["usable_bytes"] == usable == 25_305_808_896
    assert by_name["cuda_context"].startswith("~430.00 MiB (256.00 MiB-1.20 GiB) for Ada Lovelace")
    assert (by_limit["gpu"], by_limit["context_overhead_bytes"]) == (None, 0)
    assert by_limit["cuda_context"] is None


def test_replay_gpu_size_subtracts_the_context_and_capacity_does_not(tmp_path, capsys):
    """The replay reserves 322 MiB. --capacity 320MiB runs out (exit 1), 400MiB fits; --gpu
    720MiB is a device whose 400 MiB context leaves the same 320 MiB (exit 1), and --gpu 800MiB
    leaves 400 MiB (fits); --gpu 320MiB --context-overhead 0 is --capacity 320MiB."""
    path = replay_snapshot(tmp_path)

    def replay(*flags: str) -> tuple[int, dict]:
        code = main(["replay", str(path), *flags, "--json"])
        return code, json.loads(capsys.readouterr().out)

    code, at_320 = replay("--capacity", "320MiB")
    assert code == 1 and at_320["oom"] is True and at_320["usable_bytes"] == 320 * MiB
    assert replay("--capacity", "400MiB")[1]["oom"] is False
    code, device_720 = replay("--gpu", "720MiB")
    assert code == 1
    assert device_720["context_overhead_bytes"] == SIZE_CONTEXT_BYTES
    assert device_720["usable_bytes"] == 320 * MiB
    assert device_720["oom_event_index"] == at_320["oom_event_index"]
    code, device_800 = replay("--gpu", "800MiB")
    assert code == 0 and device_800["usable_bytes"] == 400 * MiB
    code, raw = replay("--gpu", "320MiB", "--context-overhead", "0")
    assert code == 1
    assert _replay_part(raw) == _replay_part(at_320)
    assert (raw["capacity_bytes"], raw["usable_bytes"]) == (320 * MiB, 320 * MiB)
    assert raw["cuda_context"] == "0 B outside PyTorch, given by the caller"


def test_replay_gpu_smaller_than_its_context_points_to_capacity(tmp_path, capsys):
    """`--gpu 100MiB` (under the 400 MiB context modelled for a size) exits 2 with one line
    that names --capacity, the flag for an allocator limited to 100 MiB."""
    path = replay_snapshot(tmp_path)
    assert main(["replay", str(path), "--gpu", "100MiB"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "context_overhead_bytes must be >= 0 and below the total (100.00 MiB)" in line
    assert line.endswith(
        "To simulate an allocator limited to '100MiB', give it with --capacity instead "
        "(nothing subtracted), or give --context-overhead SIZE."
    )


def test_replay_verify_with_gpu_verifies_at_its_capacity(tmp_path, capsys, monkeypatch):
    """--verify --gpu still verifies (3/3 decisions), sizing reservations by that GPU's total
    memory (cudaDeviceProp::totalGlobalMem, as ExpandableSegment does) with its context outside."""
    path = replay_snapshot(tmp_path)
    calls = _spy_replay(monkeypatch)
    assert main(["replay", str(path), "--verify", "--gpu", "rtx4090", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["segment_events_recorded"], out["segment_events_matched"]) == (3, 3)
    assert out["final_state_matches"] is True
    assert out["usable_bytes"] == RTX4090_TOTAL_BYTES - RTX4090_CONTEXT_BYTES
    assert calls == [
        {"verify": True, "capacity_bytes": RTX4090_TOTAL_BYTES,
         "reserved_outside_bytes": RTX4090_CONTEXT_BYTES}
    ]


def test_replay_verify_without_a_device_prints_no_device_keys(tmp_path, capsys):
    """A plain --verify --json is what it was: no device keys (the recorded run's own)."""
    path = replay_snapshot(tmp_path)
    assert main(["replay", str(path), "--verify", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert not set(DEVICE_KEYS) & set(out)


def test_replay_report_says_the_device_and_its_context(tmp_path, capsys, monkeypatch):
    """The report's head: the device, its total, the context subtracted and where it comes from."""
    monkeypatch.setenv("COLUMNS", "200")
    path = replay_snapshot(tmp_path)
    assert main(["replay", str(path), "--gpu", "rtx4090"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (
        "Device: RTX 4090 (23.99 GiB total, 430.00 MiB outside PyTorch): the allocator may "
        "reserve 23.57 GiB."
    )
    assert lines[1].startswith("CUDA context assumed: ~430.00 MiB (256.00 MiB-1.20 GiB) for Ada")
    assert main(["replay", str(path), "--capacity", "400MiB"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        "Device: the allocator may reserve 400.00 MiB (--capacity: nothing subtracted)."
    )


def test_replay_unknown_gpu_is_one_line_exit_2(tmp_path, capsys):
    """A GPU name with a typo exits 2 and names the catalog GPU it is close to."""
    path = replay_snapshot(tmp_path)
    assert main(["replay", str(path), "--gpu", "rtx4091"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("oomkit: error: unknown GPU 'rtx4091'. Did you mean 'RTX 4090'")

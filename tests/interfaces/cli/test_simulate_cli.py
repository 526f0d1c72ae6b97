"""Tests for `oomkit simulate`."""

import json

from oomkit.core.trace import TraceEvent, TraceHeader, write_trace
from oomkit.interfaces.cli import main

MiB = 2**20


def _trace(tmp_path, events, name="t.jsonl"):
    path = tmp_path / name
    write_trace(path, events, TraceHeader(format_version=1, source="synthetic"))
    return path


def test_simulate_json_reports_exact_bytes(tmp_path, capsys):
    """A 1000-byte request reserves one 2 MiB small segment and allocates 1024 bytes."""
    path = _trace(
        tmp_path,
        [
            TraceEvent("alloc", 1, 1000),
            TraceEvent("free_requested", 1, 1000),
            TraceEvent("free_completed", 1, 1000),
        ],
    )
    assert main(["simulate", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["events"] == 3
    assert out["peak_allocated_bytes"] == 1024
    assert out["peak_reserved_bytes"] == 2 * MiB
    assert out["final_allocated_bytes"] == 0
    assert out["oom"] is False
    assert [e[0] for e in out["segment_events"]] == ["segment_alloc"]


def test_simulate_oom_exits_1(tmp_path, capsys):
    """A request larger than --capacity ends the replay with an OOM and exit code 1."""
    path = _trace(tmp_path, [TraceEvent("alloc", 1, 30 * MiB)], name="big.jsonl.gz")
    assert main(["simulate", str(path), "--capacity", "16MiB", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["oom"] is True
    assert out["oom_event_index"] == 0
    assert "CUDA out of memory. Tried to allocate 30.00 MiB" in out["oom_message"]


def test_simulate_bad_file_is_one_line_error(tmp_path, capsys):
    """A file that is not an oomkit trace gives exit 2 and a one-line message."""
    path = tmp_path / "x.jsonl"
    path.write_text("not json\n")
    assert main(["simulate", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("oomkit: error:")
    assert len(err.strip().splitlines()) == 1


def test_simulate_bad_alloc_conf_is_usage_error(tmp_path, capsys):
    """A setting PyTorch rejects gives exit 2 and names the setting."""
    path = _trace(tmp_path, [TraceEvent("alloc", 1, 10)])
    assert main(["simulate", str(path), "--alloc-conf", "max_split_size_mb:2"]) == 2
    assert "max_split_size" in capsys.readouterr().err


SIMULATE_GOLDEN = """\
Device: the allocator may reserve 1.00 GiB (--capacity: nothing subtracted).
          Simulated t.jsonl
┏━━━━━━━━━━━━━━━━━━━━━━━┳━━━━━━━━━━━┓
┃ metric                ┃     value ┃
┡━━━━━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━━━┩
│ events replayed       │         6 │
│ peak allocated        │ 42.00 MiB │
│ peak reserved         │ 54.00 MiB │
│ cudaMalloc / cudaFree │     3 / 0 │
│ alloc retries         │         0 │
└───────────────────────┴───────────┘
"""


def test_simulate_human_output_golden(tmp_path, capsys, monkeypatch):
    """100 columns, no colour. 1000 B -> a 2 MiB small segment; 3 MiB -> a 20 MiB segment;
    30 MiB + 1 -> its own 32 MiB; 12 MiB reuses the freed 3 MiB block's 20 MiB segment (split):
    3 cudaMallocs, 54 MiB reserved, 42 MiB (+1.5 KiB) allocated at the peak."""
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.chdir(tmp_path)
    _trace(
        tmp_path,
        [
            TraceEvent("alloc", 1, 1000),
            TraceEvent("alloc", 2, 3 * MiB),
            TraceEvent("alloc", 3, 30 * MiB + 1),
            TraceEvent("free_requested", 2, 3 * MiB),
            TraceEvent("free_completed", 2, 3 * MiB),
            TraceEvent("alloc", 4, 12 * MiB),
        ],
    )
    assert main(["simulate", "t.jsonl", "--capacity", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert "\n".join(line.rstrip() for line in out.splitlines()) + "\n" == SIMULATE_GOLDEN


def test_simulate_gpu_is_the_device_and_capacity_the_limit(tmp_path, capsys, monkeypatch):
    """--gpu rtx4090 replays at its 25,756,696,576 total bytes with its 430 MiB CUDA context
    outside the allocator; --capacity 16MiB is the allocator's limit (a 30 MiB request OOMs);
    neither flag: --capacity 80GiB."""
    import oomkit.core.replay as replay_module

    calls = []
    real = replay_module.simulate_events

    def spy(events, config, **kwargs):
        calls.append((kwargs["capacity_bytes"], kwargs["reserved_outside_bytes"]))
        return real(events, config, **kwargs)

    monkeypatch.setattr(replay_module, "simulate_events", spy)
    path = _trace(tmp_path, [TraceEvent("alloc", 1, 30 * MiB)], name="big.jsonl")
    assert main(["simulate", str(path), "--gpu", "rtx4090", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["oom"] is False and out["gpu"] == "RTX 4090"
    assert out["usable_bytes"] == 25_756_696_576 - 430 * MiB
    assert main(["simulate", str(path), "--capacity", "16MiB", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["oom"] is True
    assert main(["simulate", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["usable_bytes"] == 80 * 2**30
    assert calls == [(25_756_696_576, 430 * MiB), (16 * MiB, 0), (80 * 2**30, 0)]

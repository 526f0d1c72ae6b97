"""Tests for `oomkit tune`."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

import pytest

from oomkit.core.replay import simulate_events
from oomkit.core.snapshot import write_snapshot
from oomkit.core.trace import TraceEvent, TraceHeader, write_trace
from oomkit.interfaces.cli import build_parser, main

MiB = 2**20

# 30 MiB freed, then 40 MiB: the default reserves 70 MiB, expandable_segments:True 40 MiB.
FRAGMENTING = [
    TraceEvent("alloc", 1, 30 * MiB),
    TraceEvent("free_requested", 1, 30 * MiB),
    TraceEvent("free_completed", 1, 30 * MiB),
    TraceEvent("alloc", 2, 40 * MiB),
]


def _trace(tmp_path, events=FRAGMENTING, name="t.jsonl"):
    path = tmp_path / name
    write_trace(path, events, TraceHeader(format_version=1, source="synthetic"))
    return path


def _snapshot(tmp_path, name):
    """A recorded-looking snapshot of FRAGMENTING under the default setting."""
    recorded = simulate_events(FRAGMENTING)
    (_, first, first_size), (_, second, second_size) = recorded.segment_events
    trace = [
        TraceEvent("segment_alloc", first, first_size),
        TraceEvent("alloc", first, 30 * MiB),
        TraceEvent("free_requested", first, 30 * MiB),
        TraceEvent("free_completed", first, 30 * MiB),
        TraceEvent("segment_alloc", second, second_size),
        TraceEvent("alloc", second, 40 * MiB),
    ]
    return write_snapshot(tmp_path / name, recorded.final_segments, {0: trace})


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("oomkit: error:")
    assert len(err.strip().splitlines()) == 1
    return err


def test_tune_flags():
    """`tune` has exactly --gpu, --capacity, --context-overhead, --device, --jobs and --json."""
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    flags = sorted(
        opt
        for a in action.choices["tune"]._actions
        for opt in a.option_strings
        if opt.startswith("--") and opt != "--help"
    )
    assert flags == ["--capacity", "--context-overhead", "--device", "--gpu", "--jobs", "--json"]


def test_tune_json_on_a_trace(tmp_path, capsys):
    """--json prints one object: baseline, ranked candidates, best and the saving in bytes."""
    path = _trace(tmp_path)
    assert main(["tune", str(path), "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""  # no progress bar with --json
    out = json.loads(captured.out)
    assert out["baseline"] == {
        "alloc_conf": "",
        "peak_reserved_bytes": 70 * MiB,
        "peak_allocated_bytes": 40 * MiB,
        "device_allocs": 2,
        "device_frees": 0,
        "alloc_retries": 0,
        "ooms": False,
        "flags": [],
    }
    assert out["best"]["alloc_conf"] == "expandable_segments:True"
    assert out["best"]["peak_reserved_bytes"] == 40 * MiB
    assert out["saving_bytes"] == 30 * MiB
    assert out["capacity_bytes"] == 80 * 2**30
    assert len(out["candidates"]) == 24
    assert out["candidates"][0] == out["best"]
    assert set(out["flag_reasons"]) == {"max-split-with-expandable", "gc-without-fraction"}
    assert "#123548" in out["flag_reasons"]["max-split-with-expandable"]
    assert out["warnings"] == []


GOLDEN = """\
Device: the allocator may reserve 80.00 GiB (--capacity: nothing subtracted).
                           PYTORCH_CUDA_ALLOC_CONF settings for t.jsonl at 80.00 GiB

                                          peak   saving vs   cudaMalloc/
   #   setting                        reserved     default      cudaFree   retries   flags
 ──────────────────────────────────────────────────────────────────────────────────────────────────────────────
   1   expandable_segments:True      40.00 MiB   30.00 MiB         1 / 0         0
   2   expandable_segments:True,     40.00 MiB   30.00 MiB         1 / 0         0
       roundup_power2_divisions:4
   3   expandable_segments:True,     40.00 MiB   30.00 MiB         1 / 0         0
       roundup_power2_divisions:8
   4   expandable_segments:True,     40.00 MiB   30.00 MiB         1 / 0         0
       roundup_power2_divisions:16
   5   expandable_segments:True,     40.00 MiB   30.00 MiB         1 / 0         0   max-split-with-expandable
       max_split_size_mb:128
   6   expandable_segments:True,     40.00 MiB   30.00 MiB         1 / 0         0   max-split-with-expandable
       max_split_size_mb:512
   7   (default)                     70.00 MiB         0 B         2 / 0         0
   8   max_split_size_mb:32          70.00 MiB         0 B         2 / 0         0
   9   max_split_size_mb:64          70.00 MiB         0 B         2 / 0         0
  10   max_split_size_mb:128         70.00 MiB         0 B         2 / 0         0

14 more setting(s) ranked lower; --json lists them all.
max-split-with-expandable: max_split_size_mb with expandable_segments: a free block of at least max_split_size inside an
expandable segment is never reused by a smaller request, so reserved memory can grow without bound across alloc/free
cycles (PyTorch issue #123548); use one or the other
Best: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  saves 30.00 MiB of peak reserved over the default.
"""


def test_tune_human_output_golden(tmp_path, capsys, monkeypatch):
    """At 120 columns without colour: the top-10 table, the reasons of the flags it shows (not
    gc-without-fraction: only a row left out has it), then the best line."""
    monkeypatch.setenv("COLUMNS", "120")
    path = _trace(tmp_path)
    assert main(["tune", str(path)]) == 0
    out = capsys.readouterr().out
    assert "\n".join(line.rstrip() for line in out.splitlines()) + "\n" == GOLDEN


def test_tune_says_when_the_default_is_best(tmp_path, capsys):
    """A workload every setting serves alike ends with 'the default is already best'."""
    events = [
        TraceEvent("alloc", 1, 1000),
        TraceEvent("free_requested", 1, 1000),
        TraceEvent("free_completed", 1, 1000),
    ]
    path = _trace(tmp_path, events)
    assert main(["tune", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1] == (
        "Best: the default is already best (peak reserved 2.00 MiB)."
    )
    assert "warning: every setting gives the same result" in out


def test_tune_out_of_memory_still_exits_0(tmp_path, capsys):
    """Candidates that OOM rank last; with none fitting, best is null and the exit code 0."""
    path = _trace(tmp_path, [TraceEvent("alloc", 1, 30 * MiB)])
    assert main(["tune", str(path), "--capacity", "16MiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["best"] is None
    assert out["saving_bytes"] == 0
    assert all(c["ooms"] for c in out["candidates"])
    assert out["capacity_bytes"] == 16 * MiB


def test_tune_snapshot_detected_by_content(tmp_path, capsys):
    """A pickle without a .pickle suffix is read as a snapshot and tuned as a what-if."""
    path = _snapshot(tmp_path, "recording.bin")
    assert main(["tune", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["device"] == 0
    assert out["baseline"]["peak_reserved_bytes"] == 70 * MiB
    assert out["best"]["alloc_conf"] == "expandable_segments:True"
    assert out["saving_bytes"] == 30 * MiB


def test_tune_snapshot_by_suffix_with_device(tmp_path, capsys):
    """A .pickle snapshot with --device 0 gives the same ranking."""
    path = _snapshot(tmp_path, "snap.pickle")
    assert main(["tune", str(path), "--device", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["saving_bytes"] == 30 * MiB


def test_tune_unknown_snapshot_device_is_usage_error(tmp_path, capsys):
    """A device the snapshot does not hold gives exit 2 and names the devices it has."""
    path = _snapshot(tmp_path, "snap.pickle")
    assert main(["tune", str(path), "--device", "3"]) == 2
    assert "device 3" in _one_line_error(capsys)


def test_tune_missing_file_is_usage_error(tmp_path, capsys):
    """A missing file gives exit 2 and a one-line message."""
    assert main(["tune", str(tmp_path / "nope.jsonl")]) == 2
    assert "no such file" in _one_line_error(capsys)


def test_tune_corrupt_trace_is_usage_error(tmp_path, capsys):
    """A file that is not an oomkit trace gives exit 2 and a one-line message."""
    path = tmp_path / "x.jsonl"
    path.write_text("not json\n")
    assert main(["tune", str(path)]) == 2
    _one_line_error(capsys)


def test_tune_truncated_trace_is_usage_error(tmp_path, capsys):
    """A trace that breaks off mid-way is reported when the sweep reaches it: exit 2."""
    path = _trace(tmp_path)
    text = path.read_text().splitlines()
    path.write_text("\n".join(text[:-1] + ['{"broken']) + "\n")
    assert main(["tune", str(path)]) == 2
    _one_line_error(capsys)


def test_tune_corrupt_snapshot_is_usage_error(tmp_path, capsys):
    """A .pickle file that is not a snapshot gives exit 2 and a one-line message."""
    path = tmp_path / "bad.pickle"
    path.write_bytes(b"\x80\x04garbage")
    assert main(["tune", str(path)]) == 2
    _one_line_error(capsys)


@pytest.mark.parametrize("capacity", ["lots", "-3GiB", "0"])
def test_tune_bad_capacity_is_usage_error(tmp_path, capsys, capacity):
    """A capacity that is not a positive size gives exit 2 and a one-line message."""
    path = _trace(tmp_path)
    assert main(["tune", str(path), f"--capacity={capacity}"]) == 2
    _one_line_error(capsys)


def test_tune_progress_bar_on_a_terminal(tmp_path, capsys, monkeypatch):
    """With stderr a terminal the sweep drives a progress bar there; stdout is unchanged."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    seen = []
    from oomkit.interfaces.cli import tune as tune_cli

    original = tune_cli.progress_bar

    @contextlib.contextmanager
    def spy(enabled, what):
        assert enabled and what == "replaying settings"
        with original(enabled, what) as update:

            def counted(done, total):
                seen.append((done, total))
                update(done, total)

            yield counted

    monkeypatch.setattr(tune_cli, "progress_bar", spy)
    path = _trace(tmp_path)
    assert main(["tune", str(path)]) == 0
    assert seen[0] == (0, 24) and seen[-1] == (24, 24)
    assert "Best: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in capsys.readouterr().out


def test_tune_gpu_name_is_the_device_less_its_context(tmp_path, capsys):
    """--gpu rtx4090 ranks on the 4090: its total memory with its 430 MiB CUDA context held
    outside the allocator; the ranking is that of --capacity <total - context>."""
    path = _trace(tmp_path)
    assert main(["tune", str(path), "--gpu", "rtx4090", "--json"]) == 0
    by_name = json.loads(capsys.readouterr().out)
    assert by_name["gpu"] == "RTX 4090"
    assert by_name["capacity_bytes"] == 25_756_696_576
    assert by_name["context_overhead_bytes"] == 430 * MiB
    assert by_name["usable_bytes"] == 25_756_696_576 - 430 * MiB
    assert main(["tune", str(path), "--capacity", str(by_name["usable_bytes"]), "--json"]) == 0
    by_limit = json.loads(capsys.readouterr().out)
    assert (by_limit["gpu"], by_limit["usable_bytes"]) == (None, by_name["usable_bytes"])
    assert by_limit["candidates"] == by_name["candidates"]


def test_tune_small_gpu_runs_out_where_its_capacity_fits(tmp_path, capsys):
    """A 30 MiB request: --capacity 32MiB fits, but --gpu 432MiB (its 400 MiB context
    subtracted, 32 MiB left) fits too, and --gpu 32MiB --context-overhead 0 is --capacity 32MiB;
    --gpu 429MiB leaves 29 MiB: every setting runs out."""
    path = _trace(tmp_path, [TraceEvent("alloc", 1, 30 * MiB)])

    def tune(*flags: str) -> dict:
        assert main(["tune", str(path), *flags, "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    by_limit = tune("--capacity", "32MiB")
    assert not by_limit["baseline"]["ooms"]
    assert tune("--gpu", "432MiB")["candidates"] == by_limit["candidates"]
    raw = tune("--gpu", "32MiB", "--context-overhead", "0")
    assert raw["candidates"] == by_limit["candidates"] and raw["usable_bytes"] == 32 * MiB
    assert all(c["ooms"] for c in tune("--gpu", "429MiB")["candidates"])


def test_tune_piped_keeps_setting_names_whole(tmp_path, capsys, monkeypatch):
    """Piped (not a terminal, no $COLUMNS), the setting names are never folded into pieces and
    no sentence wraps at 80 columns (issue 16 item 15)."""
    monkeypatch.delenv("COLUMNS", raising=False)
    path = _trace(tmp_path)
    assert main(["tune", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    row = next(line for line in lines if line.lstrip().startswith("1 "))
    assert row.split()[:2] == ["1", "expandable_segments:True"]
    assert any(len(line) > 80 for line in lines)
    reason = next(line for line in lines if line.startswith("max-split-with-expandable:"))
    assert reason.endswith("(PyTorch issue #123548); use one or the other")


@pytest.mark.parametrize("kind", ["trace", "snapshot"])
def test_tune_jobs_gives_the_serial_output(tmp_path, capsys, kind):
    """`--jobs 2` (a process pool) prints exactly what `--jobs 1` prints."""
    path = _trace(tmp_path) if kind == "trace" else _snapshot(tmp_path, "s.pickle")
    outputs = []
    for jobs in ("1", "2"):
        assert main(["tune", str(path), "--capacity", "1GiB", "--json", "--jobs", jobs]) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert outputs[0] == outputs[1]
    assert outputs[0]["best"]["alloc_conf"] == "expandable_segments:True"


@pytest.mark.parametrize("jobs", ["0", "-2", "many"])
def test_tune_bad_jobs_is_a_usage_error(tmp_path, capsys, jobs):
    """--jobs takes a positive number of processes."""
    with pytest.raises(SystemExit) as exc:
        main(["tune", str(_trace(tmp_path)), "--jobs", jobs])
    assert exc.value.code == 2
    assert "positive number of processes" in capsys.readouterr().err


def test_tune_replays_no_more_settings_at_once_than_memory_holds(tmp_path, capsys, monkeypatch):
    """With memory for one process like this one, `--jobs 4` replays one setting at a time,
    says so on stderr, and prints what `--jobs 1` prints."""
    import oomkit.executors.forked as parallel

    path = _snapshot(tmp_path, "s.pickle")
    assert main(["tune", str(path), "--capacity", "1GiB", "--json", "--jobs", "1"]) == 0
    serial = capsys.readouterr()
    assert "setting(s) at once" not in serial.err
    monkeypatch.setattr(parallel, "memory_worker_cap", lambda: 1)
    pools = []
    real_pool = parallel._run_in_pool
    monkeypatch.setattr(parallel, "_run_in_pool", lambda *a: pools.append(a[1]) or real_pool(*a))
    assert main(["tune", str(path), "--capacity", "1GiB", "--json", "--jobs", "4"]) == 0
    capped = capsys.readouterr()
    assert json.loads(capped.out) == json.loads(serial.out)
    assert pools == []  # one at a time, in this process
    assert "replaying 1 setting(s) at once, not 4: a process may come to hold as much memory" in capped.err

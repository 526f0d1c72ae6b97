"""`oomkit explain` on error text: argument, file, stdin, JSON and bad input."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

from oomkit.interfaces.cli import main

sys.path.insert(0, str(Path(__file__).parents[2] / "diagnose"))
from cases.oom_cases import (  # noqa: E402
    fraction_limit,
    fragmentation,
    fragmented_oom_message,
    leak,
)
from cases.prediction import PREDICTION  # noqa: E402

MiB = 2**20
GiB = 2**30


def _fragmented_message() -> str:
    return f"Traceback (most recent call last):\n  ...\ntorch.OutOfMemoryError: {fragmented_oom_message()}\n"


def test_json_from_an_argument(capsys):
    """--json prints cause, causes with evidence and ranked remedies with savings and code."""
    assert main(["explain", _fragmented_message(), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cause"] == "fragmentation"
    assert out["causes"][0]["evidence"]["requested_bytes"] == 2 * GiB
    assert out["remedies"][0]["title"] == "expandable segments"
    assert out["remedies"][0]["saving_bytes"] > 2 * GiB
    assert "expandable_segments:True" in out["remedies"][0]["code"]
    assert out["message"]["variant"] == "native"
    assert abs(out["message"]["allocated_bytes"] - 4200 * MiB) <= GiB // 200  # "4.10 GiB"


def test_terminal_report_from_a_file_verdict_first(tmp_path, capsys):
    """A log file gives a report whose first line is the verdict."""
    log = tmp_path / "job.log"
    log.write_text("epoch 3\n" + _fragmented_message())
    assert main(["explain", str(log)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("Cause: fragmentation of PyTorch's cache")
    assert any("expandable segments" in line for line in lines)


def test_stdin(monkeypatch, capsys):
    """No argument (or '-') reads the error from stdin."""
    monkeypatch.setattr("sys.stdin", io.StringIO(_fragmented_message()))
    assert main(["explain", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cause"] == "fragmentation"


def test_garbage_is_exit_2_with_a_message(capsys):
    """Text without an OOM message: exit 2 and one line saying what to paste."""
    assert main(["explain", "Segmentation fault (core dumped)"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA out-of-memory message found" in err
    assert "Traceback" not in err


def test_a_truncated_snapshot_is_exit_2(tmp_path, capsys):
    """A broken pickle is read as a snapshot (not as text): exit 2 saying how to make one."""
    snap = tmp_path / "snap.pickle"
    snap.write_bytes(b"\x80\x04\x95garbage")
    assert main(["explain", str(snap)]) == 2
    err = capsys.readouterr().err
    assert "cannot be read as a memory snapshot" in err
    assert "_dump_snapshot" in err
    assert "Traceback" not in err


def test_snapshot_json_has_cause_causes_remedies(tmp_path, capsys):
    """A snapshot taken at the OOM: --json gives cause, evidence in bytes, priced remedies."""
    path = fragmentation(tmp_path / "frag.pickle")
    assert main(["explain", str(path), "--gpu", "8GiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["source"] == "snapshot"
    assert out["cause"] == "fragmentation"
    assert out["causes"][0]["evidence"]["largest_free_block_bytes"] == 424 * MiB
    assert out["remedies"][0]["title"] == "expandable segments"
    assert out["remedies"][0]["saving_bytes"] == 2134900736
    assert out["remedies"][0]["estimate"] is False
    assert out["figures"]["requested_bytes"] == 2 * GiB
    assert out["attribution"]["moment"] == "oom"
    assert out["attribution"]["top_sites"][0]["label"] == "/home/user/train.py:8 in step"
    assert "message" not in out


def test_snapshot_terminal_report(tmp_path, capsys):
    """The snapshot report starts with the verdict and lists the allocation sites."""
    path = leak(tmp_path / "leak.pickle")
    assert main(["explain", str(path), "--gpu", "8GiB"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("Cause: a leak")
    assert "Top allocation sites at the OOM" in out
    assert "stop the leak at /home/user/train.py:12 in step" in out


def test_snapshot_memory_fraction_flag(tmp_path, capsys):
    """--memory-fraction supplies the limit a snapshot does not record."""
    path = fraction_limit(tmp_path / "frac.pickle")
    assert main(["explain", str(path), "--gpu", "8GiB", "--memory-fraction", "0.5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cause"] == "fraction_limit"
    assert out["causes"][0]["evidence"]["allowed_bytes"] == 4 * GiB


def test_bad_memory_fraction_and_device(tmp_path, capsys):
    """An out-of-range fraction or a device the snapshot lacks: exit 2 with the fix."""
    path = fraction_limit(tmp_path / "frac.pickle")
    assert main(["explain", str(path), "--memory-fraction", "1.5"]) == 2
    assert "--memory-fraction must be in (0, 1]" in capsys.readouterr().err
    assert main(["explain", str(path), "--device", "2"]) == 2
    assert "no device 2" in capsys.readouterr().err


def test_saved_prediction(tmp_path, capsys):
    """A saved prediction's JSON is explained: shortage of the whole step, batch remedy first."""
    path = tmp_path / "p.json"
    path.write_text(json.dumps(PREDICTION))
    assert main(["explain", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["source"] == "prediction"
    assert out["cause"] == "shortage"
    assert out["causes"][0]["evidence"]["shortfall_bytes"] == 12238979072 - 3875536896
    assert out["remedies"][0]["title"] == "batch size 1 with 8 gradient-accumulation steps"


def test_prediction_that_fits_is_exit_2(tmp_path, capsys):
    """A prediction that fits: exit 2 saying there is nothing to explain."""
    path = tmp_path / "p.json"
    path.write_text(json.dumps(PREDICTION | {"oom": None, "headroom_bytes": GiB}))
    assert main(["explain", str(path)]) == 2
    assert "there is no OOM to explain" in capsys.readouterr().err


def test_unknown_gpu_is_exit_2(capsys):
    """--gpu with an unknown name: exit 2 with close matches."""
    assert main(["explain", _fragmented_message(), "--gpu", "h1000"]) == 2
    assert "h1000" in capsys.readouterr().err


class _Terminal(io.StringIO):
    """A stream that says it is a terminal (a fake tty for the prompt and the progress bar)."""

    def isatty(self) -> bool:
        return True


def test_missing_file_or_directory_is_no_such_file(tmp_path, capsys):
    """Issue 16 item 11: a path-like argument that does not exist, or a directory: exit 2."""
    assert main(["explain", str(tmp_path / "nosuchfile.log")]) == 2
    err = capsys.readouterr().err
    assert "nosuchfile.log: no such file" in err
    assert "no CUDA out-of-memory message" not in err
    assert main(["explain", "nosuchfile.log"]) == 2
    assert "nosuchfile.log: no such file" in capsys.readouterr().err
    # A directory is a job's per-rank snapshots (fleet analysis): one without any is exit 2.
    assert main(["explain", str(tmp_path)]) == 2
    assert "no .pickle file names a rank" in capsys.readouterr().err
    # Text with spaces is still error text.
    assert main(["explain", "Segmentation fault"]) == 2
    assert "no CUDA out-of-memory message found" in capsys.readouterr().err


def test_stdin_on_a_terminal_says_what_it_waits_for(monkeypatch, capsys):
    """Issue 16 item 13: on a terminal, stdin's prompt goes to stderr; piped stdin gets none."""
    monkeypatch.setattr("sys.stdin", _Terminal(_fragmented_message()))
    assert main(["explain", "--json"]) == 0
    captured = capsys.readouterr()
    assert "paste the CUDA out-of-memory error" in captured.err
    assert "Ctrl-D" in captured.err
    assert json.loads(captured.out)["cause"] == "fragmentation"
    monkeypatch.setattr("sys.stdin", io.StringIO(_fragmented_message()))
    assert main(["explain", "--json"]) == 0
    assert capsys.readouterr().err == ""


def test_measuring_a_prediction_shows_progress_only_on_a_terminal(tmp_path, monkeypatch, capsys):
    """Issue 16 item 13: explain p.json draws a progress bar on a terminal's stderr, nothing
    otherwise; a batch BatchNorm refuses (1 per channel) leaves the batch remedy out."""
    import pytest

    pytest.importorskip("torch")
    argv = ["predict", "resnet50", "--gpu", "600MiB", "--steps", "1", "--batch", "2",
            "--image-size", "32", "--json", "--no-remedies"]
    assert main(argv) == 1
    path = tmp_path / "p.json"
    path.write_text(capsys.readouterr().out)
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    assert main(["explain", str(path)]) == 0
    assert "measuring remedies by re-predicting" in terminal.getvalue()
    out = capsys.readouterr().out
    assert out.startswith("Cause: a real shortage of memory")
    assert "gradient-accumulation" not in out  # batch 1 cannot train with BatchNorm
    monkeypatch.setattr("sys.stderr", io.StringIO())
    assert main(["explain", str(path)]) == 0
    assert "measuring" not in sys.stderr.getvalue()

"""`oomkit explain` on error text: argument, file, stdin, JSON and bad input."""

from __future__ import annotations

import io
import json

import pytest

from oomkit.allocator import CachingAllocator, SimulatedOutOfMemoryError
from oomkit.cli import main

MiB = 2**20
GiB = 2**30


def _fragmented_message() -> str:
    a = CachingAllocator(capacity_bytes=8 * GiB, reserved_outside_bytes=400 * MiB)
    blocks = [a.malloc(GiB) for _ in range(7)]
    for block in blocks:
        a.free(block)
    for _ in blocks:
        a.malloc(600 * MiB)
    with pytest.raises(SimulatedOutOfMemoryError) as info:
        a.malloc(2 * GiB)
    return f"Traceback (most recent call last):\n  ...\ntorch.OutOfMemoryError: {info.value}\n"


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


def test_a_pickle_is_refused_with_a_pointer_to_replay(tmp_path, capsys):
    """A snapshot file is not read as text (and not unpickled): exit 2 naming `oomkit replay`."""
    snap = tmp_path / "snap.pickle"
    snap.write_bytes(b"\x80\x04\x95garbage")
    assert main(["explain", str(snap)]) == 2
    assert "oomkit replay" in capsys.readouterr().err


def test_unknown_gpu_is_exit_2(capsys):
    """--gpu with an unknown name: exit 2 with close matches."""
    assert main(["explain", _fragmented_message(), "--gpu", "h1000"]) == 2
    assert "h1000" in capsys.readouterr().err

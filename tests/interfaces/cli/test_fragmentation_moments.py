"""One fragmentation figure, and every other figure naming its moment, across `diff`,
`replay --what-if` and `explain` (issue 35 item 7), on a real training snapshot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from oomkit.interfaces.cli import main

SHARED = Path(__file__).resolve().parents[3] / ".." / "shared" / "snapshots"
TRAINING = (
    SHARED
    / "Wedsonlin__assignment2-systems"
    / "8630bcfe2d__results_medium_128_training_memory_snapshot.pickle"
)
pytestmark = pytest.mark.skipif(not TRAINING.is_file(), reason="../shared/snapshots is absent")

# Reserved minus allocated at the first moment reserved memory is at its peak (trace event 0:
# 7,235,174,400 reserved, 5,099,384,832 allocated).
FRAGMENTATION_BYTES = 2_135_789_568


def test_diff_and_explain_report_the_same_fragmentation(capsys, monkeypatch):
    """diff's fragmentation and explain's are one figure, byte for byte: 1.99 GiB."""
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["diff", str(TRAINING), str(TRAINING), "--json"]) == 0
    diff = json.loads(capsys.readouterr().out)
    assert diff["b"]["placement_bytes"] == FRAGMENTATION_BYTES
    assert diff["b"]["peak_reserved_bytes"] == 7_235_174_400
    assert main(["explain", str(TRAINING), "--json"]) == 0
    explained = json.loads(capsys.readouterr().out)
    assert explained["figures"]["fragmentation_at_peak_reserved_bytes"] == FRAGMENTATION_BYTES
    assert main(["diff", str(TRAINING), str(TRAINING)]) == 0
    out = capsys.readouterr().out
    assert "fragmentation: reserved - allocated at peak reserved │ 1.99 GiB" in out


def test_explain_names_the_moment_of_each_figure(capsys, monkeypatch):
    """203.59 MiB at the peak of allocated memory, 1.99 GiB at peak reserved, 328 MiB at the end."""
    monkeypatch.setenv("COLUMNS", "400")
    assert main(["explain", str(TRAINING)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "used at the peak of allocated memory. Reserved (6.74 GiB, torch.cuda.memory_reserved) "
        "is what PyTorch's caching allocator held then: the allocated memory plus 203.59 MiB "
        "cached for reuse. At the peak of reserved memory (6.74 GiB, trace event 0) 4.75 GiB "
        "was allocated: 1.99 GiB reserved but unallocated, the fragmentation `oomkit diff` "
        "reports."
    ) in out
    assert "At the end of the snapshot 328.00 MiB sits in cached segments" in out


def test_replay_what_if_does_not_call_its_peak_difference_fragmentation(capsys, monkeypatch):
    """--what-if reports peak reserved - peak allocated (198.91 MiB) under that name."""
    monkeypatch.setenv("COLUMNS", "200")
    argv = ["replay", str(TRAINING), "--what-if", "", "--jobs", "1"]
    assert main([*argv, "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["settings"]
    assert row["peak_reserved_bytes"] - row["peak_allocated_bytes"] == 208_567_808
    assert row["peak_reserved_minus_peak_allocated_bytes"] == 208_567_808
    assert "fragmentation_bytes" not in row
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "peak reserved − peak allocated" in out
    assert "198.91 MiB (2.9%)" in out
    assert "fragmentation" not in out.split("warning:")[0]

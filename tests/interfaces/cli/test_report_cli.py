"""`oomkit report LOG...`: exit codes, --json, --html, --png (and its missing-matplotlib exit 3)."""

from __future__ import annotations

import json
import sys

import pytest

from oomkit.interfaces.cli import main
from oomkit.runtime.monitor import Monitor

MiB = 2**20


class _Device:
    """A DeviceMemory reporting 8 MiB allocated, 20 MiB reserved and a given OOM count."""

    name = "fake"

    def __init__(self, ooms: int = 0) -> None:
        self.ooms = ooms

    def memory_stats(self):
        return {
            "allocated_bytes.all.current": 8 * MiB,
            "allocated_bytes.all.peak": 12 * MiB,
            "reserved_bytes.all.current": 20 * MiB,
            "reserved_bytes.all.peak": 20 * MiB,
            "num_ooms": self.ooms,
        }

    def reset_peak_memory_stats(self):
        pass

    def mem_get_info(self):
        return 0, 32 * MiB


def _log(path, ooms=0, steps=3):
    with Monitor(log_path=path, device=_Device(ooms)) as monitor:
        for _ in range(steps):
            monitor.step()
    return str(path)


def test_report_prints_summary_and_exits_0(tmp_path, capsys):
    """A clean log: exit 0, the verdict names the peak reserved and the capacity."""
    assert main(["report", _log(tmp_path / "m.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "3 recorded steps on fake" in out
    assert "peak reserved 20.00 MiB of 32.00 MiB; no OOMs" in out


def test_report_exits_1_when_a_log_recorded_an_oom(tmp_path, capsys):
    """num_ooms > 0 in any log: exit 1 and the verdict counts it."""
    assert main(["report", _log(tmp_path / "m.jsonl", ooms=2)]) == 1
    assert "2 OOMs" in capsys.readouterr().out


def test_report_json(tmp_path, capsys):
    """--json prints one object with per-rank summaries and the worst rank."""
    assert main(["report", _log(tmp_path / "m.jsonl"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["worst_rank"] is None
    assert data["ranks"][0]["peak_allocated_bytes"] == 12 * MiB
    assert data["ranks"][0]["steps"] == 3


def test_report_missing_log_is_usage_error(tmp_path, capsys):
    """A missing log: exit 2 with the path in the message."""
    assert main(["report", str(tmp_path / "nope.jsonl")]) == 2
    assert "nope.jsonl: no such file" in capsys.readouterr().err


def test_report_not_a_log_is_usage_error(tmp_path, capsys):
    """A file that is not a monitor log: exit 2."""
    (tmp_path / "x.jsonl").write_text("hello\n")
    assert main(["report", str(tmp_path / "x.jsonl")]) == 2
    assert "not an oomkit monitor log" in capsys.readouterr().err


def test_report_html(tmp_path, capsys):
    """--html writes a self-contained page with the timeline chart."""
    out = tmp_path / "r.html"
    assert main(["report", _log(tmp_path / "m.jsonl"), "--html", str(out)]) == 0
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and 'data-name="reserved"' in page


def test_report_png_without_matplotlib_exits_3(tmp_path, capsys, monkeypatch):
    """--png when matplotlib cannot be imported: exit 3 and an install hint, no file."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "r.png"
    assert main(["report", _log(tmp_path / "m.jsonl"), "--png", str(out)]) == 3
    assert "pip install matplotlib" in capsys.readouterr().err
    assert not out.exists()


def test_report_png(tmp_path):
    """--png with matplotlib writes a PNG file."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "r.png"
    assert main(["report", _log(tmp_path / "m.jsonl"), "--png", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

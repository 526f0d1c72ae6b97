"""`oomkit report DIR`: other *.jsonl files in the directory are skipped with a note naming them."""

from __future__ import annotations

import json

from oomkit.interfaces.cli import main
from oomkit.runtime.monitor import Monitor

MiB = 2**20


class _Device:
    """8 MiB allocated, 20 MiB reserved, 32 MiB device."""

    name = "fake"

    def memory_stats(self):
        return {
            "allocated_bytes.all.current": 8 * MiB,
            "allocated_bytes.all.peak": 12 * MiB,
            "reserved_bytes.all.current": 20 * MiB,
            "reserved_bytes.all.peak": 20 * MiB,
            "num_ooms": 0,
        }

    def reset_peak_memory_stats(self):
        pass

    def mem_get_info(self):
        return 0, 32 * MiB


def _log(path, steps=3):
    with Monitor(log_path=path, device=_Device()) as monitor:
        for _ in range(steps):
            monitor.step()
    return path


def test_unrelated_jsonl_is_skipped_with_a_note(tmp_path, capsys, monkeypatch):
    """metrics.jsonl (another tool's) beside memory_0.jsonl: exit 0, a note names it, 3 steps read."""
    monkeypatch.setenv("COLUMNS", "200")
    _log(tmp_path / "memory_0.jsonl")
    (tmp_path / "metrics.jsonl").write_text('{"loss": 1.5, "step": 1}\n{"loss": 1.2}\n')
    (tmp_path / "empty.jsonl").write_text("")
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "3 recorded steps on fake" in out
    assert f"{tmp_path / 'metrics.jsonl'}: skipped, not an oomkit monitor log" in out
    assert f"{tmp_path / 'empty.jsonl'}: skipped, not an oomkit monitor log" in out


def test_unrelated_jsonl_json_report(tmp_path, capsys):
    """--json: one rank read, the skipped file listed among the warnings."""
    _log(tmp_path / "memory_0.jsonl")
    (tmp_path / "events.jsonl").write_bytes(b"\xff\xfe not json at all\n")
    assert main(["report", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["ranks"]) == 1 and out["ranks"][0]["steps"] == 3
    assert any("events.jsonl: skipped, not an oomkit monitor log" in w for w in out["warnings"])


def test_directory_without_a_monitor_log_is_exit_2(tmp_path, capsys):
    """Only unrelated *.jsonl: exit 2, naming them and saying how to write a monitor log."""
    (tmp_path / "metrics.jsonl").write_text('{"loss": 1.5}\n')
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no oomkit monitor log found" in err and "metrics.jsonl is not" in err
    assert "oomkit.Monitor(log_path=...)" in err


def test_a_named_unrelated_file_is_still_an_error(tmp_path, capsys):
    """A file named on the command line must be a monitor log: exit 2."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"loss": 1.5}\n')
    assert main(["report", str(path)]) == 2
    assert "not an oomkit monitor log" in capsys.readouterr().err


def test_header_with_a_non_numeric_version_is_exit_2(tmp_path, capsys):
    """A header whose format version is a string: exit 2 with a message, not a TypeError."""
    path = tmp_path / "m.jsonl"
    path.write_text('{"oomkit_monitor": "one"}\n')
    assert main(["report", str(path)]) == 2
    assert "not a format version" in capsys.readouterr().err

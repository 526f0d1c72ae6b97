"""A monitor log cut mid-line (its writer killed with SIGKILL) still reports; damage is exit 2."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from oomkit.errors import MonitorLogError
from oomkit.interfaces.cli import main
from oomkit.runtime.monitor import Monitor, load_monitor_log

sys.path.insert(0, str(Path(__file__).parent))
from _hostile_support import MiB, assert_within_bounds, run_bounded  # noqa: E402

SRC = str(Path(__file__).resolve().parents[2] / "src")

# A device with fixed counters: the monitor needs no GPU (and no torch) to write its log.
DEVICE = textwrap.dedent(
    """
    class Device:
        name = "fake"

        def memory_stats(self):
            return {
                "allocated_bytes.all.current": 8 * 2**20,
                "allocated_bytes.all.peak": 12 * 2**20,
                "reserved_bytes.all.current": 20 * 2**20,
                "reserved_bytes.all.peak": 20 * 2**20,
                "num_ooms": 0,
            }

        def reset_peak_memory_stats(self):
            pass

        def mem_get_info(self):
            return 0, 32 * 2**20
    """
)


def _write_log(path: Path, steps: int) -> None:
    namespace: dict = {}
    exec(DEVICE, namespace)  # the same fake device the child below uses
    with Monitor(log_path=path, device=namespace["Device"]()) as monitor:
        for _ in range(steps):
            monitor.step()


def test_log_cut_at_every_byte_of_its_last_line(tmp_path, capsys):
    """Cut anywhere inside the last record: the earlier 4 steps are reported, with a warning."""
    whole = tmp_path / "whole.jsonl"
    _write_log(whole, 5)
    data = whole.read_bytes()
    last_start = data.rstrip(b"\n").rfind(b"\n") + 1
    cut = tmp_path / "memory_0.jsonl"
    positions = range(last_start + 1, len(data) - 1)
    assert len(positions) > 100

    def read_every_cut() -> list[tuple[int, bool]]:
        seen = []
        for end in positions:
            cut.write_bytes(data[:end])
            log = load_monitor_log(cut)
            seen.append((len(log.records), log.truncated))
        return seen

    api = run_bounded(read_every_cut)
    assert_within_bounds(api)
    assert api.value == [(4, True)] * len(positions)
    for end in (positions[0], positions[len(positions) // 2], positions[-1]):
        cut.write_bytes(data[:end])
        result = run_bounded(lambda: main(["report", str(cut), "--json"]))
        assert_within_bounds(result)
        assert result.value == 0, (end, result.error)
        report = json.loads(capsys.readouterr().out)
        assert report["ranks"][0]["steps"] == 4
        assert any("the last line was cut off" in w for w in report["warnings"])


def test_log_cut_inside_its_header_is_exit_2(tmp_path, capsys):
    """Cut inside the header line: not a monitor log any more; exit 2 saying what to do."""
    whole = tmp_path / "whole.jsonl"
    _write_log(whole, 2)
    cut = tmp_path / "m.jsonl"
    cut.write_bytes(whole.read_bytes()[:20])
    assert main(["report", str(cut)]) == 2
    assert "not an oomkit monitor log" in capsys.readouterr().err
    with pytest.raises(MonitorLogError, match="oomkit.Monitor"):
        load_monitor_log(cut)


def test_damage_before_the_last_line_is_exit_2(tmp_path, capsys):
    """A damaged line in the middle is not a kill: exit 2 naming the line."""
    path = tmp_path / "m.jsonl"
    _write_log(path, 4)
    lines = path.read_text().splitlines()
    lines[2] = lines[2][:15]
    path.write_text("\n".join(lines) + "\n")
    assert main(["report", str(path)]) == 2
    assert f"{path}:3: damaged line" in capsys.readouterr().err


def test_writer_killed_with_sigkill_mid_run(tmp_path, capsys):
    """A real writer process killed with SIGKILL while stepping: its log reports what it wrote."""
    log = tmp_path / "memory_0.jsonl"
    child = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {SRC!r})
        from oomkit.runtime.monitor import Monitor
        {textwrap.indent(DEVICE, "        ").strip()}
        with Monitor(log_path={str(log)!r}, device=Device()) as monitor:
            while True:
                monitor.step()
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", child])
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if log.exists() and log.stat().st_size > 64 * 1024:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the writer never wrote 64 KiB")
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    result = run_bounded(lambda: main(["report", str(log), "--json"]))
    assert_within_bounds(result, memory_bytes=64 * MiB)
    assert result.value == 0, result.error
    report = json.loads(capsys.readouterr().out)
    complete = log.read_bytes().count(b"\n") - 1  # whole record lines after the header
    assert report["ranks"][0]["steps"] == complete > 100
    assert report["ranks"][0]["peak_reserved_bytes"] == 20 * MiB

"""Monitor-log reports: per-rank summary, worst rank, JSON, HTML timeline (also in Chromium)."""

from __future__ import annotations

import io
import json
import subprocess

import pytest
from rich.console import Console

from oomkit.errors import MonitorLogError
from oomkit.interfaces.reports.monitor import (
    build_monitor_report,
    monitor_html,
    monitor_report_to_json,
    render_monitor_report,
    write_monitor_html,
)
from oomkit.runtime.monitor import Monitor

MiB = 2**20


class ScriptedDevice:
    """A DeviceMemory whose memory_stats walk through given (allocated, reserved, split) levels."""

    def __init__(self, levels, *, retries=0, ooms=0, capacity=64 * MiB):
        self.name = "scripted"
        self._levels = list(levels)
        self._i = 0
        self.retries = retries
        self.ooms = ooms
        self.capacity = capacity

    def memory_stats(self):
        allocated, reserved, split = self._levels[self._i]
        self._i += 1
        return {
            "allocated_bytes.all.current": allocated,
            "allocated_bytes.all.peak": allocated + MiB,
            "reserved_bytes.all.current": reserved,
            "reserved_bytes.all.peak": reserved,
            "active_bytes.all.current": allocated,
            "inactive_split_bytes.all.current": split,
            "num_alloc_retries": self.retries * self._i,
            "num_ooms": self.ooms if self._i == len(self._levels) else 0,
            "num_device_alloc": self._i,
            "num_device_free": 0,
        }

    def reset_peak_memory_stats(self):
        pass

    def mem_get_info(self):
        return 0, self.capacity


def write_log(path, levels, **kwargs):
    """A monitor log of len(levels) steps on a ScriptedDevice; returns its path."""
    ticks = iter(range(1000))
    with Monitor(
        log_path=path, device=ScriptedDevice(levels, **kwargs), get_time=lambda: next(ticks) / 10
    ) as monitor:
        for _ in levels:
            monitor.step()
    return monitor.log_path


def _rank_log(path, rank, levels, **kwargs):
    """write_log, then stamp the header and records with a rank (as torch.distributed would)."""
    write_log(path, levels, **kwargs)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    for line in lines:
        line["rank"] = rank
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_single_log_summary(tmp_path):
    """One log: peaks are the max over steps, counters the last record's, step time the mean."""
    path = write_log(
        tmp_path / "m.jsonl",
        [(4 * MiB, 20 * MiB, 2 * MiB), (6 * MiB, 22 * MiB, 5 * MiB), (5 * MiB, 22 * MiB, MiB)],
        retries=1,
    )
    report = build_monitor_report([path])
    (summary,) = report.summaries
    assert summary.steps == 3 and summary.last_step == 3
    assert summary.peak_allocated_bytes == 7 * MiB
    assert summary.peak_reserved_bytes == 22 * MiB
    assert summary.max_inactive_split_bytes == 5 * MiB
    assert (summary.num_alloc_retries, summary.num_ooms) == (3, 0)
    assert summary.mean_step_time_s == pytest.approx(0.1)
    assert summary.capacity_bytes == 64 * MiB
    assert report.worst is summary


def test_terminal_summary_golden(tmp_path):
    """The terminal report at width 100 without colour."""
    path = write_log(tmp_path / "m.jsonl", [(4 * MiB, 20 * MiB, 2 * MiB), (6 * MiB, 22 * MiB, 5 * MiB)])
    out = io.StringIO()
    render_monitor_report(build_monitor_report([path]), Console(file=out, width=100, color_system=None))
    assert out.getvalue().splitlines() == [
        "oomkit report: 1 rank, 2 recorded steps on scripted",
        " rank ┃ steps ┃ peak allocated ┃ peak reserved ┃ max inactive split ┃ retries ┃ OOMs ┃ step time ",
        "━━━━━━╇━━━━━━━╇━━━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━╇━━━━━━╇━━━━━━━━━━━",
        " -    │     2 │       7.00 MiB │     22.00 MiB │     5.00 MiB (23%) │       0 │    0 │  100.0 ms ",
        "peak reserved 22.00 MiB of 64.00 MiB; no OOMs, no allocation retries",
    ]


def test_several_ranks_every_rank_and_the_worst(tmp_path):
    """A directory of rank logs: a row per rank in rank order; rank 1 peaks highest and OOMed."""
    logs = tmp_path / "logs"
    logs.mkdir()
    _rank_log(logs / "r0.jsonl", 0, [(4 * MiB, 20 * MiB, 0), (4 * MiB, 20 * MiB, 0)])
    _rank_log(logs / "r2.jsonl", 2, [(4 * MiB, 24 * MiB, 0)])
    _rank_log(logs / "r1.jsonl", 1, [(4 * MiB, 30 * MiB, 0), (9 * MiB, 30 * MiB, 0)], ooms=1)
    report = build_monitor_report([logs])
    assert [s.rank for s in report.summaries] == [0, 1, 2]
    assert report.worst.rank == 1
    data = monitor_report_to_json(report)
    assert data["worst_rank"] == 1
    assert [r["peak_reserved_bytes"] for r in data["ranks"]] == [20 * MiB, 30 * MiB, 24 * MiB]
    assert data["verdict"] == "worst rank 1: peak reserved 30.00 MiB of 64.00 MiB; 1 OOM"
    out = io.StringIO()
    render_monitor_report(report, Console(file=out, width=120, color_system=None))
    assert " 1 (worst) " in out.getvalue()


def test_gathered_summaries_stand_for_missing_rank_logs(tmp_path):
    """Rank 0's log with a gathered line shows rank 1 too, with a warning that it has no timeline."""
    path = _rank_log(tmp_path / "r0.jsonl", 0, [(4 * MiB, 20 * MiB, 0)])
    summary = build_monitor_report([path]).summaries[0].to_json()
    other = {**summary, "rank": 1, "peak_reserved_bytes": 40 * MiB}
    with path.open("a") as f:
        f.write(json.dumps({"oomkit_ranks": [summary, other]}) + "\n")
    report = build_monitor_report([path])
    assert [(s.rank, s.peak_reserved_bytes) for s in report.summaries] == [
        (0, 20 * MiB),
        (1, 40 * MiB),
    ]
    assert report.worst.rank == 1
    assert len(report.warnings) == 1 and "rank 1: from the summary gathered" in report.warnings[0]


def test_missing_path_and_empty_directory(tmp_path):
    """A missing path or a directory without *.jsonl raises MonitorLogError."""
    with pytest.raises(MonitorLogError, match="no such file"):
        build_monitor_report([tmp_path / "nope.jsonl"])
    with pytest.raises(MonitorLogError, match="no \\*.jsonl"):
        build_monitor_report([tmp_path])


def test_html_page_has_verdict_table_and_timeline(tmp_path, parse_html):
    """The page: verdict, ranks table, one chart with allocated/reserved/inactive split lines."""
    path = write_log(tmp_path / "m.jsonl", [(4 * MiB, 20 * MiB, 2 * MiB), (6 * MiB, 22 * MiB, 5 * MiB)])
    page = monitor_html(build_monitor_report([path]))
    dom = parse_html(page)
    assert [a["id"] for a in dom.of("section")] == ["verdict", "ranks", "timeline"]
    assert [p["data-name"] for p in dom.of("path")] == [
        "allocated",
        "reserved",
        "inactive split",
        "peak allocated",
    ]
    assert len(dom.of("script")) == 0 and len(dom.of("link")) == 0
    assert "http" not in page.replace("http-equiv", "")
    assert "peak reserved 22.00 MiB of 64.00 MiB" in "".join(dom.text)


def test_html_page_loads_in_chromium(chromium, tmp_path, parse_html):
    """Headless Chromium loads the page; its DOM holds a chart per rank log."""
    logs = tmp_path / "logs"
    logs.mkdir()
    _rank_log(logs / "r0.jsonl", 0, [(4 * MiB, 20 * MiB, 0), (5 * MiB, 20 * MiB, 0)])
    _rank_log(logs / "r1.jsonl", 1, [(4 * MiB, 30 * MiB, 0), (9 * MiB, 30 * MiB, 0)])
    page = write_monitor_html(tmp_path / "report.html", build_monitor_report([logs]))
    done = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", page.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    dom = parse_html(done.stdout)
    assert len(dom.of("svg")) == 2
    assert "worst rank 1" in "".join(dom.text)


def _record(step, *, retries=0, ooms=0, step_time=0.125, rank=None, used=None):
    from oomkit.runtime.monitor import StepRecord

    return StepRecord(
        step=step,
        time_s=float(step),
        step_time_s=step_time,
        allocated_bytes=6 * MiB,
        reserved_bytes=22 * MiB,
        active_bytes=6 * MiB,
        inactive_split_bytes=14 * MiB,
        peak_allocated_bytes=14 * MiB,
        peak_reserved_bytes=22 * MiB,
        num_alloc_retries=retries,
        num_ooms=ooms,
        num_device_alloc=2,
        num_device_free=0,
        device_used_bytes=used,
        rank=rank,
    )


def test_live_line_format():
    """The live line names step, allocated (peak), reserved, split, counters and step time."""
    from oomkit.interfaces.reports.monitor_live import format_live_line

    assert format_live_line(_record(3)) == (
        "oomkit step 3 | alloc 6.00 MiB (peak 14.00 MiB) | reserved 22.00 MiB | split 14.00 MiB"
        " | retries 0 | OOMs 0 | 125.0 ms/step"
    )
    assert format_live_line(_record(0, step_time=None, rank=1, used=30 * MiB)) == (
        "oomkit [rank 1] step 0 | alloc 6.00 MiB (peak 14.00 MiB) | reserved 22.00 MiB | "
        "split 14.00 MiB | gpu used 30.00 MiB | retries 0 | OOMs 0"
    )


def test_live_sink_prints_at_most_once_per_interval_but_always_on_trouble():
    """1 s interval, 0.4 s steps: 0 and 3 print, 4 too (retries rose); 5 and 6 come too soon."""
    from oomkit.interfaces.reports.monitor_live import live_line_sink

    out = io.StringIO()
    times = iter([0.0, 0.4, 0.8, 1.2, 1.6, 2.0, 2.4])
    sink = live_line_sink(
        Console(file=out, width=200, color_system=None), get_time=lambda: next(times)
    )
    for step in range(7):
        sink(_record(step, retries=1 if step >= 4 else 0))
    printed = [line.split(" | ")[0] for line in out.getvalue().splitlines()]
    assert printed == ["oomkit step 0", "oomkit step 3", "oomkit step 4"]


def test_live_monitor_facade_wires_the_live_line(tmp_path):
    """oomkit.live_monitor(...) returns a Monitor whose records reach the console."""
    import oomkit

    out = io.StringIO()
    device = ScriptedDevice([(4 * MiB, 20 * MiB, 0), (5 * MiB, 20 * MiB, 0)])
    with oomkit.live_monitor(
        device=device, console=Console(file=out, width=200, color_system=None), min_interval_s=0
    ) as mon:
        mon.step()
        mon.step()
    assert isinstance(mon, oomkit.Monitor)
    assert len(out.getvalue().splitlines()) == 2
    assert oomkit.live_monitor(device=device, live=False).sink is None


def test_live_monitor_and_monitor_differ_by_more_than_case():
    """The facade is oomkit.live_monitor; oomkit.monitor is gone; oomkit.Monitor is the class."""
    import oomkit

    assert "live_monitor" in oomkit.__all__ and "Monitor" in oomkit.__all__
    assert "monitor" not in oomkit.__all__
    assert not hasattr(oomkit, "monitor")
    assert isinstance(oomkit.Monitor, type)


def test_report_names_a_leak_from_the_log(tmp_path, parse_html):
    """Allocated grows 2 MiB every step for 12 steps: a leak finding in JSON, terminal and HTML."""
    levels = [((4 + 2 * i) * MiB, 40 * MiB, 0) for i in range(12)]
    report = build_monitor_report([write_log(tmp_path / "m.jsonl", levels)])
    data = monitor_report_to_json(report)
    assert [f["kind"] for f in data["findings"]] == ["leak"]
    assert data["findings"][0]["summary"].startswith(
        "allocated memory grows by 2.00 MiB per step"
    )
    out = io.StringIO()
    render_monitor_report(report, Console(file=out, width=200, color_system=None))
    assert "leak: allocated memory grows by 2.00 MiB per step" in out.getvalue()
    dom = parse_html(monitor_html(report))
    assert [a["id"] for a in dom.of("section")] == ["verdict", "ranks", "findings", "timeline"]

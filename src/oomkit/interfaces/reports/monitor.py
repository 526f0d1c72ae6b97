"""Reports of monitor logs (``oomkit report``): terminal summary, JSON, HTML timeline, PNG.

A report covers one log or several (one per rank, or a directory of them). Each rank gets a
row; the worst rank (highest peak reserved, then most OOMs) is named. A rank-0 log that holds
the summaries gathered over ``torch.distributed`` (``Monitor.gather``) stands for the ranks
whose own logs were not given.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from oomkit.diagnose.memory_health import LeakFinding, memory_findings
from oomkit.errors import MonitorLogError, OomkitError
from oomkit.interfaces.reports._untrusted import as_plot_text, as_written
from oomkit.runtime._monitor_log import (
    MonitorLog,
    MonitorSummary,
    is_monitor_log,
    load_monitor_log,
)
from oomkit.units import format_bytes

if TYPE_CHECKING:
    # rich when the terminal report is rendered, the HTML page's builders with --html only;
    # the monitor log's records without the Monitor and the rest of runtime (issue 41 item 4:
    # start-up).
    from rich.console import Console

    from oomkit.interfaces.reports.html import ChartSeries

__all__ = [
    "MonitorReport",
    "build_monitor_report",
    "find_monitor_logs",
    "monitor_html",
    "monitor_report_to_json",
    "render_monitor_report",
    "write_monitor_html",
    "write_monitor_png",
]


@dataclass(frozen=True)
class MonitorReport:
    """Logs read back and their per-rank summaries.

    Attributes:
        logs: the logs, in the order given (directories expanded in name order).
        summaries: one per rank (or per log when not distributed), ordered by rank.
        worst: the summary with the highest peak reserved (ties: more OOMs, then lower rank).
        warnings: lines to show (truncated logs, ranks only known from a gathered summary).
        findings: ``(rank, kind, summary)`` per leak / fragmentation finding of a log
            (``oomkit.diagnose.memory_health``); kind is ``"leak"`` or ``"fragmentation"``.
    """

    logs: tuple[MonitorLog, ...]
    summaries: tuple[MonitorSummary, ...]
    worst: MonitorSummary | None
    warnings: tuple[str, ...] = ()
    findings: tuple[tuple[int | None, str, str], ...] = ()


def find_monitor_logs(paths: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """Files to read: each path itself, or a directory's ``*.jsonl`` files in name order.

    Raises:
        MonitorLogError: a path does not exist or a directory holds no ``*.jsonl`` file.
    """
    return [path for path, _ in _find_logs(paths)]


def _find_logs(paths: Sequence[str | os.PathLike[str]]) -> list[tuple[Path, bool]]:
    """``(file, found in a directory)`` for each file to read (see find_monitor_logs)."""
    out: list[tuple[Path, bool]] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = sorted(p for p in path.glob("*.jsonl") if p.is_file())
            if not found:
                raise MonitorLogError(
                    f"{path}: no *.jsonl monitor logs in this directory; pass the log files"
                )
            out.extend((p, True) for p in found)
        elif path.is_file():
            out.append((path, False))
        else:
            from oomkit._files import not_a_file_reason

            raise MonitorLogError(
                f"{path}: {not_a_file_reason(path)}; pass monitor logs or their directory"
            )
    return out


def _load_logs(paths: Sequence[str | os.PathLike[str]]) -> tuple[list[MonitorLog], list[str]]:
    """The monitor logs at ``paths``; other ``*.jsonl`` files of a directory are skipped with
    a note. A file named on its own must be a monitor log.

    Raises:
        MonitorLogError: a named file is not a monitor log, or no monitor log was found.
    """
    logs: list[MonitorLog] = []
    notes: list[str] = []
    skipped: list[str] = []
    for path, in_directory in _find_logs(paths):
        if in_directory and not is_monitor_log(path):
            skipped.append(str(path))
            notes.append(f"{path}: skipped, not an oomkit monitor log")
            continue
        logs.append(load_monitor_log(path))
    if not logs:
        raise MonitorLogError(
            f"no oomkit monitor log found: {', '.join(skipped)} "
            f"{'is' if len(skipped) == 1 else 'are'} not monitor logs (the first line of one is "
            "a JSON object with 'oomkit_monitor'); write one with oomkit.Monitor(log_path=...)"
        )
    return logs, notes


def _rank_key(summary: MonitorSummary) -> int:
    return -1 if summary.rank is None else summary.rank


def build_monitor_report(paths: Sequence[str | os.PathLike[str]]) -> MonitorReport:
    """Read the logs at ``paths`` (files or directories) and summarise them per rank.

    Raises:
        MonitorLogError: a path is missing or not a monitor log.
    """
    loaded, warnings = _load_logs(paths)
    logs = tuple(loaded)
    own: dict[int | None, MonitorSummary] = {}
    order: list[MonitorSummary] = []
    for log in logs:
        summary = log.summary()
        if log.truncated:
            warnings.append(f"{log.path}: the last line was cut off (the run was killed?)")
        if summary.rank is not None and summary.rank in own:
            warnings.append(f"{log.path}: a second log of rank {summary.rank}; both are shown")
        own.setdefault(summary.rank, summary)
        order.append(summary)
    for log in logs:
        for gathered in log.rank_summaries:
            if gathered.rank not in own:
                own[gathered.rank] = gathered
                order.append(gathered)
                warnings.append(
                    f"rank {gathered.rank}: from the summary gathered into {log.path} (its own "
                    "log was not given, so it has no timeline)"
                )
    summaries = tuple(sorted(order, key=_rank_key))
    findings: list[tuple[int | None, str, str]] = []
    for log in logs:
        if not log.records:
            continue
        try:
            found = memory_findings(log.records, capacity_bytes=log.header.get("capacity_bytes"))
        except OomkitError as exc:
            warnings.append(f"{log.path}: no leak/fragmentation analysis ({exc})")
            continue
        for finding in found:
            kind = "leak" if isinstance(finding, LeakFinding) else "fragmentation"
            findings.append((log.header.get("rank"), kind, finding.summary))
    worst = None
    if summaries:
        worst = max(
            summaries, key=lambda s: (s.peak_reserved_bytes, s.num_ooms, -_rank_key(s))
        )
    return MonitorReport(logs, summaries, worst, tuple(warnings), tuple(findings))


def _rank_name(summary: MonitorSummary) -> str:
    return "-" if summary.rank is None else str(summary.rank)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms"


def _fragmentation_pct(summary: MonitorSummary) -> str:
    if not summary.peak_reserved_bytes:
        return "-"
    return f"{100 * summary.max_inactive_split_bytes / summary.peak_reserved_bytes:.0f}%"


def monitor_verdict(report: MonitorReport) -> str:
    """One line: the worst rank's peak and whether anything went wrong."""
    worst = report.worst
    if worst is None:
        return "no records"
    where = "" if len(report.summaries) == 1 else f"worst rank {_rank_name(worst)}: "
    capacity = (
        f" of {format_bytes(worst.capacity_bytes)}" if worst.capacity_bytes is not None else ""
    )
    trouble = []
    ooms = sum(s.num_ooms for s in report.summaries)
    retries = sum(s.num_alloc_retries for s in report.summaries)
    if ooms:
        trouble.append(f"{ooms} OOM{'s' if ooms != 1 else ''}")
    if retries:
        trouble.append(f"{retries} allocation retr{'ies' if retries != 1 else 'y'}")
    tail = "; " + ", ".join(trouble) if trouble else "; no OOMs, no allocation retries"
    return f"{where}peak reserved {format_bytes(worst.peak_reserved_bytes)}{capacity}{tail}"


def render_monitor_report(report: MonitorReport, console: Console) -> None:
    """The terminal summary: one row per rank, the worst one marked, then warnings."""
    steps = sum(s.steps for s in report.summaries)
    devices = sorted({s.device for s in report.summaries})
    console.print(
        f"[bold]oomkit report[/]: {len(report.summaries)} "
        f"{'rank' if len(report.summaries) == 1 else 'ranks'}, {steps} recorded steps on "
        f"{as_written(', '.join(devices)) or '?'}"
    )
    from rich.table import Table

    table = Table(show_edge=False)
    for name in ("rank", "steps", "peak allocated", "peak reserved", "max inactive split",
                 "retries", "OOMs", "step time"):
        table.add_column(name, justify="left" if name == "rank" else "right")
    for s in report.summaries:
        mark = " (worst)" if s is report.worst and len(report.summaries) > 1 else ""
        table.add_row(
            _rank_name(s) + mark,
            str(s.steps),
            format_bytes(s.peak_allocated_bytes),
            format_bytes(s.peak_reserved_bytes),
            f"{format_bytes(s.max_inactive_split_bytes)} ({_fragmentation_pct(s)})",
            str(s.num_alloc_retries),
            str(s.num_ooms),
            _ms(s.mean_step_time_s),
        )
    console.print(table)
    style = "bold red" if any(s.num_ooms for s in report.summaries) else "bold green"
    console.print(f"[{style}]{monitor_verdict(report)}[/]")
    for rank, kind, summary in report.findings:
        where = "" if rank is None else f"rank {rank}: "
        console.print(f"[bold yellow]{kind}:[/] {where}{as_written(summary)}", soft_wrap=True)
    for warning in report.warnings:
        console.print(f"[yellow]warning:[/] {as_written(warning)}", soft_wrap=True)


def monitor_report_to_json(report: MonitorReport) -> dict:
    """The report as one JSON-ready object (``oomkit report --json``)."""
    worst = report.worst
    return {
        "verdict": monitor_verdict(report),
        "ranks": [s.to_json() for s in report.summaries],
        "worst_rank": None if worst is None else worst.rank,
        "worst": None if worst is None else worst.to_json(),
        "logs": [str(log.path) for log in report.logs],
        "warnings": list(report.warnings),
        "findings": [
            {"rank": rank, "kind": kind, "summary": summary}
            for rank, kind, summary in report.findings
        ],
    }


def _series(log: MonitorLog) -> list[ChartSeries]:
    from oomkit.interfaces.reports.html import ChartSeries

    recs = log.records
    series = [
        ChartSeries("allocated", tuple((r.step, r.allocated_bytes) for r in recs)),
        ChartSeries("reserved", tuple((r.step, r.reserved_bytes) for r in recs)),
        ChartSeries("inactive split", tuple((r.step, r.inactive_split_bytes) for r in recs)),
        ChartSeries("peak allocated", tuple((r.step, r.peak_allocated_bytes) for r in recs)),
    ]
    used = tuple((r.step, r.device_used_bytes) for r in recs if r.device_used_bytes is not None)
    if used:
        series.append(ChartSeries("device used (NVML)", used))
    return series


def monitor_html(report: MonitorReport, *, title: str = "oomkit memory report") -> str:
    """A self-contained page: verdict, per-rank table, one timeline chart per log."""
    from oomkit.interfaces.reports.html import HtmlPage, line_chart_svg

    page = HtmlPage(title, subtitle=", ".join(str(log.path) for log in report.logs))
    page.section("Verdict", "verdict").verdict(monitor_verdict(report))
    ranks = page.section("Ranks" if len(report.summaries) > 1 else "Summary", "ranks")
    ranks.table(
        ["rank", "steps", "peak allocated", "peak reserved", "max inactive split", "retries",
         "OOMs", "step time"],
        [
            [
                _rank_name(s) + (" (worst)" if s is report.worst and len(report.summaries) > 1
                                 else ""),
                s.steps,
                format_bytes(s.peak_allocated_bytes),
                format_bytes(s.peak_reserved_bytes),
                f"{format_bytes(s.max_inactive_split_bytes)} ({_fragmentation_pct(s)})",
                s.num_alloc_retries,
                s.num_ooms,
                _ms(s.mean_step_time_s),
            ]
            for s in report.summaries
        ],
        numeric_columns=range(1, 8),
    )
    if report.findings:
        section = page.section("Findings", "findings")
        for rank, kind, summary in report.findings:
            where = "" if rank is None else f"rank {rank}: "
            section.paragraph(f"{kind}: {where}{summary}")
    timeline = page.section("Timeline", "timeline")
    for log in report.logs:
        if not log.records:
            timeline.paragraph(f"{log.path}: no records", css_class="note")
            continue
        rank = log.header.get("rank")
        capacity = log.header.get("capacity_bytes")
        svg = line_chart_svg(
            _series(log),
            x_label="step",
            limit_bytes=capacity,
            limit_label=None if capacity is None else f"capacity {format_bytes(capacity)}",
        )
        caption = f"{log.header.get('device', '?')}" + ("" if rank is None else f", rank {rank}")
        timeline.figure(svg, caption)
    if report.warnings:
        section = page.section("Warnings", "warnings")
        for warning in report.warnings:
            section.paragraph(warning, css_class="warning")
    return page.render()


def write_monitor_html(path: str | os.PathLike[str], report: MonitorReport) -> Path:
    """Write :func:`monitor_html` to ``path`` and return it."""
    from oomkit._files import write_output

    return write_output(path, monitor_html(report), flag="--html")


def write_monitor_png(path: str | os.PathLike[str], report: MonitorReport) -> Path:
    """A PNG of the timelines (one panel per log) with matplotlib.

    Raises:
        ImportError: matplotlib is not installed.
    """
    import matplotlib

    from oomkit._files import output_file

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    logs = [log for log in report.logs if log.records] or list(report.logs)
    fig, axes = plt.subplots(len(logs), 1, figsize=(10, 3.2 * max(1, len(logs))), squeeze=False)
    for ax, log in zip(axes[:, 0], logs, strict=True):
        for series in _series(log):
            xs = [x for x, _ in series.points]
            ys = [y / 2**20 for _, y in series.points]
            ax.step(xs, ys, where="post", label=series.name)
        capacity = log.header.get("capacity_bytes")
        if capacity:
            ax.axhline(capacity / 2**20, linestyle="--", color="#D55E00", label="capacity")
        rank = log.header.get("rank")
        device = as_plot_text(str(log.header.get("device", "?")))
        ax.set_title(device + ("" if rank is None else f" rank {rank}"))
        ax.set_xlabel("step")
        ax.set_ylabel("MiB")
        ax.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    try:
        with output_file(path, flag="--png") as temp:
            fig.savefig(temp, format="png", dpi=100)
    finally:
        plt.close(fig)
    return Path(path)

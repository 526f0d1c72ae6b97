"""``oomkit report LOG...``: summarise monitor logs; HTML timeline, PNG, JSON."""

from __future__ import annotations

import argparse
import sys

from oomkit.interfaces.cli import EXIT_MISSING_DEPENDENCY, EXIT_NO_FIT, EXIT_OK
from oomkit.interfaces.cli._common import add_json_flag, print_json, stdout_console

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "report",
        help="summarise oomkit.Monitor logs: peaks, fragmentation, retries, OOMs per rank",
        description="Summarise the JSONL logs written by oomkit.Monitor(log_path=...): steps, "
        "peak allocated and reserved, most inactive-split (fragmented) memory, allocation "
        "retries and OOMs, one row per rank when several logs (or a directory of them) are "
        "given, the worst rank named. Exit 0, or 1 when a log recorded an OOM; 2 for a "
        "missing or unreadable log; 3 when --png is asked without matplotlib.",
    )
    parser.add_argument(
        "logs", nargs="+", metavar="LOG", help="monitor log files, or directories of *.jsonl"
    )
    parser.add_argument(
        "--html", metavar="FILE", help="also write a self-contained HTML page with timelines"
    )
    parser.add_argument(
        "--png", metavar="FILE", help="also write the timelines as a PNG (needs matplotlib)"
    )
    add_json_flag(parser)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from oomkit._files import check_output_path
    from oomkit.interfaces.reports.monitor import (
        build_monitor_report,
        find_monitor_logs,
        monitor_report_to_json,
        render_monitor_report,
        write_monitor_html,
        write_monitor_png,
    )

    # Before anything is read or written: no output over a log (one named, or one found in a
    # directory named), none into a missing directory or onto a directory.
    for flag, out in (("--html", args.html), ("--png", args.png)):
        if out is not None:
            check_output_path(out, inputs=find_monitor_logs(args.logs), flag=flag)
    report = build_monitor_report(args.logs)
    if args.png is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(
                "oomkit: --png needs matplotlib; install it with `pip install matplotlib`, or "
                "use --html (no extra dependency)",
                file=sys.stderr,
            )
            return EXIT_MISSING_DEPENDENCY
        write_monitor_png(args.png, report)
    if args.html is not None:
        write_monitor_html(args.html, report)
    if args.json:
        print_json(monitor_report_to_json(report))
    else:
        render_monitor_report(report, stdout_console())
    return EXIT_NO_FIT if any(s.num_ooms for s in report.summaries) else EXIT_OK

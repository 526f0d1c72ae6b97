"""``oomkit explain DIR`` and ``oomkit diff DIR_A DIR_B`` over per-rank snapshots (a fleet).

``explain`` and ``diff`` hand a directory here (``run_explain`` / ``run_diff``); the flags they
add for it come from ``add_fleet_flags``. Exit codes: 0 after a report, 2 bad input.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from oomkit.interfaces.cli._common import print_json, stdout_console
from oomkit.interfaces.cli._progress import progress_bar, progress_enabled

__all__ = ["add_fleet_flags", "run_diff", "run_explain"]

# Rows of the per-rank table; --json lists every rank.
_TABLE_ROWS = 32


def add_fleet_flags(parser: argparse.ArgumentParser) -> None:
    """``--rank-pattern REGEX`` and ``--ray [ADDRESS]``, for a directory of per-rank snapshots."""
    parser.add_argument(
        "--rank-pattern", default=None, metavar="REGEX",
        help="directory of per-rank snapshots: a regular expression whose first group is the "
        "rank in a file name (default reads rank3, rank_3, rank-3: torchtitan, NeMo, Megatron)",
    )
    parser.add_argument(
        "--ray", nargs="?", const="", default=None, metavar="ADDRESS",
        help="directory of per-rank snapshots: read them as Ray tasks on the cluster at ADDRESS "
        "(without it: RAY_ADDRESS or a local cluster; pip install 'oomkit[ray]')",
    )


def _executor(args: argparse.Namespace) -> Any:
    from oomkit.executors import LocalPoolExecutor, RayExecutor

    ray = getattr(args, "ray", None)
    return LocalPoolExecutor(getattr(args, "jobs", None)) if ray is None else RayExecutor(ray or None)


def run_explain(args: argparse.Namespace, directory: str) -> int:
    """One report across the ranks of ``directory``."""
    from oomkit.diagnose.fleet import analyze_fleet

    with progress_bar(progress_enabled(args, sys.stderr), "reading rank snapshots") as update:
        report = analyze_fleet(
            directory, executor=_executor(args), rank_pattern=getattr(args, "rank_pattern", None),
            progress=update,
        )
    if getattr(args, "json", False):
        print_json(fleet_to_json(report))
    else:
        _render_report(report)
    return 0


def run_diff(args: argparse.Namespace, directory_a: str, directory_b: str) -> int:
    """Two jobs' ranks compared rank by rank."""
    from oomkit.diagnose.fleet import diff_fleets

    diff = diff_fleets(
        directory_a, directory_b, executor=_executor(args),
        rank_pattern=getattr(args, "rank_pattern", None),
    )
    if getattr(args, "json", False):
        print_json({
            "a": fleet_to_json(diff.a),
            "b": fleet_to_json(diff.b),
            "per_rank": [{"rank": r, "a_peak_reserved_bytes": a, "b_peak_reserved_bytes": b}
                         for r, a, b in diff.per_rank],
            "only_a": list(diff.only_a),
            "only_b": list(diff.only_b),
        })
        return 0
    from rich.table import Table

    from oomkit.units import format_bytes

    console = stdout_console()
    table = Table(title=f"peak reserved by rank: A {diff.a.directory}, B {diff.b.directory}")
    for column in ("rank", "A", "B", "B - A"):
        table.add_column(column, justify="right")
    for rank, a, b in diff.per_rank[:_TABLE_ROWS]:
        table.add_row(str(rank), format_bytes(a), format_bytes(b), _signed(b - a))
    console.print(table)
    growth = diff.largest_growth
    if growth is not None:
        console.print(f"Largest change: rank {growth[0]}, {_signed(growth[1])}.")
    if diff.only_a or diff.only_b:
        console.print(f"Ranks only in A: {list(diff.only_a)}; only in B: {list(diff.only_b)}.")
    return 0


def fleet_to_json(report: Any) -> dict[str, Any]:
    """A fleet report as JSON-ready data."""
    return {
        "directory": report.directory,
        "peak_rank": report.peak_rank,
        "median_rank": report.median_rank,
        "spread_bytes": report.spread_bytes,
        "outliers": list(report.outliers),
        "ranks": [
            {"rank": r.rank, "path": r.path, "peak_reserved_bytes": r.peak_reserved_bytes,
             "allocated_at_peak_bytes": r.allocated_at_peak_bytes,
             "by_category_bytes": dict(r.by_category_bytes),
             "by_site_bytes": dict(r.by_site_bytes)}
            for r in report.ranks
        ],
        "differences": [
            {"name": d.name, "median_rank_bytes": d.a_bytes, "peak_rank_bytes": d.b_bytes}
            for d in report.differences
        ],
    }


def _render_report(report: Any) -> None:
    from rich.table import Table

    from oomkit.units import format_bytes

    console = stdout_console()
    median = report.rank(report.median_rank).peak_reserved_bytes
    table = Table(title=f"{len(report.ranks)} ranks in {report.directory}")
    for column in ("rank", "peak reserved", "allocated at peak", "vs median"):
        table.add_column(column, justify="right")
    for r in report.ranks[:_TABLE_ROWS]:
        mark = " (peak)" if r.rank == report.peak_rank else ""
        table.add_row(f"{r.rank}{mark}", format_bytes(r.peak_reserved_bytes),
                      format_bytes(r.allocated_at_peak_bytes), _signed(r.peak_reserved_bytes - median))
    console.print(table)
    peak = report.rank(report.peak_rank)
    console.print(
        f"Rank {peak.rank} peaks at {format_bytes(peak.peak_reserved_bytes)} reserved; the median "
        f"rank ({report.median_rank}) at {format_bytes(median)}; spread "
        f"{format_bytes(report.spread_bytes)}."
    )
    if report.outliers:
        console.print(
            f"Outliers (over the median by 10%): ranks {', '.join(map(str, report.outliers))}. "
            f"Explain one alone: oomkit explain {peak.path}"
        )
    for d in report.differences[:5]:
        console.print(f"  rank {peak.rank} holds {_signed(d.b_bytes - d.a_bytes)} more at {d.name}")


def _signed(value: int) -> str:
    from oomkit.units import format_bytes

    return ("+" if value >= 0 else "-") + format_bytes(abs(value))

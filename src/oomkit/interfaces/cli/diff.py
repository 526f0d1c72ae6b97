"""``oomkit diff A B``: why peak memory moved between two runs (snapshots, predictions, logs)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from oomkit.interfaces.cli._common import (
    add_json_flag,
    existing_file,
    print_json,
    stdout_console,
)

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "diff",
        help="split the change in peak memory between two runs into allocated and placement",
        description="Compare two snapshots, two saved predictions (predict --json) or two "
        "monitor logs: the change in peak reserved memory, B minus A, split into allocated "
        "bytes at each peak and placement (cache and fragmentation), by category and allocation "
        "site, and where the two runs first diverge.",
    )
    parser.add_argument("a", type=_file_or_directory, metavar="A")
    parser.add_argument("b", type=_file_or_directory, metavar="B")
    parser.add_argument("--device", type=int, help="snapshots: the device to compare (default: the first used)")
    parser.add_argument(
        "--force", action="store_true", help="compare inputs of different kinds or GPUs anyway"
    )
    parser.add_argument("--html", type=Path, metavar="OUT", help="also write a self-contained page")
    from oomkit.interfaces.cli.fleet import add_fleet_flags

    add_fleet_flags(parser)  # two directories of per-rank snapshots: rank by rank
    add_json_flag(parser)
    parser.set_defaults(run=run)
    return parser


def _kind_of(path: Path) -> str:
    from oomkit._files import input_file_error

    try:
        with path.open("rb") as f:
            head = f.read(4096)
    except OSError as exc:
        raise input_file_error(path, exc) from None
    stripped = head.lstrip()
    if stripped.startswith(b"{"):
        first_line = stripped.split(b"\n", 1)[0]
        if b"oomkit_monitor" in first_line:
            return "monitor"
        return "prediction"
    return "snapshot"


def _load(path: Path, device: int | None, show_progress: bool = False) -> Any:
    kind = _kind_of(path)
    if kind == "monitor":
        from oomkit.runtime._monitor_log import load_monitor_log
        from oomkit.runtime.monitor_memory import run_memory_from_monitor_log

        return run_memory_from_monitor_log(load_monitor_log(path))
    if kind == "prediction":
        from oomkit.diagnose.run_diff import run_memory_from_prediction
        from oomkit.errors import PredictionFormatError

        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise PredictionFormatError(f"{path}: not JSON ({exc})") from exc
        except OSError as exc:
            from oomkit._files import input_file_error

            raise input_file_error(path, exc) from None
        return run_memory_from_prediction(data, name=path.name)
    from oomkit.core.snapshot import load_snapshot
    from oomkit.diagnose.run_diff import run_memory_from_snapshot
    from oomkit.interfaces.cli._progress import snapshot_progress

    with snapshot_progress(show_progress, path.name) as progress:
        snapshot = load_snapshot(path, progress=progress.loading)
        progress.phase("reading its memory over the run")
        return run_memory_from_snapshot(snapshot, device=device)


def _file_or_directory(text: str) -> Path:
    """A run's file, or a directory of a job's per-rank snapshots."""
    path = Path(text)
    return path if path.is_dir() else existing_file(text)


def run(args: argparse.Namespace) -> int:
    if args.a.is_dir() or args.b.is_dir():
        if not (args.a.is_dir() and args.b.is_dir()):
            from oomkit.errors import DiffInputError

            raise DiffInputError(
                "diff compares two files, or two directories of per-rank snapshots; got one of "
                "each. Give two directories (two jobs) or two files (two runs)."
            )
        from oomkit.interfaces.cli import fleet

        return fleet.run_diff(args, str(args.a), str(args.b))
    from oomkit.diagnose.run_diff import diff_runs
    from oomkit.interfaces.reports.diff import diff_to_json, render_diff, write_diff_html

    if args.html is not None:
        from oomkit._files import check_output_path

        check_output_path(args.html, inputs=(args.a, args.b), flag="--html")
    from oomkit.interfaces.cli._progress import progress_enabled

    show = progress_enabled(args, sys.stderr)
    diff = diff_runs(
        _load(args.a, args.device, show), _load(args.b, args.device, show), force=args.force
    )
    if args.html is not None:
        write_diff_html(args.html, diff)
    if args.json:
        print_json(diff_to_json(diff))
    else:
        render_diff(diff, stdout_console())
    return 0

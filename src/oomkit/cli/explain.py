"""``oomkit explain``: the cause of a CUDA out-of-memory error and what to change."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from oomkit.cli._common import add_json_flag, print_json, stdout_console
from oomkit.errors import OomkitError

__all__ = ["add_parser", "run"]

# Every pickle protocol >= 2 starts with PROTO (0x80): a snapshot, not error text.
_PICKLE_MAGIC = b"\x80"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "explain",
        help="explain an OOM error: its cause, the evidence and ranked remedies",
        description="Explain a CUDA out-of-memory error from its message: pass the text, a file "
        "holding it (a log or traceback is fine), or '-' (the default) to read stdin. Works "
        "without torch. Exit 0 after a diagnosis, 2 when no OOM message is found.",
    )
    parser.add_argument(
        "source",
        nargs="?",
        default="-",
        metavar="TEXT|FILE|-",
        help="the error text, a file holding it, or - for stdin",
    )
    parser.add_argument(
        "--gpu",
        metavar="NAME",
        help="the GPU it ran on, for its CUDA-context figure (default: matched by total memory)",
    )
    add_json_flag(parser)
    parser.set_defaults(run=run)
    return parser


def _read_source(source: str) -> str:
    if source == "-":
        return sys.stdin.read()
    path = Path(source)
    try:
        is_file = path.is_file()
    except OSError:  # a long pasted message is not a valid path
        is_file = False
    if not is_file:
        return source
    head = path.read_bytes()[:1]
    if head == _PICKLE_MAGIC:
        raise OomkitError(
            f"{source} is a pickle (a memory snapshot?); `oomkit explain` reads error text for "
            f"now. Replay the snapshot with `oomkit replay {source}` or `oomkit tune {source}`"
        )
    return path.read_text(errors="replace")


def run(args: argparse.Namespace) -> int:
    from oomkit.analysis.diagnosis import diagnose_oom_text
    from oomkit.analysis.oom_text import parse_oom_text
    from oomkit.reports.diagnosis import diagnosis_to_json, render_diagnosis

    gpu = None
    if args.gpu is not None:
        from oomkit.gpus import get_gpu

        gpu = get_gpu(args.gpu)
    parsed = parse_oom_text(_read_source(args.source))
    diagnosis = diagnose_oom_text(parsed, gpu)
    if args.json:
        print_json(diagnosis_to_json(diagnosis, parsed))
    else:
        render_diagnosis(diagnosis, stdout_console())
    return 0

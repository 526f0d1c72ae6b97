"""``oomkit explain``: the cause of a CUDA out-of-memory error and what to change."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from oomkit.errors import ConfigError
from oomkit.interfaces.cli._common import add_gpu_flag, add_json_flag, print_json, stdout_console

__all__ = ["add_parser", "run"]

# Every pickle protocol >= 2 starts with PROTO (0x80): a snapshot, not error text.
_PICKLE_MAGIC = b"\x80"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "explain",
        help="explain an OOM error: its cause, the evidence and ranked remedies",
        description="Explain a CUDA out-of-memory error: pass its text, a file holding it (a log "
        "or traceback is fine), '-' (the default) to read stdin, a memory snapshot (ideally "
        "dumped in the except handler of torch.OutOfMemoryError), or a saved prediction "
        "(`oomkit predict ... --json > p.json`). Works without torch. Exit 0 after a diagnosis, "
        "2 when no OOM message is found or the file cannot be read.",
    )
    parser.add_argument(
        "source",
        nargs="?",
        default="-",
        metavar="TEXT|FILE|-",
        help="the error text, a file holding it, a snapshot, a prediction JSON, or - for stdin",
    )
    add_gpu_flag(
        parser,
        default=None,
        help="the GPU it ran on (a catalog name, or its total memory such as 24GiB), for its "
        "total memory and CUDA-context figure (default: matched by total memory; snapshots do "
        "not record it)",
    )
    parser.add_argument(
        "--device",
        type=int,
        metavar="N",
        help="snapshot device to explain (default: the one with an OOM, else the first)",
    )
    parser.add_argument(
        "--memory-fraction",
        type=float,
        metavar="F",
        help="snapshot: the set_per_process_memory_fraction in effect (snapshots do not record it)",
    )
    parser.add_argument(
        "--no-measure",
        dest="measure",
        action="store_false",
        help="saved prediction of a preset: estimate model changes (mixed precision, "
        "checkpointing, optimizer, batch) instead of measuring each by re-predicting (faster)",
    )
    add_json_flag(parser)
    parser.add_argument(
        "--html",
        metavar="FILE",
        help="also write a self-contained HTML report (with a memory timeline and a segment "
        "map for snapshots)",
    )
    parser.set_defaults(run=run)
    return parser


def _read_source(source: str) -> str | Path:
    """The text to explain, or the path of a snapshot (a pickle) to load."""
    if source == "-":
        return sys.stdin.read()
    path = Path(source)
    try:
        is_file = path.is_file()
    except OSError:  # a long pasted message is not a valid path
        is_file = False
    if not is_file:
        return source
    if path.read_bytes()[:1] == _PICKLE_MAGIC:
        return path
    return path.read_text(errors="replace")


def _as_json(text: str) -> object | None:
    """The JSON value of a text that is one JSON object, else None (then it is error text)."""
    if not text.lstrip().startswith("{"):
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None


def run(args: argparse.Namespace) -> int:
    from oomkit.diagnose.diagnosis import diagnose_oom_text
    from oomkit.diagnose.oom_text import parse_oom_text
    from oomkit.interfaces.reports.diagnosis import diagnosis_to_json, render_diagnosis

    gpu = None
    if args.gpu is not None:
        from oomkit.interfaces.cli._target import target_from_args

        gpu = target_from_args(args).gpu
    if args.memory_fraction is not None and not 0.0 < args.memory_fraction <= 1.0:
        raise ConfigError(
            f"--memory-fraction must be in (0, 1]; got {args.memory_fraction}. Example: "
            "--memory-fraction 0.5"
        )
    source = _read_source(args.source)
    parsed = snapshot = None
    prediction: Mapping[str, Any] | None = None
    if isinstance(source, Path):
        from oomkit.core.snapshot import load_snapshot
        from oomkit.diagnose.snapshot_diagnosis import diagnose_snapshot

        snapshot = load_snapshot(source)
        diagnosis = diagnose_snapshot(
            snapshot,
            device=args.device,
            gpu=gpu,
            memory_fraction=args.memory_fraction,
        )
    elif isinstance(data := _as_json(source), Mapping):
        from oomkit.diagnose.prediction_diagnosis import diagnose_prediction

        prediction = data
        diagnosis = diagnose_prediction(data, measure=args.measure)
    else:
        parsed = parse_oom_text(source)
        diagnosis = diagnose_oom_text(parsed, gpu)
    if args.html is not None:
        from oomkit.interfaces.reports.diagnosis_html import write_diagnosis_html

        write_diagnosis_html(
            args.html,
            diagnosis,
            snapshot=snapshot,
            device=args.device,
            source=args.source,
            prediction=prediction,
        )
    if args.json:
        print_json(diagnosis_to_json(diagnosis, parsed))
    else:
        render_diagnosis(diagnosis, stdout_console())
    return 0

"""``oomkit plan MODEL --global-batch N --seq L --gpus h100,a100-80gb``: the cheapest layout that fits.

Exit codes: 0 a layout fits (with ``--margin``), 1 none does, 2 bad input.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from oomkit.errors import OomkitError
from oomkit.interfaces.cli._common import (
    add_json_flag,
    print_json,
    stderr_console,
    stdout_console,
)
from oomkit.interfaces.cli._progress import add_jobs_flag, progress_bar, progress_enabled

__all__ = ["add_parser", "run"]

# Rows of the terminal table; --json lists every candidate.
_TABLE_ROWS = 15
_CHECKPOINTING = ("none", "selective-op", "full")
_PRECISIONS = ("bf16-mixed", "bf16")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "plan",
        help="rank the layouts (GPU kind and count, FSDP/HSDP/DDP/TP, micro-batch, AC, "
        "precision) that fit a training job",
        description="Enumerate the layouts that divide a global batch on each GPU kind (FSDP, "
        "HSDP, DDP; tensor parallelism for the Llama presets; micro-batch and accumulation; "
        "activation checkpointing; precision), prune those whose parameters, gradients and "
        "optimizer states alone exceed a GPU, predict the rest per rank, and rank them: "
        "fitting first, then cheapest. Pipeline (Llama presets with untied embeddings, at "
        "their worst stage) and context parallel (Llama presets, with FSDP) layouts are "
        "enumerated too. Exit 0 when a layout fits, 1 when none does.",
    )
    parser.add_argument("model", metavar="MODEL", help="a model preset, e.g. llama3-8b")
    parser.add_argument("--global-batch", type=_positive, required=True, metavar="N",
                        help="sequences per optimizer step, over all data-parallel ranks")
    parser.add_argument("--seq", type=_positive, required=True, metavar="L",
                        help="tokens per sequence")
    parser.add_argument("--gpus", type=_names, required=True, metavar="KINDS",
                        help="GPU kinds to consider, comma-separated (e.g. h100,a100-80gb,l40s)")
    parser.add_argument("--max-gpus", type=_positive, default=512, metavar="N",
                        help="the most GPUs of a kind (GPU counts are powers of two; default 512)")
    parser.add_argument("--price", type=_prices, default={}, metavar="KIND=USD,...",
                        help="dollars per GPU-hour, e.g. h100=2.5,a100-80gb=1.8: ranks by $/hour")
    parser.add_argument("--checkpointing", type=_choices(_CHECKPOINTING), default=_CHECKPOINTING,
                        metavar="LIST", help="activation checkpointing policies to consider "
                        "(default: none,selective-op,full)")
    parser.add_argument("--precision", type=_choices(_PRECISIONS), default=_PRECISIONS,
                        metavar="LIST", help="precisions to consider (default: bf16-mixed,bf16)")
    parser.add_argument("--max-micro-batch", type=_positive, default=None, metavar="N",
                        help="the largest micro-batch per rank (default: the whole rank's batch)")
    parser.add_argument("--margin", type=_size, default=0, metavar="SIZE",
                        help="headroom a layout must keep to count as fitting (e.g. 2GiB)")
    parser.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                        help="predict on a Ray cluster: ADDRESS (host:6379, ray://...), or without "
                        "it RAY_ADDRESS or a local cluster (needs pip install 'oomkit[ray]')")
    add_jobs_flag(parser, what="candidates", verb="predict")
    add_json_flag(parser)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from oomkit.executors import LocalPoolExecutor, RayExecutor
    from oomkit.scenario.planning import PlanRequest, plan, plan_to_data

    request = PlanRequest(
        preset=args.model,
        global_batch=args.global_batch,
        seq=args.seq,
        gpus=tuple(args.gpus),
        max_gpus=args.max_gpus,
        prices=dict(args.price),
        checkpointing=tuple(args.checkpointing),
        precisions=tuple(args.precision),
        max_micro_batch=args.max_micro_batch,
        margin_bytes=args.margin,
    )
    executor: Any = (
        LocalPoolExecutor(args.jobs) if args.ray is None else RayExecutor(args.ray or None)
    )
    if not args.json:  # said before a search that may take minutes, terminal or not
        stderr_console().print(
            f"planning {request.preset}: global batch {request.global_batch}, seq "
            f"{request.seq}, on {', '.join(request.gpus)}, up to {request.max_gpus} GPU(s); each "
            "layout whose state fits is recorded (minutes for a large model) ...",
            markup=False, highlight=False, soft_wrap=True,
        )
    with progress_bar(progress_enabled(args, sys.stderr), "predicting layouts") as update:
        result = plan(request, executor, progress=update)
    if args.json:
        print_json(plan_to_data(result))
    else:
        _render(result)
    return 0 if result.winner is not None else 1


def _render(result: Any) -> None:
    from rich.table import Table

    from oomkit.units import format_bytes

    request = result.request
    console = stdout_console()
    table = Table(title=f"{request.preset}: global batch {request.global_batch}, seq {request.seq}")
    for column in ("#", "gpu", "gpus", "layout", "micro x accum", "AC", "precision", "fits",
                   "worst rank peak reserved", "headroom"):
        table.add_column(column, justify="right" if column in ("#", "gpus") else "left")
    if request.prices:
        table.add_column("$/hour", justify="right")
    for index, c in enumerate(result.candidates[:_TABLE_ROWS], start=1):
        layout = c.layout
        if c.pruned is not None:
            fits = "no (state)"
        elif c.error is not None:
            fits = "error"
        else:
            fits = "yes" if c.fits_with(request.margin_bytes) else ("tight" if c.fits else "no")
        row = [
            str(index), layout.gpu, str(layout.gpus), _degrees(layout),
            f"{layout.micro_batch} x {layout.grad_accum}", layout.checkpointing, layout.precision,
            fits,
            "-" if c.peak_reserved_bytes is None else format_bytes(c.peak_reserved_bytes),
            "-" if c.headroom_bytes is None else format_bytes(c.headroom_bytes),
        ]
        if request.prices:
            row.append("-" if c.price_per_hour is None else f"{c.price_per_hour:.2f}")
        table.add_row(*row)
    console.print(table)
    shown = min(_TABLE_ROWS, len(result.candidates))
    console.print(
        f"{len(result.candidates)} layouts ({shown} shown; --json lists all): {result.pruned} "
        f"pruned by state bytes, {result.predicted} predicted in full."
    )
    winner = result.winner
    if winner is None:
        console.print("No layout fits: more GPUs (--max-gpus), a larger GPU kind, or full AC.")
    else:
        console.print(f"Best: {winner.layout.gpus} x {winner.layout.gpu}, {_degrees(winner.layout)}"
                      f"; its scenario is in --json's winner_scenario (oomkit predict --config).")
    for note in result.notes:
        console.print(f"note: {note}")


def _degrees(layout: Any) -> str:
    parts = [f"{name} {value}" for name, value in
             (("fsdp", layout.fsdp), ("dp", layout.dp), ("tp", layout.tp), ("pp", layout.pp),
              ("schedule", layout.pp_schedule), ("cp", layout.cp)) if value is not None]
    return f"{layout.strategy} ({', '.join(parts)})" if parts else layout.strategy


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}")
    return value


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected names separated by commas; got {text!r}")
    return names


def _choices(allowed: tuple[str, ...]) -> Any:
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(_names(text))
        bad = [n for n in names if n not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(
                f"{', '.join(bad)}: not one of {', '.join(allowed)}"
            )
        return names

    return parse


def _prices(text: str) -> dict[str, float]:
    prices: dict[str, float] = {}
    for item in _names(text):
        kind, _, value = item.partition("=")
        try:
            price = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{item!r}: write KIND=DOLLARS_PER_GPU_HOUR, e.g. h100=2.5"
            ) from None
        if kind.strip() in prices:
            raise argparse.ArgumentTypeError(f"{kind.strip()} is priced twice; give one price")
        prices[kind.strip()] = price
    return prices


def _size(text: str) -> int:
    from oomkit.units import parse_bytes

    try:
        return parse_bytes(text)
    except (OomkitError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None

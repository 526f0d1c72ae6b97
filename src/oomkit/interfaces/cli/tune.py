"""``oomkit tune TRACE|SNAPSHOT``: which PYTORCH_CUDA_ALLOC_CONF reserves least for this workload?"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from oomkit.errors import OomkitError
from oomkit.interfaces.cli._common import (
    Device,
    add_device_flags,
    add_json_flag,
    device_from_args,
    device_lines,
    device_to_json,
    print_json,
    stderr_console,
    stdout_console,
)
from oomkit.interfaces.cli._progress import (
    add_jobs_flag,
    note_memory_cap,
    progress_bar,
    progress_enabled,
    snapshot_progress,
)

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["add_parser", "run"]

# Rows of the terminal table; --json lists every candidate.
_TABLE_ROWS = 10
_DEFAULT_CAPACITY = "80GiB"
_SNAPSHOT_SUFFIXES = (".pickle", ".pkl")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "tune",
        help="find the PYTORCH_CUDA_ALLOC_CONF that reserves least for a trace or snapshot",
        description="Replay a workload (an oomkit trace file, or a PyTorch memory snapshot from "
        "torch.cuda.memory._dump_snapshot) under about 25 PYTORCH_CUDA_ALLOC_CONF settings "
        "(max_split_size_mb, expandable_segments, garbage_collection_threshold, "
        "roundup_power2_divisions) and rank them by peak reserved memory, then by "
        "cudaMalloc + cudaFree calls. Settings that run out of memory rank last; settings known "
        "to misbehave are flagged with the reason.",
    )
    parser.add_argument("source", metavar="TRACE|SNAPSHOT", help="an oomkit trace or a snapshot")
    add_device_flags(parser, default_capacity=_DEFAULT_CAPACITY, what="rank the settings at")
    parser.add_argument(
        "--device",
        type=int,
        default=None,
        metavar="N",
        help="snapshot device to replay (default: the first with memory)",
    )
    add_jobs_flag(parser, what="settings")
    add_json_flag(parser)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from oomkit._files import not_a_file_reason
    from oomkit.plan import tune
    from oomkit.plan.tuning import DEFAULT_GRID

    path = Path(args.source)
    what = not_a_file_reason(path)
    if what is not None:
        raise OomkitError(
            f"{args.source}: {what}. Pass an oomkit trace (.jsonl, .jsonl.gz) or a "
            f"snapshot from torch.cuda.memory._dump_snapshot (paths are relative to {Path.cwd()})."
        )
    target_device = device_from_args(args, default_capacity=_DEFAULT_CAPACITY)
    assert target_device is not None  # a default capacity
    show = progress_enabled(args, sys.stderr)
    source, snapshot_device, torch_version, recorded = _open_source(path, args.device, show)
    # The snapshot is loaded: this process is as large as it gets before the settings replay.
    note_memory_cap(args.jobs, len(DEFAULT_GRID))
    with progress_bar(show, "replaying settings") as update:
        result = tune(
            source,
            target_device.capacity_bytes,
            device=snapshot_device,
            torch_version=torch_version,
            progress=update,
            jobs=args.jobs,
            reserved_outside_bytes=target_device.context_overhead_bytes,
        )
    if args.json:
        print_json(
            _to_json(result, path, snapshot_device, torch_version, recorded, target_device)
        )
    else:
        _render(result, path, recorded, target_device)
    return 0


def _open_source(path: Path, device: int | None, show_progress: bool = False):
    """The tune() source of a file: its snapshot (loaded under a progress bar when
    ``show_progress``), or a factory re-reading its trace events."""
    if _is_snapshot(path):
        from oomkit.core.snapshot import infer_torch_version, load_snapshot

        with snapshot_progress(show_progress, path.name) as progress:
            snapshot = load_snapshot(path, progress=progress.loading)
        if device is None:
            devices = snapshot.devices()
            device = devices[0] if devices else 0
        settings = snapshot.allocator_settings or {}
        recorded = settings.get("PYTORCH_CUDA_ALLOC_CONF") if isinstance(settings, dict) else None
        return snapshot, device, infer_torch_version(snapshot), recorded or None

    from oomkit.core.trace import read_trace

    header, events = read_trace(path)
    close = getattr(events, "close", None)  # only the header is needed now
    if callable(close):
        close()
    if device is not None and device != header.device:
        stderr_console().print(
            f"[yellow]hint:[/] {path.name} is a trace of device {header.device}; --device "
            f"{device} applies to snapshots only and is ignored."
        )

    def factory():
        return read_trace(path)[1]

    return factory, header.device, header.torch_version, header.allocator_settings or None


def _is_snapshot(path: Path) -> bool:
    if path.suffix.lower() in _SNAPSHOT_SUFFIXES:
        return True
    from oomkit.core.snapshot import looks_like_pickle

    try:
        with open(path, "rb") as f:
            return looks_like_pickle(f.read(8))
    except OSError as exc:
        from oomkit._files import input_file_error

        raise input_file_error(path, exc) from None


def _candidate_json(candidate) -> dict:
    return {
        "alloc_conf": candidate.alloc_conf,
        "peak_reserved_bytes": candidate.peak_reserved_bytes,
        "peak_allocated_bytes": candidate.peak_allocated_bytes,
        "device_allocs": candidate.device_allocs,
        "device_frees": candidate.device_frees,
        "alloc_retries": candidate.alloc_retries,
        "ooms": candidate.ooms,
        "flags": list(candidate.flags),
    }


def _to_json(
    result, path: Path, device: int, torch_version: str | None, recorded, target: Device
) -> dict:
    from oomkit.plan import FLAG_REASONS

    flags = sorted({f for c in result.candidates for f in c.flags})
    return {
        "source": str(path),
        "device": device,
        "torch_version": torch_version,
        "recorded_alloc_conf": recorded,
        **device_to_json(target),
        "baseline": _candidate_json(result.baseline),
        "candidates": [_candidate_json(c) for c in result.candidates],
        "best": None if result.best is None else _candidate_json(result.best),
        "saving_bytes": result.saving_bytes,
        "comparable": result.comparable,
        "flag_reasons": {f: FLAG_REASONS.get(f, f) for f in flags},
        "warnings": list(result.warnings),
    }


def _setting_label(alloc_conf: str) -> str:
    # One option per line, split at top-level commas only (the bracket form has its own).
    if not alloc_conf:
        return "(default)"
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(alloc_conf):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(alloc_conf[start:i])
            start = i + 1
    parts.append(alloc_conf[start:])
    return ",\n".join(parts)


def _render(result, path: Path, recorded: str | None, target: Device) -> None:
    from rich import box
    from rich.table import Table

    from oomkit.interfaces.reports._untrusted import as_written
    from oomkit.plan import FLAG_REASONS
    from oomkit.units import format_bytes

    console = stdout_console()
    for line in device_lines(target):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    baseline = result.baseline
    if not result.comparable:
        # No ranking of settings that all tie by construction (issue 35 item 7).
        for warning in result.warnings:
            if not warning.startswith("settings cannot be compared"):  # said last, in full
                _print_warning(console, warning)
        console.print(
            f"Settings cannot be compared on {as_written(path.name)}: the replay made no segment "
            f"decision under any of the {len(result.candidates)} settings, so none changes its "
            f"peak reserved ({format_bytes(baseline.peak_reserved_bytes)}). Record the history "
            "from before the first CUDA allocation (torch.cuda.memory._record_memory_history at "
            "the start of the script) to compare them."
        )
        return
    shown = result.candidates[:_TABLE_ROWS]
    table = Table(
        title=f"PYTORCH_CUDA_ALLOC_CONF settings for {as_written(path.name)} at "
        f"{format_bytes(target.usable_bytes)}",
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
        show_header=True,
        header_style="bold",
    )
    table.add_column("#", justify="right")
    # Fold rather than truncate: the setting is what the user copies.
    table.add_column("setting", overflow="fold", ratio=3)
    table.add_column("peak\nreserved", justify="right", no_wrap=True)
    table.add_column("saving vs\ndefault", justify="right", no_wrap=True)
    table.add_column("cudaMalloc/\ncudaFree", justify="right", no_wrap=True)
    table.add_column("retries", justify="right", no_wrap=True)
    table.add_column("flags", overflow="fold", ratio=2)
    for rank, c in enumerate(shown, start=1):
        peak = format_bytes(c.peak_reserved_bytes) + (" OOM" if c.ooms else "")
        saving = baseline.peak_reserved_bytes - c.peak_reserved_bytes
        table.add_row(
            str(rank),
            as_written(_setting_label(c.alloc_conf)),
            peak,
            "-" if c.ooms or baseline.ooms else format_bytes(saving),
            f"{c.device_allocs:,} / {c.device_frees:,}",
            f"{c.alloc_retries:,}",
            "\n".join(c.flags),
        )
    console.print(table)
    hidden = len(result.candidates) - len(shown)
    if hidden > 0:
        console.print(f"{hidden} more setting(s) ranked lower; --json lists them all.")
    # The legend of the flags in the table; the rows left out carry theirs in --json.
    for flag in sorted({f for c in shown for f in c.flags}):
        console.print(f"[bold]{flag}[/]: {as_written(FLAG_REASONS.get(flag, flag))}")
    for warning in result.warnings:
        _print_warning(console, warning)
    if recorded:
        console.print(
            f"The workload was recorded under PYTORCH_CUDA_ALLOC_CONF={as_written(recorded)}."
        )
    best = result.best
    if best is None:
        console.print(
            "No setting can be recommended: every candidate runs out of memory or is ruled out."
        )
    elif result.default_is_best:
        console.print(
            f"Best: the default is already best (peak reserved {format_bytes(baseline.peak_reserved_bytes)})."
        )
    else:
        calls = baseline.device_calls - best.device_calls
        line = (
            f"Best: PYTORCH_CUDA_ALLOC_CONF={as_written(best.alloc_conf)}  saves "
            f"{format_bytes(result.saving_bytes)} of peak reserved over the default"
        )
        if result.saving_bytes == 0 and calls > 0:
            line += f" and {calls:,} cudaMalloc/cudaFree call(s)"
        console.print(line + ".", soft_wrap=True)


def _print_warning(console: Console, warning: str) -> None:
    """A warning, or, for default settings the snapshot's torch does not take, an info line."""
    from oomkit.interfaces.reports._untrusted import as_written
    from oomkit.plan.tuning import NOT_SWEPT

    if warning.startswith(NOT_SWEPT):
        console.print(f"[dim]info: {as_written(warning)}[/dim]", soft_wrap=True)
    else:
        console.print(f"[yellow]warning:[/] {as_written(warning)}")

"""Rendering of ``Prediction`` records: the one-line verdict, rich tables and JSON.

The verdict and the plain-text summary (``str(prediction)``) live below, in
``oomkit.prediction.summary``, so that a ``Prediction`` prints itself without this layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from oomkit.core.target import Target
from oomkit.diagnose.diagnosis import Remedy
from oomkit.diagnose.measured_remedy import MeasuredRemedy
from oomkit.interfaces.reports.diagnosis import remedy_to_json
from oomkit.prediction.module_groups import group_modules
from oomkit.prediction.predictor import TOP_MODULES, PeakBreakdown, Prediction
from oomkit.prediction.summary import (
    COMPILED_EAGERLY,
    DEFAULT_PREFIX,
    header_line,
    module_label,
    nothing_recorded,
    prediction_summary,
    rank_peak_lines,
    verdict_line,
)
from oomkit.prediction.workload import workload_to_json
from oomkit.units import format_bytes

__all__ = [
    "COMPILED_EAGERLY",
    "RANK_GROUPS",
    "kernels_line",
    "prediction_summary",
    "prediction_to_json",
    "rank_memory",
    "remedy_line",
    "render_prediction",
    "render_remedies",
    "split_warnings",
    "target_to_json",
    "verdict_line",
]

# What a row of the breakdown table calls reserved memory that holds no live tensor.
CACHED_LABEL = "cached, not allocated"

# The per-rank view of a distributed prediction groups the recorder's categories
# (prediction/tracing/categories.py CATEGORIES); what none names is "other" (buffers, cuBLAS
# and cuDNN workspaces, autocast's weight casts).
RANK_GROUPS: dict[str, tuple[str, ...]] = {
    # FSDP2 holds these as 1/N shards (DTensor local shards, padded); DDP replicates them.
    "states": ("parameter", "gradient", "optimizer_state"),
    # FSDP2's unsharded all-gather outputs and its reduce-scatter inputs/outputs.
    "collective_buffers": ("allgather_buffer", "reduce_scatter_buffer"),
    "activations": ("activation", "temporary", "input"),
}
_GROUP_TITLES = {
    "states": "model states (parameters, gradients, optimizer; sharded under FSDP)",
    "collective_buffers": "unsharded all-gather / reduce-scatter buffers",
    "activations": "activations, temporaries and inputs",
    "other": "other (buffers, workspaces, autocast casts)",
}


def rank_memory(prediction: Prediction) -> dict[str, object] | None:
    """Rank 0's memory at the peak-allocated moment of a distributed prediction.

    Returns:
        ``None`` for a one-GPU prediction; else ``rank`` (0), ``world_size``, ``fsdp`` /
        ``tp`` / ``dp``, ``allocated_bytes`` and ``reserved_bytes`` at the peak,
        ``by_group_bytes`` (:data:`RANK_GROUPS` and ``other``, summing to ``allocated_bytes``)
        and ``by_stream``: per CUDA stream id (0: the default stream), its allocated bytes and
        their categories.
    """
    target = prediction.target
    if target is None or target.parallel is None:
        return None
    at = prediction.peak_allocated_at
    groups = {name: 0 for name in (*RANK_GROUPS, "other")}
    for category, nbytes in at.by_category_bytes.items():
        group = next((g for g, names in RANK_GROUPS.items() if category in names), "other")
        groups[group] += nbytes
    layout = target.parallel
    saved = (prediction.scenario or {}).get("parallel") or {}
    return {
        "rank": saved.get("rank") or 0,  # --rank R (scenario/ranks.py); rank 0 by default
        "world_size": layout.world_size,
        "fsdp": layout.fsdp,
        "tp": layout.tp,
        "dp": layout.dp,
        "allocated_bytes": at.allocated_bytes,
        "reserved_bytes": at.reserved_bytes,
        "by_group_bytes": groups,
        "by_stream": [
            {
                "stream": stream,
                "allocated_bytes": sum(categories.values()),
                "by_category_bytes": dict(categories),
            }
            for stream, categories in at.by_stream_category_bytes.items()
        ],
    }


def _rank_tables(memory: Mapping[str, object]) -> tuple[Table, Table]:
    groups = memory["by_group_bytes"]
    streams = memory["by_stream"]
    assert isinstance(groups, dict) and isinstance(streams, list)
    allocated = int(str(memory["allocated_bytes"]))
    title = f"Rank {memory['rank']} of {memory['world_size']} at peak allocated, by kind"
    kinds = Table(title=title, show_header=True, header_style="bold")
    kinds.add_column("memory")
    kinds.add_column("bytes", justify="right")
    kinds.add_column("% of allocated", justify="right")
    for group, nbytes in groups.items():
        kinds.add_row(_GROUP_TITLES[group], format_bytes(nbytes), _pct(nbytes, allocated))
    by_stream = Table(
        title=f"Rank {memory['rank']} at peak allocated, by CUDA stream",
        show_header=True,
        header_style="bold",
    )
    by_stream.add_column("stream")
    by_stream.add_column("category")
    by_stream.add_column("bytes", justify="right")
    for row in streams:
        name = "0 (default)" if row["stream"] == 0 else str(row["stream"])
        by_stream.add_row(name, "all", format_bytes(row["allocated_bytes"]), style="bold")
        for category, nbytes in row["by_category_bytes"].items():
            by_stream.add_row("", category, format_bytes(nbytes))
    return kinds, by_stream


def kernels_line(prediction: Prediction) -> str:
    """``kernels as on compute capability 9.0, cuDNN 9.20.0 (torch 2.13's default Linux
    wheel): SDPA cudnn_attention (24 calls)``: what the recording assumed the GPU runs."""
    major, minor = prediction.gpu.kernel_compute_capability
    target = ", ".join(
        [f"compute capability {major}.{minor}"]
        + [
            f"{name} {value}"
            for name, value in prediction.assumptions.items()
            if not _is_value_assumption(name) and not name.startswith(DEFAULT_PREFIX)
        ]
    )
    choices = "; ".join(
        f"{choice} ({count} call{'s' if count != 1 else ''})"
        for choice, count in prediction.kernel_choices.items()
    )
    return f"kernels as on {target}: {choices}"


def _is_value_assumption(name: str) -> bool:
    # Tensor values the trace answered (oomkit.prediction.tracing.read_report), the memory
    # counters the step read, the memory fraction and allocator setting it set
    # (tracing/step_memory.py, prediction/scripts.py), a fast path not taken (read_report.py),
    # a script stopped after its steps (script_run.py): their own lines.
    return name.startswith(("read at ", "torch.cuda ")) or name in (
        "finite values", "generation length", "memory fraction", "allocator setting",
        "TransformerEncoder fast path", "script stopped",
    )


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def _breakdown_table(at: PeakBreakdown, title: str) -> Table:
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("category")
    table.add_column("bytes", justify="right")
    table.add_column("%", justify="right")
    whole = max(at.reserved_bytes, at.allocated_bytes)
    for category, nbytes in at.by_category_bytes.items():
        table.add_row(category, format_bytes(nbytes), _pct(nbytes, whole))
    cached = at.reserved_bytes - at.allocated_bytes
    if cached > 0:
        table.add_row(CACHED_LABEL, format_bytes(cached), _pct(cached, whole))
    table.add_row("reserved", format_bytes(at.reserved_bytes), _pct(at.reserved_bytes, whole))
    return table


def _modules_table(at: PeakBreakdown) -> Table:
    """The largest modules at the peak, repeated layers merged into one row
    (``h.0-11.mlp.c_fc (12 layers, 91.54 MiB each)``), and a row counting what is left out."""
    table = Table(title="Top modules at peak allocated", show_header=True, header_style="bold")
    table.add_column("module")
    table.add_column("bytes", justify="right")
    table.add_column("% of allocated", justify="right")
    groups = group_modules(at.modules or at.top_modules)
    for group in groups[:TOP_MODULES]:
        label = group.describe() if group.layers > 1 else module_label(group.label)
        table.add_row(
            escape(label),
            format_bytes(group.total_bytes),
            _pct(group.total_bytes, at.allocated_bytes),
        )
    left_out = groups[TOP_MODULES:]
    if left_out:
        nbytes = sum(g.total_bytes for g in left_out)
        modules = sum(g.layers for g in left_out)
        table.add_row(
            f"({len(left_out)} more row{'s' if len(left_out) != 1 else ''}: "
            f"{modules} module{'s' if modules != 1 else ''} left out)",
            format_bytes(nbytes),
            _pct(nbytes, at.allocated_bytes),
        )
    if at.unattributed_bytes:
        table.add_row(
            "(outside any module)",
            format_bytes(at.unattributed_bytes),
            _pct(at.unattributed_bytes, at.allocated_bytes),
        )
    return table


def _steps_table(prediction: Prediction) -> Table:
    table = Table(title="Peaks per step", show_header=True, header_style="bold")
    table.add_column("step", justify="right")
    table.add_column("peak allocated", justify="right")
    table.add_column("peak reserved", justify="right")
    for s in prediction.step_peaks:
        table.add_row(
            str(s.step), format_bytes(s.peak_allocated_bytes), format_bytes(s.peak_reserved_bytes)
        )
    return table


def _is_entry_point(frame: str) -> bool:
    # A preset has no user frame: the tracer's nearest outside frame is the `oomkit` script.
    filename = frame.rsplit(":", 1)[0]
    return filename.replace("\\", "/").rsplit("/", 1)[-1] in ("oomkit", "__main__.py")


def render_prediction(
    prediction: Prediction, console: Console, remedies: Sequence[Remedy] = ()
) -> None:
    """Print a prediction: the setting, the breakdown at peak, top modules, the OOM message,
    warnings (benign notes on one info line), the top remedies, and the verdict last.

    Args:
        prediction: what to print.
        console: where.
        remedies: for a step that does not fit, its ranked remedies
            (``oomkit.diagnose.prediction_remedies``); the first three are printed.

    ``oomkit.render_prediction(p, rich.console.Console())`` prints what ``oomkit predict``
    prints; ``print(p)`` prints the shorter ``prediction_summary``.
    """
    p = prediction
    console.print(header_line(p), markup=False)
    if p.target is not None and p.target.cuda_context is not None:
        console.print(f"CUDA context assumed: {p.target.context_description}", soft_wrap=True)
    if p.distributed is not None:  # NCCL's buffers, the GPU's timing (distributed_memory.py)
        for line in p.distributed.lines():
            console.print(escape(line), soft_wrap=True, highlight=False)
        for note in (*p.distributed.nccl_notes, *filter(None, [p.distributed.timing_note])):
            console.print(f"[dim]note: {escape(note)}[/dim]", soft_wrap=True)
    if p.kernel_choices:
        console.print(kernels_line(p), highlight=False)
    at = p.peak_allocated_at
    # A run with no step at all (an inference script) is one run, not a set-up before steps.
    when = (
        f"step {at.step}" if at.step is not None
        else "before the first step" if p.steps else "the whole run"
    )
    console.print(_breakdown_table(at, f"Memory at peak allocated ({when})"))
    memory = rank_memory(p)
    if memory is not None:
        for table in _rank_tables(memory):
            console.print(table)
    if at.top_modules or at.unattributed_bytes:
        console.print(_modules_table(at))
    if len(p.step_peaks) > 1:
        console.print(_steps_table(p))
    if p.oom is not None:
        if p.oom.frame and not _is_entry_point(p.oom.frame):
            console.print(f"from {escape(p.oom.frame)}")
        console.print(escape(p.oom.message), soft_wrap=True)
    for line in rank_peak_lines(p):  # --all-ranks: each distinct rank's peak
        console.print(line, markup=False, highlight=False)
    for name, value in p.assumptions.items():
        if _is_value_assumption(name):
            console.print(f"assumed: {escape(name)}: {escape(value)}", soft_wrap=True)
    actionable, info = split_warnings(p.warnings)
    for warning in actionable:
        console.print(f"[yellow]warning:[/] {escape(warning)}", soft_wrap=True)
    if info:
        console.print(f"[dim]info: {escape(info)}[/dim]", soft_wrap=True)
    if remedies:
        render_remedies(remedies, console)
    # The verdict is the last line: what a person reads, and what `| tail -1` keeps.
    good = p.fits and p.within_budget is not False and not nothing_recorded(p)
    style = "bold green" if good else "bold red"
    console.print(f"[{style}]{escape(verdict_line(p))}[/]")


# Warnings a user cannot act on: (what marks one, what the info line calls it). cuDNN sizes its
# attention workspace at run time (cudnn/MHA.cpp run_cudnn_SDP_fprop / bprop) on every H100
# prediction; a value read that was only logged or printed (a library's own ``.item()``
# logging) decides no size.
_BENIGN: tuple[tuple[str, str], ...] = (
    ("CUDA memory is emulated except any workspace the cuDNN", "cuDNN attention workspaces "
     "are sized by cuDNN at run time and not included"),
    ("never used as a size, a loop bound or a condition", "tensor values read only for "
     "logging got stand-ins"),
)


def split_warnings(warnings: Sequence[str]) -> tuple[list[str], str]:
    """The warnings a user can act on, and one info line for the rest (``""`` when none).

    Benign notes (cuDNN attention workspaces, values only logged) are merged, each
    named once with its count: ``"cuDNN attention workspaces ... (2 notes); ..."``.
    """
    actionable: list[str] = []
    counts: dict[str, int] = {}
    for warning in warnings:
        label = next((label for mark, label in _BENIGN if mark in warning), None)
        if label is None:
            actionable.append(warning)
        else:
            counts[label] = counts.get(label, 0) + 1
    info = "; ".join(
        label if n == 1 else f"{label} ({n} notes)" for label, n in counts.items()
    )
    return actionable, info


def render_remedies(remedies: Sequence[Remedy], console: Console, top: int = 3) -> None:
    """Print the first ``top`` remedies of a step that does not fit, one line each.

    ``remedies`` come ranked from ``oomkit.diagnose.remedy_measurement.prediction_remedies``
    (those that make the step fit first); each line says what it needs and whether it fits,
    measured by re-prediction: ``1. pure bf16 weights, gradients and optimizer states
    (--precision bf16) — needs 76.02 GiB reserved, fits, saves 91.71 GiB``.
    """
    shown = list(remedies)[:top]
    if not shown:
        return
    console.print("[bold]What would make it fit[/] (measured by re-predicting the step):")
    for number, remedy in enumerate(shown, 1):
        console.print(f"  {escape(remedy_line(number, remedy))}", soft_wrap=True)


def remedy_line(number: int, remedy: Remedy) -> str:
    """``2. LoRA adapters ... — needs 57.49 GiB reserved, fits (saves 110.25 GiB)``."""
    measured = remedy if isinstance(remedy, MeasuredRemedy) else None
    fits = None if measured is None else measured.fits
    peak = None if measured is None else measured.peak_reserved_bytes
    parts = []
    if peak is not None:
        parts.append(f"needs {format_bytes(peak)} reserved")
    if fits is not None:
        parts.append("fits" if fits else "still does not fit")
    if remedy.saving_bytes:
        parts.append(f"saves {'~' if remedy.estimate else ''}{format_bytes(remedy.saving_bytes)}")
    flag = f" ({measured.flag})" if measured is not None and measured.flag else ""
    head = f"{number}. {remedy.title}{flag}"
    return f"{head} — {', '.join(parts)}" if parts else head


def _plain(value: object) -> object:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _module_rows(rows: object) -> list[dict[str, object]]:
    assert isinstance(rows, list)  # _plain made the tuples lists
    return [{"module": path, "bytes": nbytes} for path, nbytes in rows]


def target_to_json(target: Target) -> dict[str, object]:
    """The saved ``target``: the GPU's name, the allocator setting and the versions modelled
    (the GPU's figures are the prediction's ``gpu``, ``capacity_bytes``... as before)."""
    return {
        "gpu": target.gpu.name,
        "alloc_conf": target.alloc_conf,
        "context_overhead_bytes": target.context_overhead_bytes,
        "usable_bytes": target.usable_bytes,
        "torch_version": target.torch_version,
        "cudnn_version": target.cudnn_version,
        "cuda_version": target.cuda_version,
        "cuda_module_loading": (
            None if target.cuda_context is None else target.cuda_context.module_loading
        ),
        "cuda_context": target.context_description,
        "parallel": None if target.parallel is None else dataclasses.asdict(target.parallel),
    }


def prediction_to_json(
    prediction: Prediction, workload: Mapping | None = None, remedies: Sequence[Remedy] = ()
) -> dict:
    """Every field of the prediction as one JSON-ready object (bytes as ints), plus the verdict.

    Args:
        prediction: the prediction.
        workload: what was predicted, as a ready-made ``workload`` object; default: the
            prediction's own ``workload`` record (``workload_to_json``: ``kind``, ``name``,
            ``options``, ``steps``, and for a preset ``preset``, which ``oomkit explain``
            re-predicts with a change applied). No key when neither is known.
        remedies: measured remedies of a step that does not fit
            (``oomkit.diagnose.prediction_remedies``): saved as ``remedies``, each with
            ``fits`` and ``peak_reserved_bytes`` (``remedy_to_json``); no key when empty.
    """
    plain = {
        key: _plain(value)
        for key, value in dataclasses.asdict(prediction).items()
        if key not in ("target", "workload", "scenario")
        # --all-ranks' per-rank peaks: only where there are several ranks (scenario/ranks.py)
        and not (key == "rank_peaks" and not prediction.rank_peaks)
    }
    out: dict[str, object] = dict(plain)
    for key in ("peak_allocated_at", "peak_reserved_at"):
        at = plain[key]
        assert isinstance(at, dict)
        out[key] = at | {
            "top_modules": _module_rows(at["top_modules"]),
            "modules": _module_rows(at["modules"]),
        }
    out["top_modules"] = _module_rows(plain["top_modules"])
    # A step that allocated nothing on the device did not "fit": nothing was predicted.
    empty = nothing_recorded(prediction)
    out["nothing_recorded"] = empty
    out["fits"] = prediction.fits and not empty
    out["verdict"] = verdict_line(prediction)
    memory = rank_memory(prediction)
    if memory is not None:
        out["per_rank"] = memory
    target = prediction.target
    if target is not None:
        out["target"] = target_to_json(target)
    if workload is None and prediction.workload is not None:
        cudnn = None if target is None else target.cudnn_version
        workload = workload_to_json(prediction.workload, cudnn)
    if workload is not None:
        out["workload"] = _plain(workload)
    if prediction.scenario is not None:  # the request that made it: explain re-predicts from it
        out["scenario"] = _plain(prediction.scenario)
    if remedies:
        out["remedies"] = [remedy_to_json(r) for r in remedies]
    return out

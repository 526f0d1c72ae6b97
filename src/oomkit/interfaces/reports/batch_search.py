"""Rendering of batch-size searches: the memory-vs-batch curve, the verdict line, and JSON.

Also the reverse question's table: which catalog GPUs one batch fits on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from oomkit.errors import NoFeasibleBatchSizeError
from oomkit.plan.batch_search import BatchProbe, BatchSearchResult, SmallestGpuResult
from oomkit.units import format_bytes

if TYPE_CHECKING:
    from oomkit.scenario.alternatives import FitAlternative

__all__ = [
    "batch_search_to_json",
    "batch_search_verdict",
    "infeasible_to_json",
    "render_alternatives",
    "render_batch_search",
    "render_smallest_gpu",
    "smallest_gpu_to_json",
    "smallest_gpu_verdict",
    "unmeasured_advice",
]


def infeasible_to_json(
    error: NoFeasibleBatchSizeError,
    gpu_name: str,
    alternatives: Sequence[FitAlternative] = (),
) -> dict[str, object]:
    """`fit --json` when not even the smallest batch fits: ``batch_size`` null, the message
    (its first sentence when changes were measured: their rows replace its advice), the
    figures it gives (what that batch needs reserved, what is usable, the margin) and, when
    searched, the largest batch with each change (``alternatives``: its ``flags`` and
    ``settings`` (``section.key`` -> value, as ``--set`` takes them), ``batch_size`` null
    where not even batch 1 fits with it; ``peak_reserved_bytes`` then batch 1's need)."""
    # With the changes measured, the message's unmeasured "Try ..." gives way to them.
    message = error.reason if alternatives else str(error)
    out: dict[str, object] = {"batch_size": None, "gpu": gpu_name, "error": message}
    for name in ("needed_reserved_bytes", "usable_bytes", "margin_bytes"):
        value = getattr(error, name, None)
        if value is not None:
            out[name] = value
    if alternatives:
        out["alternatives"] = [
            {
                "change": a.title,
                "flags": a.flags,
                "settings": dict(a.settings),
                "combined": a.combined,
                "batch_size": a.batch_size,
                "peak_reserved_bytes": a.peak_reserved_bytes,
            }
            for a in alternatives
        ]
        out["not_measured"] = list(unmeasured_advice(error, alternatives))
    return out


def unmeasured_advice(
    error: NoFeasibleBatchSizeError, alternatives: Sequence[FitAlternative]
) -> tuple[str, ...]:
    """The error's advice that no change measured alone applies: an item ends with its flag in
    parentheses ("activation checkpointing (--checkpointing full)"), measured when its words
    run in a change's flags ("--lora 8" in "--lora 8 --precision bf16-mixed"; "--precision
    bf16" is not in "--precision bf16-mixed")."""
    measured = [a.flags.split() for a in alternatives if not a.combined]

    def applied(item: str) -> bool:
        if not item.endswith(")") or "(" not in item:
            return False
        words = item[item.rindex("(") + 1 : -1].split()
        return any(
            flags[start : start + len(words)] == words
            for flags in measured
            for start in range(len(flags))
        )

    return tuple(item for item in error.advice if not applied(item))


def render_alternatives(
    error: NoFeasibleBatchSizeError,
    alternatives: Sequence[FitAlternative],
    console: Console,
    *,
    sharded: bool = False,
) -> None:
    """Not even batch 1 fits: the largest batch with each change, measured, as a table; then
    what was not measured, the margin and a larger GPU (``sharded``: a parallel layout's
    search, which ``--smallest-gpu`` does not take; ``--global-batch`` tabulates counts)."""
    table = Table(
        title="Each change, searched again: the largest batch that fits",
        show_header=True,
        header_style="bold",
    )
    table.add_column("change")
    table.add_column("flags", no_wrap=True)  # copied as one line
    table.add_column("largest batch", justify="right")
    table.add_column("peak reserved", justify="right")
    for a in alternatives:
        need = "" if a.peak_reserved_bytes is None else format_bytes(a.peak_reserved_bytes)
        if a.batch_size is None:
            # No figure: batch 1's run (--lengths) runs out of memory part-way.
            batch, need = "none", f"batch 1 needs {need}" if need else "batch 1 runs out part-way"
        else:
            batch = str(a.batch_size)
        table.add_row(escape(a.title), escape(a.flags), batch, need)
    console.print(table)
    fitting = [a for a in alternatives if a.batch_size is not None]
    if fitting:
        best = max(fitting, key=lambda a: a.batch_size or 0)
        console.print(
            f"[bold green]with {escape(best.flags)}: batch {best.batch_size} fits (peak reserved "
            f"{format_bytes(best.peak_reserved_bytes or 0)})[/]"
        )
    else:
        console.print("[bold red]no change searched here fits even batch 1[/]")
    larger = (
        "more GPUs or GPUs with more memory (--smallest-gpu --global-batch B, without "
        "--fsdp/--tp/--dp, tabulates both)" if sharded
        else "a GPU with more memory (--batch 1 --smallest-gpu names the smallest)"
    )
    rest = [*unmeasured_advice(error, alternatives), "a smaller margin (--margin)", larger]
    console.print(f"not measured: {escape(', '.join(rest))}", soft_wrap=True)


def _margin_text(margin_bytes: int, is_default: bool) -> str:
    return f"margin {format_bytes(margin_bytes)}" + (" (default)" if is_default else "")


def batch_search_verdict(result: BatchSearchResult) -> str:
    """One line a person reads first.

    ``largest batch that fits on RTX 4090: 12 (peak reserved 21.30 GiB, margin 480.00 MiB,
    5 traces, 12 interpolated)``
    """
    r = result
    interpolated = f", {r.synthesized} interpolated" if r.synthesized else ""
    sizes = ""
    if r.power_of_two:
        sizes = " (powers of two" + (f" times {r.multiple_of}" if r.multiple_of else "") + ")"
    elif r.multiple_of:
        sizes = f" (multiples of {r.multiple_of})"
    clean = " without allocator retries" if r.with_retries_batch_size is not None else ""
    line = (
        f"largest batch{sizes} that fits on {r.gpu.name}{clean}: {r.batch_size} (peak reserved "
        f"{format_bytes(r.peak_reserved_bytes)}, margin {format_bytes(r.margin_bytes)}, "
        f"{r.traces} trace{'s' if r.traces != 1 else ''}{interpolated})"
    )
    if r.with_retries_batch_size is not None:
        count = r.with_retries_count
        line += (
            f"; {r.with_retries_batch_size} fits only with the allocator freeing its cache and "
            f"retrying ({count} retr{'ies' if count != 1 else 'y'})"
        )
    if r.non_monotonic is not None:
        fits, fails = r.non_monotonic
        line += f"; not monotonic: {fits} fits, {fails} does not (see the warning)"
    if r.first_failing_batch is not None:
        line += f"; at batch {r.first_failing_batch}, {r.limiting_step} does not fit"
    elif r.memory_stops_growing_at is not None and r.memory_stops_growing_at == r.batch_size:
        n = r.memory_stops_growing_at
        line += (
            f"; from batch {n} up every batch allocates exactly the same (no larger batch is "
            f"made: a dataset of at most {n} examples, or a cap in the code)"
        )
    else:
        line += f"; the search stopped at --max-batch {r.max_batch}"
    return line


def _curve_table(result: BatchSearchResult) -> Table:
    table = Table(title="Memory vs batch size", show_header=True, header_style="bold")
    table.add_column("batch", justify="right")
    table.add_column("peak reserved", justify="right")
    table.add_column("headroom", justify="right")
    table.add_column("fits")
    table.add_column("limited by")
    for probe in result.curve:
        mark = " <" if probe.batch_size == result.batch_size else ""
        retries = _probe_json(probe)["num_alloc_retries"]
        fits = "no" if not probe.fits else "yes" if not retries else f"yes, {retries} retr" + (
            "ies" if retries != 1 else "y"
        )
        table.add_row(
            f"{probe.batch_size}{mark}",
            format_bytes(probe.peak_reserved_bytes),
            format_bytes(probe.headroom_bytes),
            fits,
            probe.limiting_step,
        )
    return table


def render_batch_search(result: BatchSearchResult, console: Console) -> None:
    """Print a search: the setting, the curve of every batch tried, the verdict, warnings."""
    r = result
    console.print(
        f"{r.description or 'step'} on {r.gpu.name} ({format_bytes(r.capacity_bytes)} total, "
        f"{format_bytes(r.context_overhead_bytes)} outside PyTorch, "
        f"{_margin_text(r.margin_bytes, r.margin_is_default)}, "
        f"allocator settings: {r.alloc_conf or 'default'}, {r.steps} training steps per probe)"
    )
    console.print(_curve_table(r))
    for warning in r.warnings:
        console.print(f"[yellow]warning:[/] {warning}", soft_wrap=True)
    # The verdict is the last line.
    console.print(f"[bold green]{batch_search_verdict(r)}[/]")


def _probe_json(probe: BatchProbe) -> dict:
    retries = max(
        probe.train.num_alloc_retries, probe.eval.num_alloc_retries if probe.eval else 0
    )
    return {
        "batch_size": probe.batch_size,
        "fits": probe.fits,
        "num_alloc_retries": retries,
        "peak_reserved_bytes": probe.peak_reserved_bytes,
        "peak_allocated_bytes": probe.peak_allocated_bytes,
        "headroom_bytes": probe.headroom_bytes,
        "limiting_step": probe.limiting_step,
        "synthesized": probe.synthesized,
    }


def batch_search_to_json(result: BatchSearchResult) -> dict:
    """The search as one JSON-ready object (bytes as ints), with the curve and the verdict.

    The per-probe predictions are left out; ``oomkit predict --batch N`` shows one in full.
    """
    r = result
    return {
        "batch_size": r.batch_size,
        "gpu": dataclasses.asdict(r.gpu),
        "alloc_conf": r.alloc_conf,
        "capacity_bytes": r.capacity_bytes,
        "context_overhead_bytes": r.context_overhead_bytes,
        "usable_bytes": r.usable_bytes,
        "margin_bytes": r.margin_bytes,
        "margin_is_default": r.margin_is_default,
        "peak_reserved_bytes": r.peak_reserved_bytes,
        "peak_allocated_bytes": r.peak_allocated_bytes,
        "headroom_bytes": r.headroom_bytes,
        "limiting_step": r.limiting_step,
        "first_failing_batch": r.first_failing_batch,
        "with_retries_batch_size": r.with_retries_batch_size,
        "with_retries_count": r.with_retries_count,
        "non_monotonic": None if r.non_monotonic is None else list(r.non_monotonic),
        "multiple_of": r.multiple_of,
        "power_of_two": r.power_of_two,
        "curve": [_probe_json(p) for p in r.curve],
        "probe_order": list(r.probe_order),
        "traces": r.traces,
        "synthesized": r.synthesized,
        "steps": r.steps,
        "max_batch": r.max_batch,
        "memory_stops_growing_at": r.memory_stops_growing_at,
        "description": r.description,
        "warnings": list(r.warnings),
        "verdict": batch_search_verdict(r),
    }


def smallest_gpu_verdict(result: SmallestGpuResult) -> str:
    """``smallest GPU batch 16 fits on: T4 (14.76 GiB total, 3.10 GiB headroom)``, or none."""
    what = "it" if result.batch_size is None else f"batch {result.batch_size}"
    fit = next((f for f in result.candidates if f.fits), None)
    if fit is None:
        largest = result.candidates[-1]
        return (
            f"{what} fits on none of the {len(result.candidates)} GPUs checked: on the largest, "
            f"{largest.gpu.name}, it needs {format_bytes(largest.peak_reserved_bytes)} of "
            f"{format_bytes(largest.usable_bytes)} usable with a "
            f"{format_bytes(largest.margin_bytes)} margin"
        )
    return (
        f"smallest GPU {what} fits on: {fit.gpu.name} ({format_bytes(fit.gpu.total_memory_bytes)} "
        f"total, {format_bytes(fit.headroom_bytes)} headroom, margin {format_bytes(fit.margin_bytes)})"
    )


def render_smallest_gpu(result: SmallestGpuResult, console: Console) -> None:
    """Print every GPU checked (by memory) with fit and headroom, then the smallest fit."""
    if result.description:
        console.print(f"{result.description} on {len(result.candidates)} GPUs")
    table = Table(title="Fit by GPU", show_header=True, header_style="bold")
    table.add_column("GPU")
    table.add_column("total", justify="right")
    table.add_column("needs", justify="right")
    table.add_column("headroom", justify="right")
    table.add_column("margin", justify="right")
    table.add_column("fits")
    for fit in result.candidates:
        table.add_row(
            fit.gpu.name,
            format_bytes(fit.gpu.total_memory_bytes),
            format_bytes(fit.peak_reserved_bytes),
            format_bytes(fit.headroom_bytes),
            format_bytes(fit.margin_bytes),
            "yes" if fit.fits else "no",
        )
    console.print(table)
    style = "bold green" if result.smallest is not None else "bold red"
    console.print(f"[{style}]{smallest_gpu_verdict(result)}[/]")
    for warning in result.warnings:
        console.print(f"[yellow]warning:[/] {warning}", soft_wrap=True)


def smallest_gpu_to_json(result: SmallestGpuResult) -> dict:
    """The reverse question's answer as one JSON-ready object, with the verdict."""
    return {
        "batch_size": result.batch_size,
        "smallest": None if result.smallest is None else result.smallest.name,
        "candidates": [
            {
                "gpu": fit.gpu.name,
                "total_memory_bytes": fit.gpu.total_memory_bytes,
                "usable_bytes": fit.usable_bytes,
                "fits": fit.fits,
                "peak_reserved_bytes": fit.peak_reserved_bytes,
                "headroom_bytes": fit.headroom_bytes,
                "margin_bytes": fit.margin_bytes,
                "limiting_step": fit.limiting_step,
            }
            for fit in result.candidates
        ],
        "margin_bytes": result.margin_bytes,
        "traces": result.traces,
        "description": result.description,
        "warnings": list(result.warnings),
        "verdict": smallest_gpu_verdict(result),
    }

"""Rendering of ``GpuCountResult``: how many GPUs of which kind a global batch needs (FSDP2)."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from oomkit.plan.smallest_gpu import GpuCountResult
from oomkit.units import format_bytes

__all__ = ["gpu_count_to_json", "gpu_count_verdict", "render_gpu_count"]


def gpu_count_verdict(result: GpuCountResult) -> str:
    """One line: the configuration with the least total memory, or that none fits."""
    if result.least_memory is None:
        largest = result.rows[-1].gpu_count
        return (
            f"global batch {result.global_batch} fits on no catalog GPU at any count up to "
            f"{largest}: raise --max-gpus, shrink the batch, or add --checkpointing"
        )
    count, gpu = result.least_memory
    per_rank = result.global_batch // count
    return (
        f"global batch {result.global_batch} fits on {count} x {gpu.name} (per-rank batch "
        f"{per_rank}; {format_bytes(count * gpu.total_memory_bytes)} in all, the least GPU "
        "memory of any fit)"
    )


def render_gpu_count(result: GpuCountResult, console: Console) -> None:
    """The table (GPU per row, count per column: headroom or OOM) and the verdict."""
    table = Table(
        title=f"Global batch {result.global_batch} under FSDP2: rank 0's headroom per GPU count",
        show_header=True,
        header_style="bold",
    )
    table.add_column("GPU")
    for row in result.rows:
        label = f"{row.gpu_count} GPU{'s' if row.gpu_count > 1 else ''}"
        table.add_column(f"{label}\nbatch {row.per_rank_batch}/rank", justify="right")
    table.add_column("fewest", justify="right")
    names = [fit.gpu for fit in result.rows[0].candidates]
    for index, gpu in enumerate(names):
        cells = []
        for row in result.rows:
            fit = row.candidates[index]
            cells.append(format_bytes(fit.headroom_bytes) if fit.fits else "OOM")
        fewest = result.fewest.get(gpu.name)
        table.add_row(escape(gpu.name), *cells, "-" if fewest is None else str(fewest))
    console.print(table)
    if result.skipped_counts:
        skipped = ", ".join(str(n) for n in result.skipped_counts)
        console.print(f"skipped GPU counts that do not divide {result.global_batch}: {skipped}")
    console.print(
        "1 GPU is the plain step (no FSDP); N > 1: FSDP2 per block + root, rank 0", highlight=False
    )
    good = result.least_memory is not None
    style = "bold green" if good else "bold red"
    console.print(f"[{style}]{escape(gpu_count_verdict(result))}[/]")
    for warning in result.warnings:
        console.print(f"[yellow]warning:[/] {escape(warning)}", soft_wrap=True)


def gpu_count_to_json(result: GpuCountResult) -> dict:
    """Every row and GPU with bytes as ints, the answers and the verdict."""
    least = result.least_memory
    return {
        "global_batch": result.global_batch,
        "rows": [
            {
                "gpu_count": row.gpu_count,
                "per_rank_batch": row.per_rank_batch,
                "description": row.description,
                "smallest": None if row.smallest is None else row.smallest.name,
                "candidates": [
                    {
                        "gpu": fit.gpu.name,
                        "fits": fit.fits,
                        "headroom_bytes": fit.headroom_bytes,
                        "peak_reserved_bytes": fit.peak_reserved_bytes,
                        "usable_bytes": fit.usable_bytes,
                        "margin_bytes": fit.margin_bytes,
                    }
                    for fit in row.candidates
                ],
            }
            for row in result.rows
        ],
        "skipped_counts": list(result.skipped_counts),
        "fewest": dict(result.fewest),
        "least_memory": None if least is None else {"gpu_count": least[0], "gpu": least[1].name},
        "traces": result.traces,
        "margin_bytes": result.margin_bytes,
        "verdict": gpu_count_verdict(result),
        "warnings": list(result.warnings),
    }

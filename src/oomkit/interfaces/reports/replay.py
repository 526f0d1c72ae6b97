"""Rendering of ``ReplayResult`` records: JSON objects and rich tables."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from oomkit.core.replay import ReplayResult
from oomkit.units import format_bytes

if TYPE_CHECKING:
    # rich is imported by the renderers only: `oomkit replay --json` never loads it.
    from rich.console import Console
    from rich.table import Table

__all__ = [
    "comparison_table",
    "render_replay",
    "replay_to_json",
    "what_if_table",
    "what_if_to_json",
]


def _segments_to_json(segments: Sequence[dict]) -> list[dict]:
    return [
        {
            "address": seg["address"],
            "total_size": seg["total_size"],
            "stream": seg.get("stream", 0),
            "segment_type": seg.get("segment_type"),
            "is_expandable": seg.get("is_expandable", False),
            "blocks": [
                {"address": b["address"], "size": b["size"], "state": b["state"]}
                for b in seg["blocks"]
            ],
        }
        for seg in segments
    ]


def replay_to_json(result: ReplayResult, *, include_segments: bool = True) -> dict:
    """The replay as one JSON-ready object (the ``--json`` output of replay and simulate)."""
    divergence = result.first_divergence
    out: dict = {
        "events": result.events,
        "alloc_conf": result.alloc_conf,
        "torch_version": result.torch_version,
        "peak_allocated_bytes": result.peak_allocated_bytes,
        "peak_reserved_bytes": result.peak_reserved_bytes,
        "final_allocated_bytes": result.final_allocated_bytes,
        "final_reserved_bytes": result.final_reserved_bytes,
        "num_device_alloc": result.num_device_alloc,
        "num_device_free": result.num_device_free,
        "num_alloc_retries": result.num_alloc_retries,
        "oom": result.oom,
        "oom_event_index": result.oom_event_index,
        "oom_message": result.oom_message,
        "verified": result.verified,
        "reproduced": result.reproduced if result.verified else None,
        "segment_events_recorded": result.segment_events_recorded,
        "segment_events_matched": result.segment_events_matched,
        "allocs_checked": result.allocs_checked,
        "allocs_misplaced": result.allocs_misplaced,
        "readings_tried": result.readings_tried,
        "final_state_matches": result.final_state_matches,
        "first_divergence": None
        if divergence is None
        else {
            "segment_event_index": divergence.segment_event_index,
            "trace_event_index": divergence.trace_event_index,
            "expected": list(divergence.expected) if divergence.expected else None,
            "actual": list(divergence.actual) if divergence.actual else None,
            "context": list(divergence.context),
        },
        "recorded_peak_reserved_bytes": result.recorded_peak_reserved_bytes,
        "warnings": list(result.warnings),
    }
    if include_segments:
        out["segment_events"] = [list(e) for e in result.segment_events]
        out["final_segments"] = _segments_to_json(result.final_segments)
    return out


def render_replay(result: ReplayResult, console: Console, *, title: str = "Replay") -> None:
    """Print one replay: its verdict line, then a small table of the numbers behind it."""
    if result.oom:
        console.print(
            f"[bold red]OOM[/] at event {result.oom_event_index} "
            f"under {result.alloc_conf or 'the default settings'}"
        )
    if result.verified is False:
        console.print(
            "Verify: [bold yellow]nothing to verify[/]: the trace holds no segment decision and "
            "no allocation to compare (0 checked), so the simulator was not tested. Record the "
            "steps themselves: call torch.cuda.memory._record_memory_history() before them and "
            "_dump_snapshot after."
        )
    elif result.verified:
        matched = result.segment_events_matched
        recorded = result.segment_events_recorded
        checked = result.allocs_checked or 0
        placed = checked - (result.allocs_misplaced or 0)
        verdict = (
            "[bold green]reproduced exactly[/]" if result.reproduced else "[bold red]diverged[/]"
        )
        tried = result.readings_tried or 1
        console.print(
            f"Verify: {verdict}: {matched}/{recorded} segment decisions, {placed}/{checked} "
            "block placements match."
        )
        console.print(
            f"  final state {'matches' if result.final_state_matches else 'differs'}; "
            f"readings of the trace tried: {tried} (the best is kept)."
        )
        if result.first_divergence is not None:
            d = result.first_divergence
            console.print(
                f"  first divergence at segment event {d.segment_event_index}"
                f" (trace event {d.trace_event_index}): recorded {d.expected}, simulated {d.actual}"
            )
            for line in d.context:
                console.print(f"    {line}")
    from rich.table import Table

    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("events replayed", f"{result.events:,}")
    table.add_row("peak allocated", format_bytes(result.peak_allocated_bytes))
    table.add_row("peak reserved", format_bytes(result.peak_reserved_bytes))
    if result.recorded_peak_reserved_bytes is not None:
        table.add_row("peak reserved (as recorded)", format_bytes(result.recorded_peak_reserved_bytes))
    table.add_row("cudaMalloc / cudaFree", f"{result.num_device_alloc:,} / {result.num_device_free:,}")
    table.add_row("alloc retries", f"{result.num_alloc_retries:,}")
    console.print(table)
    for warning in result.warnings:
        console.print(f"[yellow]warning:[/] {warning}")


def comparison_table(results: Sequence[tuple[str, ReplayResult]], *, title: str) -> Table:
    """A table with one column per setting, for side-by-side what-ifs."""
    from rich.table import Table

    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("metric")
    for label, _ in results:
        table.add_column(label, justify="right")

    def row(name: str, fn) -> None:
        table.add_row(name, *(fn(r) for _, r in results))

    row("peak allocated", lambda r: format_bytes(r.peak_allocated_bytes))
    row("peak reserved", lambda r: format_bytes(r.peak_reserved_bytes))
    row(
        "peak reserved − peak allocated",
        lambda r: format_bytes(r.peak_reserved_bytes - r.peak_allocated_bytes),
    )
    row("cudaMalloc calls", lambda r: f"{r.num_device_alloc:,}")
    row("cudaFree calls", lambda r: f"{r.num_device_free:,}")
    row("alloc retries", lambda r: f"{r.num_alloc_retries:,}")
    row("out of memory", lambda r: "yes" if r.oom else "no")
    return table


def _unused_at_peak_pct(result: ReplayResult) -> float:
    """Peak reserved minus peak allocated, in percent of peak reserved (0 when nothing was
    reserved). Not called fragmentation: the two peaks may fall at different moments, while
    `diff` and `explain` measure fragmentation as reserved minus allocated at the one moment
    reserved memory peaks (TraceHistory.peak_reserved_moment)."""
    reserved = result.peak_reserved_bytes
    if reserved <= 0:
        return 0.0
    return 100.0 * (reserved - result.peak_allocated_bytes) / reserved


def what_if_to_json(results: Sequence[tuple[str, ReplayResult]]) -> list[dict]:
    """One JSON object per setting of ``replay --what-if``, in the order given."""
    return [
        {
            "alloc_conf": label,
            "events": r.events,
            "peak_allocated_bytes": r.peak_allocated_bytes,
            "peak_reserved_bytes": r.peak_reserved_bytes,
            "peak_reserved_minus_peak_allocated_bytes": r.peak_reserved_bytes
            - r.peak_allocated_bytes,
            "peak_reserved_minus_peak_allocated_pct": round(_unused_at_peak_pct(r), 2),
            "num_device_alloc": r.num_device_alloc,
            "num_device_free": r.num_device_free,
            "num_alloc_retries": r.num_alloc_retries,
            "oom": r.oom,
            "oom_event_index": r.oom_event_index,
            "warnings": list(r.warnings),
        }
        for label, r in results
    ]


def what_if_table(results: Sequence[tuple[str, ReplayResult]], *, title: str) -> Table:
    """One row per setting of ``replay --what-if``: peak reserved, its excess over peak
    allocated, OOM or not."""
    from rich.table import Table

    from oomkit.interfaces.reports._untrusted import as_written

    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("PYTORCH_CUDA_ALLOC_CONF", overflow="fold")
    table.add_column("peak reserved", justify="right")
    table.add_column("peak allocated", justify="right")
    table.add_column("peak reserved − peak allocated", justify="right")
    table.add_column("cudaMalloc", justify="right")
    table.add_column("OOM", justify="right")
    for label, r in results:
        frag = r.peak_reserved_bytes - r.peak_allocated_bytes
        table.add_row(
            as_written(label) if label else "(default)",
            format_bytes(r.peak_reserved_bytes),
            format_bytes(r.peak_allocated_bytes),
            f"{format_bytes(frag)} ({_unused_at_peak_pct(r):.1f}%)",
            f"{r.num_device_alloc:,}",
            f"at event {r.oom_event_index}" if r.oom else "no",
        )
    return table

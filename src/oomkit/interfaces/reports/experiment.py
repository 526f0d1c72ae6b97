"""Rendering of allocator-setting experiments: the trial table, the recommendation, and JSON."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from oomkit.runtime.experiment import ExperimentResult, Trial
from oomkit.units import format_bytes

__all__ = ["experiment_table", "experiment_to_json", "render_experiment", "trial_status_text"]


def trial_status_text(trial: Trial, steps: int) -> str:
    """The status cell: ``ok (20 steps)``, ``OOM at step 3``, ``crashed (exit 1)``, ..."""
    if trial.status == "completed":
        return f"ok ({trial.steps} steps)"
    if trial.status == "finished":
        return f"ok (ended after {trial.steps}/{steps} steps)"
    if trial.status == "oom":
        return f"OOM at step {trial.oom_step}"
    if trial.status == "timeout":
        return f"timeout (after {trial.steps} steps)"
    if trial.status == "invalid":
        return "invalid setting"
    return f"crashed (exit {trial.exit_code})"


def _delta(trial: Trial, baseline: Trial) -> str:
    if trial.baseline:
        return "baseline"
    if trial.peak_reserved_bytes is None or baseline.peak_reserved_bytes is None:
        return "-"
    diff = trial.peak_reserved_bytes - baseline.peak_reserved_bytes
    text = ("+" if diff > 0 else "") + format_bytes(diff)
    if baseline.peak_reserved_bytes:
        text += f" ({diff / baseline.peak_reserved_bytes:+.0%})"
    return text


def experiment_table(result: ExperimentResult) -> Table:
    """One row per trial: setting, status, peak reserved, Δ vs baseline, fragmentation, steps/s.

    A ``GPU`` column (the trial's ``CUDA_VISIBLE_DEVICES``) follows when the trials were pinned to
    GPUs (run in parallel).
    """
    table = Table(title="Allocator settings on this script", header_style="bold")
    table.add_column("PYTORCH_CUDA_ALLOC_CONF")
    table.add_column("status")
    table.add_column("peak reserved", justify="right")
    table.add_column("Δ vs baseline", justify="right")
    table.add_column("fragmentation", justify="right")
    table.add_column("steps/s", justify="right")
    pinned = any(trial.gpu is not None for trial in result.trials)
    if pinned:
        table.add_column("GPU")
    baseline = result.baseline
    for trial in result.trials:
        name = trial.alloc_conf or "(default)"
        if result.recommended is trial:
            name += " *"
        row = [
            name,
            trial_status_text(trial, result.steps),
            "-" if trial.peak_reserved_bytes is None else format_bytes(trial.peak_reserved_bytes),
            _delta(trial, baseline),
            "-" if trial.fragmentation is None else f"{trial.fragmentation:.0%}",
            "-" if trial.steps_per_s is None else f"{trial.steps_per_s:.3g}",
        ]
        if pinned:
            row.append("-" if trial.gpu is None else trial.gpu)
        table.add_row(*row)
    return table


def render_experiment(result: ExperimentResult, console: Console) -> None:
    """Print the table, why trials failed, the warnings and the recommendation."""
    console.print(experiment_table(result))
    for trial in result.trials:
        if trial.error and not trial.ok:
            console.print(f"  {trial.alloc_conf or '(default)'}: {trial.error}", soft_wrap=True)
    for warning in result.warnings:
        console.print(f"[yellow]warning:[/yellow] {warning}", soft_wrap=True)
    if result.recommended is None:
        console.print(f"[bold]No recommendation:[/bold] {result.reason}", soft_wrap=True)
    else:
        console.print(f"[bold]Recommendation:[/bold] {result.reason}", soft_wrap=True)


def experiment_to_json(result: ExperimentResult) -> dict[str, Any]:
    """The ``--json`` object."""
    return {
        "steps": result.steps,
        "max_slowdown": result.max_slowdown,
        "trials": [trial.to_json() for trial in result.trials],
        "recommended": None if result.recommended is None else result.recommended.alloc_conf,
        "reason": result.reason,
        "warnings": list(result.warnings),
        "gpus": list(result.gpus),
    }

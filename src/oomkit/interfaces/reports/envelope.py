"""Rendering of ``Envelope`` records (``predict --lengths``): terminal, JSON and an HTML page."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from oomkit._files import write_output
from oomkit.interfaces.reports._untrusted import as_written
from oomkit.interfaces.reports.html import ChartSeries, HtmlPage, line_chart_svg
from oomkit.prediction.envelope import Envelope
from oomkit.units import format_bytes

__all__ = ["envelope_html", "envelope_to_json", "envelope_verdict", "render_envelope", "write_envelope_html"]


def envelope_verdict(env: Envelope) -> str:
    """One line: the worst step, the creep over the longest step alone, the first OOM."""
    usable = env.prediction.usable_bytes
    head = (
        f"worst step {env.worst_step} of {env.steps} (length {env.worst_length}): peak reserved "
        f"{format_bytes(env.worst_peak_reserved_bytes)} of {format_bytes(usable)} usable; the "
        f"longest step alone needs {format_bytes(env.longest_alone_peak_reserved_bytes)}"
    )
    if env.creep_bytes > 0:
        head += f" (the cache creeps {format_bytes(env.creep_bytes)} above it)"
    if env.first_oom_step is not None:
        return f"runs out of memory at step {env.first_oom_step}: " + head
    return "fits every step: " + head


def _saves(saving_bytes: int) -> str:
    """The "saves" cell, signed as ``saving_bytes`` is in JSON: ``-3.50 GiB`` costs memory.

    One function for the terminal and the page, so both show what JSON says (a remedy that
    costs memory was shown as "0 B" on the page).
    """
    return format_bytes(saving_bytes)


def render_envelope(env: Envelope, console: Console) -> None:
    """The per-step summary, the remedies ranked by saving, and the verdict."""
    console.print(as_written(f"{env.prediction.description or 'run'}: {env.steps} steps"))
    table = Table(title="Remedies, re-simulated over the whole run")
    table.add_column("change", overflow="fold", min_width=24)
    table.add_column("peak reserved", justify="right")
    table.add_column("saves", justify="right")
    table.add_column("first OOM step", justify="right")
    table.add_column("note")
    for r in env.remedies:
        table.add_row(
            as_written(r.name),
            format_bytes(r.peak_reserved_bytes),
            _saves(r.saving_bytes),
            "-" if r.first_oom_step is None else str(r.first_oom_step),
            as_written(r.note),
        )
    if env.remedies:
        console.print(table)
    console.print(as_written(envelope_verdict(env)))


def envelope_to_json(env: Envelope) -> dict[str, Any]:
    """The ``envelope`` object of ``predict --lengths --json`` (docs/CONTRACTS.md)."""
    return {
        "steps": env.steps,
        "worst_step": env.worst_step,
        "worst_length": env.worst_length,
        "worst_peak_reserved_bytes": env.worst_peak_reserved_bytes,
        "first_oom_step": env.first_oom_step,
        "longest_alone_peak_reserved_bytes": env.longest_alone_peak_reserved_bytes,
        "creep_bytes": env.creep_bytes,
        "lengths": list(env.lengths),
        "per_step_peak_reserved_bytes": list(env.per_step_peak_reserved_bytes),
        "remedies": [
            {
                "name": r.name,
                "peak_reserved_bytes": r.peak_reserved_bytes,
                "saving_bytes": r.saving_bytes,
                "first_oom_step": r.first_oom_step,
                "note": r.note,
            }
            for r in env.remedies
        ],
        "verdict": envelope_verdict(env),
    }


def envelope_html(env: Envelope) -> str:
    """A self-contained page: per-step reserved against the usable memory, worst step marked."""
    page = HtmlPage("oomkit envelope", subtitle=env.prediction.description or None)
    top = page.section("Verdict", "verdict")
    top.verdict(envelope_verdict(env))
    points = tuple((float(i + 1), b) for i, b in enumerate(env.per_step_peak_reserved_bytes))
    top.figure(
        line_chart_svg(
            [ChartSeries("peak reserved per step", points, "#0072B2")],
            x_label="step",
            marker_x=float(env.worst_step),
            marker_label=f"worst: step {env.worst_step}",
            limit_bytes=env.prediction.usable_bytes,
            limit_label="usable",
        ),
        "Peak reserved memory of every step, against what the GPU leaves PyTorch",
    )
    if env.remedies:
        page.section("Remedies", "remedies").table(
            ["change", "peak reserved", "saves", "first OOM step", "note"],
            [
                (
                    r.name,
                    format_bytes(r.peak_reserved_bytes),
                    _saves(r.saving_bytes),
                    "-" if r.first_oom_step is None else r.first_oom_step,
                    r.note,
                )
                for r in env.remedies
            ],
            numeric_columns=(1, 2, 3),
        )
    return page.render()


def write_envelope_html(path: str | os.PathLike[str], env: Envelope) -> Path:
    """Write :func:`envelope_html` to ``path``."""
    return write_output(path, envelope_html(env), flag="--html")

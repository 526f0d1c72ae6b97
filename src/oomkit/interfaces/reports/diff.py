"""Rendering of ``RunDiff`` records (``oomkit diff``): a rich summary, JSON and an HTML page."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from oomkit.diagnose.run_diff import RunDiff, RunMemory, SiteDelta
from oomkit.interfaces.reports._untrusted import as_written
from oomkit.units import format_bytes

if TYPE_CHECKING:
    # rich when the terminal report is rendered (`--json` renders nothing), the HTML page's
    # builders with `--html` only (issue 41 item 4: start-up).
    from rich.console import Console
    from rich.table import Table

__all__ = ["diff_html", "diff_to_json", "render_diff", "write_diff_html"]


def _signed(n: int) -> str:
    return ("+" if n > 0 else "-" if n < 0 else "±") + format_bytes(abs(n))


def diff_headline(diff: RunDiff) -> str:
    """One line: the change in peak and its parts."""
    return (
        f"peak reserved {format_bytes(diff.a.peak_reserved_bytes)} -> "
        f"{format_bytes(diff.b.peak_reserved_bytes)} ({_signed(diff.peak_reserved_delta_bytes)}): "
        f"allocated {_signed(diff.allocated_delta_bytes)}, fragmentation "
        f"{_signed(diff.placement_delta_bytes)} (both at peak reserved)"
        + (
            f"; outside PyTorch {_signed(diff.outside_delta_bytes)}"
            if diff.outside_delta_bytes
            else ""
        )
    )


def _divergence_line(diff: RunDiff) -> str | None:
    d = diff.divergence
    if d is None:
        return None
    if d.index is None:
        return f"The two runs make the same {d.matched} {d.unit}s in the same order."
    if d.unit == "step":
        # Steps are counted from 1, as users count them.
        return f"The runs part at step {d.index + 1} ({d.matched} steps matched): A {d.a}; B {d.b}."
    if d.matched == 0:
        return (
            f"They differ from the first allocation (A: {d.a}; B: {d.b}): probably not the same "
            "program, so only the totals compare."
        )
    return f"First divergence at allocation {d.index} after {d.matched} matched: A {d.a}; B {d.b}."


def _delta_table(title: str, rows: tuple[SiteDelta, ...]) -> Table:
    from rich.table import Table

    table = Table(title=title)
    table.add_column("where")
    for name in ("A", "B", "B - A"):
        table.add_column(name, justify="right")
    for row in rows:
        table.add_row(
            as_written(row.name),
            format_bytes(row.a_bytes),
            format_bytes(row.b_bytes),
            _signed(row.delta_bytes),
        )
    return table


def render_diff(diff: RunDiff, console: Console) -> None:
    """Print the headline, the parts, the categories and sites that moved, and the divergence."""
    from rich.table import Table

    console.print(f"A: {as_written(diff.a.name)} ({diff.a.kind})   B: {as_written(diff.b.name)} ({diff.b.kind})")
    parts = Table(title="Change in peak memory, B - A")
    parts.add_column("part")
    for name in ("A", "B", "B - A"):
        parts.add_column(name, justify="right")
    parts.add_row(
        "allocated at peak reserved",
        format_bytes(diff.a.allocated_at_peak_bytes),
        format_bytes(diff.b.allocated_at_peak_bytes),
        _signed(diff.allocated_delta_bytes),
    )
    parts.add_row(
        "fragmentation: reserved - allocated at peak reserved",
        format_bytes(diff.a.placement_bytes),
        format_bytes(diff.b.placement_bytes),
        _signed(diff.placement_delta_bytes),
    )
    parts.add_row(
        "peak reserved",
        format_bytes(diff.a.peak_reserved_bytes),
        format_bytes(diff.b.peak_reserved_bytes),
        _signed(diff.peak_reserved_delta_bytes),
    )
    parts.add_row("outside PyTorch", "", "", _signed(diff.outside_delta_bytes))
    console.print(parts)
    if diff.by_category:
        console.print(_delta_table("By category, at each peak", diff.by_category))
    if diff.top_sites:
        console.print(_delta_table("By allocation site, at each peak", diff.top_sites))
    if diff.segment_deltas:
        console.print(
            _delta_table("Segments held at each peak of reserved memory", diff.segment_deltas)
        )
    line = _divergence_line(diff)
    if line:
        console.print(as_written(line))
    for note in diff.notes:
        console.print(f"[dim]note: {as_written(note)}[/dim]")
    console.print(as_written(diff_headline(diff)))


def _side_json(run: RunMemory) -> dict[str, Any]:
    return {
        "kind": run.kind,
        "name": run.name,
        "gpu": run.gpu,
        "peak_reserved_bytes": run.peak_reserved_bytes,
        "allocated_at_peak_bytes": run.allocated_at_peak_bytes,
        "placement_bytes": run.placement_bytes,
        "outside_bytes": run.outside_bytes,
        "peak_at": run.peak_at,
    }


def _rows(rows: tuple[SiteDelta, ...]) -> list[dict[str, Any]]:
    return [
        {"name": r.name, "a_bytes": r.a_bytes, "b_bytes": r.b_bytes, "delta_bytes": r.delta_bytes}
        for r in rows
    ]


def diff_to_json(diff: RunDiff) -> dict[str, Any]:
    """The ``oomkit diff --json`` object (docs/CONTRACTS.md), B minus A."""
    d = diff.divergence
    return {
        "peak_reserved_delta_bytes": diff.peak_reserved_delta_bytes,
        "peak_delta_bytes": diff.peak_delta_bytes,
        "parts": {
            "allocated_bytes": diff.allocated_delta_bytes,
            "placement_bytes": diff.placement_delta_bytes,
            "outside_bytes": diff.outside_delta_bytes,
        },
        "top_frames": _rows(diff.top_sites),
        "site_kind": diff.b.site_kind or diff.a.site_kind,
        "by_category": _rows(diff.by_category),
        "segments": _rows(diff.segment_deltas),
        "divergence": None
        if d is None
        else {"index": d.index, "matched": d.matched, "a": d.a, "b": d.b, "unit": d.unit},
        "a": _side_json(diff.a),
        "b": _side_json(diff.b),
        "notes": list(diff.notes),
    }


def _parts_bar_svg(diff: RunDiff, width: int = 900) -> str:
    """Horizontal bars, one per part, from a zero line: right is more memory in B."""
    import html

    parts = [
        ("allocated", diff.allocated_delta_bytes, "#0072B2"),
        ("fragmentation", diff.placement_delta_bytes, "#E69F00"),
        ("outside PyTorch", diff.outside_delta_bytes, "#009E73"),
        ("total", diff.peak_delta_bytes, "#555555"),
    ]
    top = max([abs(v) for _, v, _ in parts] + [1])
    left, row_h = 250, 26
    mid = left + (width - left - 20) / 2
    scale = (width - left - 20) / 2 / top
    out = [
        f'<svg class="parts" xmlns="http://www.w3.org/2000/svg" width="{width}" '
        f'height="{row_h * len(parts) + 10}">'
    ]
    out.append(f'<line x1="{mid:.1f}" y1="0" x2="{mid:.1f}" y2="{row_h * len(parts)}" stroke="#999"/>')
    for i, (label, value, colour) in enumerate(parts):
        y = i * row_h + 4
        w = abs(value) * scale
        x = mid if value >= 0 else mid - w
        # Label and value in the left column, so no text sits on a bar.
        out.append(f'<text x="4" y="{y + 14}">{html.escape(label)}</text>')
        out.append(f'<text x="{left - 12}" y="{y + 14}" text-anchor="end">{html.escape(_signed(value))}</text>')
        out.append(
            f'<rect class="part" data-part="{html.escape(label)}" x="{x:.1f}" y="{y}" '
            f'width="{max(w, 1):.1f}" height="{row_h - 8}" fill="{colour}"/>'
        )
    out.append("</svg>")
    return "".join(out)


def diff_html(diff: RunDiff) -> str:
    """The diff as one self-contained page: headline, parts bar, both timelines, tables."""
    from oomkit.interfaces.reports.html import ChartSeries, HtmlPage, line_chart_svg

    page = HtmlPage("oomkit diff", subtitle=f"A: {diff.a.name}  B: {diff.b.name}")
    head = page.section("Change in peak memory", "verdict")
    head.verdict(diff_headline(diff))
    head.figure(
        _parts_bar_svg(diff),
        "B minus A, at each peak of reserved memory; allocated + fragmentation (reserved - "
        "allocated) = peak reserved change",
    )
    timelines = page.section("Timelines", "timelines")
    if diff.a.timeline and diff.b.timeline and diff.a.timeline_unit == diff.b.timeline_unit:
        both = [
            ChartSeries(f"A reserved: {diff.a.name}", tuple((x, r) for x, _, r in diff.a.timeline), "#0072B2"),
            ChartSeries(f"B reserved: {diff.b.name}", tuple((x, r) for x, _, r in diff.b.timeline), "#D55E00"),
        ]
        timelines.figure(
            line_chart_svg(both, x_label=diff.a.timeline_unit),
            "Both runs' reserved memory on one axis (aligned by " + diff.a.timeline_unit + ")",
        )
    for side, run, colour in (("A", diff.a, "#0072B2"), ("B", diff.b, "#D55E00")):
        if not run.timeline:
            timelines.paragraph(f"{run.name}: no timeline recorded.", css_class="note")
            continue
        series = [
            ChartSeries(f"{side} reserved", tuple((x, r) for x, _, r in run.timeline), colour),
            ChartSeries(f"{side} allocated", tuple((x, a) for x, a, _ in run.timeline), "#999999"),
        ]
        timelines.figure(
            line_chart_svg(
                series,
                x_label=run.timeline_unit,
                marker_x=None if run.peak_at is None else float(run.peak_at),
                marker_label="peak reserved",
            ),
            f"{side}: {run.name}, allocated and reserved",
        )
    for title, rows, sid in (
        ("By category, at each peak", diff.by_category, "categories"),
        ("By allocation site, at each peak", diff.top_sites, "sites"),
        ("Segments held at each peak of reserved memory", diff.segment_deltas, "segments"),
    ):
        if rows:
            page.section(title, sid).table(
                ["where", "A", "B", "B - A"],
                [
                    (r.name, format_bytes(r.a_bytes), format_bytes(r.b_bytes), _signed(r.delta_bytes))
                    for r in rows
                ],
                numeric_columns=(1, 2, 3),
            )
    line = _divergence_line(diff)
    notes = page.section("Notes", "notes")
    if line:
        notes.paragraph(line)
    for note in diff.notes:
        notes.paragraph(note, css_class="note")
    return page.render()


def write_diff_html(path: str | os.PathLike[str], diff: RunDiff) -> Path:
    """Write :func:`diff_html` to ``path``."""
    from oomkit._files import write_output

    return write_output(path, diff_html(diff), flag="--html")

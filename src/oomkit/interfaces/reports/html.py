"""A small builder for self-contained HTML reports: inline CSS and SVG, no scripts, no network.

A page is a title and sections; a section holds paragraphs, tables, code blocks and SVG charts.
Every text is escaped; the SVG comes from the chart functions here (``line_chart_svg``,
``block_map_svg``), which escape their labels too. The page loads nothing: no fonts, no
stylesheets, no images, no scripts, so it opens offline and from a mail attachment.

Example::

    page = HtmlPage("oomkit report")
    s = page.section("Verdict")
    s.verdict("Cause: fragmentation")
    s.code("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python train.py")
    page.write("report.html")
"""

from __future__ import annotations

import html
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from oomkit._files import write_output
from oomkit.units import format_bytes

__all__ = [
    "BlockRun",
    "ChartSeries",
    "HtmlPage",
    "HtmlSection",
    "block_map_svg",
    "line_chart_svg",
]

# Colour-blind-safe palette (Okabe & Ito, 2008), used in order for series.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442")

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:2em auto;
max-width:1000px;padding:0 1em;color:#1b1b1b;line-height:1.45}
h1{font-size:1.6em;margin-bottom:.2em}h2{font-size:1.25em;border-bottom:1px solid #ddd;
padding-bottom:.2em;margin-top:1.6em}h3{font-size:1.05em}
.subtitle{color:#555;margin-top:0}
.verdict{background:#fff4e5;border-left:5px solid #E69F00;padding:.7em 1em;font-size:1.1em}
table{border-collapse:collapse;margin:.6em 0;font-size:.95em}
th,td{border:1px solid #ddd;padding:.3em .6em;text-align:left;vertical-align:top}
th{background:#f5f5f5}td.num{text-align:right;font-variant-numeric:tabular-nums}
pre{background:#f6f8fa;border:1px solid #e1e4e8;padding:.7em;overflow-x:auto}
code{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:.9em}
.note{color:#555;font-size:.92em}.warning{color:#8a4b00}
figure{margin:.8em 0}figcaption{color:#555;font-size:.9em}
svg text{font-family:system-ui,sans-serif;font-size:11px;fill:#333}
""".strip()


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


class HtmlSection:
    """One ``<section>`` with a heading; methods append blocks in order and return ``self``."""

    def __init__(self, title: str, section_id: str) -> None:
        self.title = title
        self.section_id = section_id
        self._parts: list[str] = []

    def paragraph(self, text: str, *, css_class: str | None = None) -> HtmlSection:
        cls = f' class="{_e(css_class)}"' if css_class else ""
        self._parts.append(f"<p{cls}>{_e(text)}</p>")
        return self

    def verdict(self, text: str) -> HtmlSection:
        """A highlighted one-line verdict."""
        self._parts.append(f'<p class="verdict">{_e(text)}</p>')
        return self

    def subheading(self, text: str) -> HtmlSection:
        self._parts.append(f"<h3>{_e(text)}</h3>")
        return self

    def code(self, text: str) -> HtmlSection:
        """A code block, whole and copyable."""
        self._parts.append(f"<pre><code>{_e(text)}</code></pre>")
        return self

    def table(
        self,
        headers: Sequence[str],
        rows: Sequence[Sequence[object]],
        *,
        numeric_columns: Sequence[int] = (),
        caption: str | None = None,
    ) -> HtmlSection:
        """A table; cells in ``numeric_columns`` are right-aligned."""
        numeric = set(numeric_columns)
        out = ["<table>"]
        if caption:
            out.append(f"<caption>{_e(caption)}</caption>")
        out.append("<thead><tr>" + "".join(f"<th>{_e(h)}</th>" for h in headers) + "</tr></thead>")
        out.append("<tbody>")
        for row in rows:
            cells = "".join(
                f'<td class="num">{_e(c)}</td>' if i in numeric else f"<td>{_e(c)}</td>"
                for i, c in enumerate(row)
            )
            out.append(f"<tr>{cells}</tr>")
        out.append("</tbody></table>")
        self._parts.append("".join(out))
        return self

    def figure(self, svg: str, caption: str | None = None) -> HtmlSection:
        """An SVG made by this module's chart functions, with an optional caption."""
        cap = f"<figcaption>{_e(caption)}</figcaption>" if caption else ""
        self._parts.append(f"<figure>{svg}{cap}</figure>")
        return self

    def render(self) -> str:
        return (
            f'<section id="{_e(self.section_id)}"><h2>{_e(self.title)}</h2>'
            + "\n".join(self._parts)
            + "</section>"
        )


class HtmlPage:
    """A self-contained HTML page of sections."""

    def __init__(self, title: str, *, subtitle: str | None = None) -> None:
        self.title = title
        self.subtitle = subtitle
        self._sections: list[HtmlSection] = []

    def section(self, title: str, section_id: str | None = None) -> HtmlSection:
        """Append a section and return it; ``section_id`` defaults to a slug of the title."""
        slug = section_id or "-".join(
            "".join(ch if ch.isalnum() else " " for ch in title.lower()).split()
        )
        section = HtmlSection(title, slug or f"section-{len(self._sections) + 1}")
        self._sections.append(section)
        return section

    def render(self) -> str:
        """The whole document as a string."""
        subtitle = f'<p class="subtitle">{_e(self.subtitle)}</p>' if self.subtitle else ""
        body = "\n".join(s.render() for s in self._sections)
        return (
            "<!DOCTYPE html>\n"
            '<html lang="en"><head><meta charset="utf-8">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            # No network: forbid every fetch, even one a future section might add by mistake.
            '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
            "style-src 'unsafe-inline'; img-src data:\">"
            f"<title>{_e(self.title)}</title><style>{_CSS}</style></head>\n"
            f"<body><header><h1>{_e(self.title)}</h1>{subtitle}</header>\n{body}\n"
            '<footer class="note">Made by oomkit; this page loads nothing from the network.'
            "</footer></body></html>\n"
        )

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write the page as UTF-8 and return the path."""
        return write_output(path, self.render())


# ----------------------------------------------------------------------------- charts


@dataclass(frozen=True)
class ChartSeries:
    """One line of a chart: ``(x, y_bytes)`` points in x order."""

    name: str
    points: tuple[tuple[float, int], ...]
    colour: str | None = None


def _nice_step(span: float, ticks: int) -> float:
    """A 1-2-5 step that splits ``span`` into about ``ticks`` intervals."""
    if span <= 0:
        return 1.0
    raw = span / ticks
    magnitude = 10 ** math.floor(math.log10(raw))
    for factor in (1, 2, 5, 10):
        if raw <= factor * magnitude:
            return factor * magnitude
    return 10 * magnitude


def _byte_step(top: int, ticks: int) -> int:
    """A power-of-two tick step in bytes giving about ``ticks`` intervals up to ``top``."""
    if top <= 0:
        return 1
    return 1 << max(0, math.ceil(math.log2(top / ticks)))


def line_chart_svg(
    series: Sequence[ChartSeries],
    *,
    x_label: str,
    width: int = 900,
    height: int = 300,
    marker_x: float | None = None,
    marker_label: str | None = None,
    limit_bytes: int | None = None,
    limit_label: str | None = None,
) -> str:
    """A line chart of byte levels (steps between points), with a legend and byte axis.

    Args:
        series: the lines; colours default to the palette in order.
        x_label: what the x axis counts (e.g. "trace event").
        width: SVG width in px.
        height: SVG height in px.
        marker_x: an x to mark with a vertical line (the OOM).
        marker_label: the marker's label.
        limit_bytes: a horizontal line (the device capacity).
        limit_label: its label.

    Returns:
        An ``<svg>`` element (one ``<path>`` per series, class ``series``).
    """
    left, right, top, bottom = 86, 20, 28, 40
    plot_w, plot_h = width - left - right, height - top - bottom
    xs = [x for s in series for x, _ in s.points]
    ys = [y for s in series for _, y in s.points]
    x0 = min(xs) if xs else 0.0
    x1 = max(xs) if xs else 1.0
    if marker_x is not None:
        x0, x1 = min(x0, marker_x), max(x1, marker_x)
    if x1 == x0:
        x1 = x0 + 1
    y_top = max([*ys, limit_bytes or 0, 1])
    step = _byte_step(y_top, 4)
    y_top = step * math.ceil(y_top / step)

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * plot_w

    def sy(y: float) -> float:
        return top + plot_h - y / y_top * plot_h

    out = [
        f'<svg width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" class="chart">'
    ]
    # Axes and horizontal grid with byte labels.
    tick = 0
    while tick <= y_top:
        y = sy(tick)
        out.append(
            f'<line x1="{left}" y1="{y:.1f}" x2="{left + plot_w}" y2="{y:.1f}" stroke="#e5e5e5"/>'
        )
        out.append(
            f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{_e(format_bytes(tick))}'
            "</text>"
        )
        tick += step
    x_step = _nice_step(x1 - x0, 6)
    xt = math.ceil(x0 / x_step) * x_step
    while xt <= x1:
        out.append(
            f'<text x="{sx(xt):.1f}" y="{top + plot_h + 16}" text-anchor="middle">'
            f"{_e(f'{xt:g}')}</text>"
        )
        xt += x_step
    out.append(
        f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#999"/>'
    )
    out.append(
        f'<text x="{left + plot_w / 2:.1f}" y="{height - 6}" text-anchor="middle">'
        f"{_e(x_label)}</text>"
    )
    if limit_bytes is not None:
        y = sy(limit_bytes)
        out.append(
            f'<line class="limit" x1="{left}" y1="{y:.1f}" x2="{left + plot_w}" y2="{y:.1f}" '
            'stroke="#D55E00" stroke-dasharray="6 4"/>'
        )
        if limit_label:
            out.append(
                f'<text x="{left + plot_w - 4}" y="{y - 4:.1f}" text-anchor="end">'
                f"{_e(limit_label)}</text>"
            )
    for i, s in enumerate(series):
        colour = s.colour or PALETTE[i % len(PALETTE)]
        if not s.points:
            continue
        d = [f"M{sx(s.points[0][0]):.1f},{sy(s.points[0][1]):.1f}"]
        for x, y in s.points[1:]:
            # A level holds until the next event: draw steps.
            d.append(f"H{sx(x):.1f}V{sy(y):.1f}")
        out.append(
            f'<path class="series" data-name="{_e(s.name)}" d="{"".join(d)}" fill="none" '
            f'stroke="{colour}" stroke-width="1.6"/>'
        )
        lx = left + 10 + i * 170
        out.append(
            f'<rect x="{lx}" y="8" width="14" height="4" fill="{colour}"/>'
            f'<text x="{lx + 20}" y="14">{_e(s.name)}</text>'
        )
    if marker_x is not None:
        x = sx(marker_x)
        out.append(
            f'<line class="marker" x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{top + plot_h}" '
            'stroke="#D55E00" stroke-width="1.5"/>'
        )
        if marker_label:
            out.append(
                f'<text x="{x - 4:.1f}" y="{top + 12}" text-anchor="end">{_e(marker_label)}</text>'
            )
    out.append("</svg>")
    return "".join(out)


@dataclass(frozen=True)
class BlockRun:
    """A run of memory in a segment map: ``size_bytes`` in one ``state``.

    ``state`` is ``"allocated"``, ``"pending_free"`` or ``"free"``; ``segment`` numbers the
    segment it belongs to (runs of one segment are consecutive).
    """

    segment: int
    size_bytes: int
    state: str


_STATE_COLOURS = {"allocated": "#0072B2", "pending_free": "#CC79A7", "free": "#d9d9d9"}
_STATE_WORDS = {"allocated": "allocated", "pending_free": "freed, pending", "free": "free (cached)"}


def block_map_svg(runs: Sequence[BlockRun], *, width: int = 900, rows: int = 24) -> str:
    """A segment map: all reserved memory as ``rows`` strips, segments in address order.

    Each strip holds an equal share of the reserved bytes; runs are drawn in proportion to
    their size, coloured by state; a dark tick separates segments, so that a free run between
    two allocated ones (fragmentation) shows as a grey gap inside one segment.

    Returns:
        An ``<svg>`` element (one ``<rect class="run">`` per drawn piece).
    """
    left, top, legend_h, row_gap = 10, 26, 0, 4
    row_h = 16
    height = top + rows * (row_h + row_gap) + legend_h + 4
    plot_w = width - 2 * left
    total = sum(r.size_bytes for r in runs)
    out = [
        f'<svg width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" class="segment-map">'
    ]
    for i, (state, colour) in enumerate(_STATE_COLOURS.items()):
        lx = left + i * 180
        out.append(
            f'<rect x="{lx}" y="6" width="12" height="12" fill="{colour}"/>'
            f'<text x="{lx + 18}" y="16">{_e(_STATE_WORDS[state])}</text>'
        )
    if total <= 0:
        out.append(f'<text x="{left}" y="{top + 14}">no segments</text></svg>')
        return "".join(out)
    row_bytes = math.ceil(total / rows)
    position = 0  # bytes from the start of the first segment
    last_segment = None
    for run in runs:
        start, end = position, position + run.size_bytes
        position = end
        if run.segment != last_segment:
            row, offset = divmod(start, row_bytes)
            x = left + offset / row_bytes * plot_w
            y = top + row * (row_h + row_gap)
            out.append(
                f'<rect class="boundary" x="{x:.2f}" y="{y - 1}" width="1.2" height="{row_h + 2}"'
                ' fill="#333"/>'
            )
            last_segment = run.segment
        cursor = start
        while cursor < end:
            row, offset = divmod(cursor, row_bytes)
            piece = min(end, (row + 1) * row_bytes) - cursor
            x = left + offset / row_bytes * plot_w
            w = piece / row_bytes * plot_w
            y = top + row * (row_h + row_gap)
            out.append(
                f'<rect class="run" data-state="{_e(run.state)}" x="{x:.2f}" y="{y}" '
                f'width="{max(w, 0.3):.2f}" height="{row_h}" fill="{_STATE_COLOURS[run.state]}">'
                f"<title>segment {run.segment}: {_e(format_bytes(run.size_bytes))} "
                f"{_e(_STATE_WORDS[run.state])}</title></rect>"
            )
            cursor += piece
    out.append("</svg>")
    return "".join(out)

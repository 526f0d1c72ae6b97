"""``oomkit explain --html``: a diagnosis as one self-contained HTML page.

The page holds the verdict, every cause with its evidence, the ranked remedies with their code,
the allocated/reserved/nvidia-smi paragraph and, when a snapshot is given, a memory timeline
(allocated and reserved after every trace event, the OOM marked), the segment map at the
snapshot's moment (the OOM, for snapshots taken by ``oomkit run`` / ``oomkit.watch``) and the
top allocation sites. Built on :mod:`oomkit.interfaces.reports.html`: inline CSS and SVG, no scripts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from oomkit._files import write_output
from oomkit.core.snapshot import Snapshot, SnapshotSegment
from oomkit.diagnose.diagnosis import Diagnosis
from oomkit.interfaces.reports.diagnosis import (
    REMEDIES_HEADING,
    location_line,
    remedy_headline,
    remedy_saving,
    verdict_label,
)
from oomkit.interfaces.reports.html import (
    BlockRun,
    ChartSeries,
    HtmlPage,
    block_map_svg,
    line_chart_svg,
)
from oomkit.prediction.predictor import TimelinePoint
from oomkit.units import format_bytes

__all__ = [
    "MAX_TIMELINE_POINTS",
    "diagnosis_html",
    "segment_runs",
    "snapshot_timeline",
    "write_diagnosis_html",
]

# Enough points for a 900 px chart; each keeps the highest level of the events it stands for.
MAX_TIMELINE_POINTS = 1200

_RUN_STATE = {
    "active_allocated": "allocated",
    "active_pending_free": "pending_free",
    "inactive": "free",
}


def _device_of(snapshot: Snapshot, device: int | None) -> int:
    if device is not None:
        return device
    devices = snapshot.devices()
    for d in devices:
        if any(ev.action == "oom" for ev in snapshot.trace_for(d)):
            return d
    return devices[0] if devices else 0


def snapshot_timeline(
    snapshot: Snapshot, device: int | None = None, *, max_points: int = MAX_TIMELINE_POINTS
) -> tuple[TimelinePoint, ...]:
    """Allocated and reserved bytes over a snapshot's trace, at most ``max_points`` points.

    Levels come from ``oomkit.diagnose.attribution.trace_history`` (they end at the final
    segments' figures). Consecutive events are merged into one point that keeps their highest
    levels, so no peak is lost.

    Args:
        snapshot: from ``load_snapshot``.
        device: the device; None picks the one with an ``oom`` entry, else the first used.
        max_points: the most points returned.

    Returns:
        The points, in trace order (``step`` is None: a snapshot has no step marks); empty
        when the snapshot has no trace.
    """
    from oomkit.core.allocator import round_size
    from oomkit.diagnose.attribution import thin_timeline, trace_history

    device = _device_of(snapshot, device)
    events = snapshot.trace_for(device)
    if not events:
        return ()
    history = trace_history(events, snapshot.segments_for(device), round_size)
    levels = zip(history.allocated_bytes, history.reserved_bytes, strict=True)
    points = thin_timeline([(i, a, r) for i, (a, r) in enumerate(levels)], max_points)
    return tuple(
        TimelinePoint(event_index=int(x), step=None, allocated_bytes=a, reserved_bytes=r)
        for x, a, r in points
    )


def segment_runs(segments: Sequence[SnapshotSegment]) -> tuple[BlockRun, ...]:
    """The segments' blocks as runs for a segment map, adjacent blocks of one state merged."""
    runs: list[BlockRun] = []
    for index, segment in enumerate(sorted(segments, key=lambda s: (s.device, s.address))):
        covered = 0
        for block in segment.blocks:
            state = _RUN_STATE.get(block.state, "allocated")
            covered += block.size
            if runs and runs[-1].segment == index and runs[-1].state == state:
                runs[-1] = BlockRun(index, runs[-1].size_bytes + block.size, state)
            else:
                runs.append(BlockRun(index, block.size, state))
        if covered < segment.total_size:  # an expandable segment's unmapped tail
            runs.append(BlockRun(index, segment.total_size - covered, "free"))
    return tuple(runs)


def diagnosis_html(
    diagnosis: Diagnosis,
    *,
    snapshot: Snapshot | None = None,
    device: int | None = None,
    title: str = "CUDA out-of-memory diagnosis",
    source: str | None = None,
    prediction: Mapping[str, Any] | None = None,
) -> str:
    """The diagnosis as a self-contained HTML page.

    Args:
        diagnosis: what to show.
        snapshot: the snapshot diagnosed, for the timeline and the segment map; None for a
            diagnosis of an error text.
        device: the snapshot's device shown; None picks the one with an ``oom`` entry.
        title: the page title.
        source: what was diagnosed (a file name), shown under the title.
        prediction: the saved prediction diagnosed (``oomkit predict --json``), for its timeline.

    Returns:
        The HTML document.
    """
    page = HtmlPage(title, subtitle=f"oomkit explain {source}" if source else None)
    top = diagnosis.causes[0]
    verdict = page.section("Verdict", "verdict")
    verdict.verdict(f"{verdict_label(diagnosis)} — {top.summary}.")
    if diagnosis.location is not None:
        verdict.paragraph(location_line(diagnosis.location))
    # Only a remedy that lowers the peak is worth trying first (issue 16 item 8).
    first = next((r for r in diagnosis.remedies if r.lowers_peak), None)
    if first is not None:
        verdict.paragraph(f"Try first: {first.title} ({remedy_saving(first)}).")

    causes = page.section("Causes, strongest first", "causes")
    causes.table(
        ["cause", "what shows it", "evidence"],
        [
            (
                f.cause,
                f.summary,
                "; ".join(f"{k} = {format_bytes(v)}" for k, v in f.evidence_bytes.items()),
            )
            for f in diagnosis.causes
        ],
    )

    remedies = page.section(REMEDIES_HEADING, "remedies")
    if not diagnosis.remedies:
        remedies.paragraph("No remedy applies to what the diagnosis could see.")
    for i, remedy in enumerate(diagnosis.remedies, 1):
        remedies.subheading(remedy_headline(i, remedy))
        remedies.paragraph(remedy.why)
        remedies.code(remedy.code)

    memory = page.section("Allocated, reserved and nvidia-smi", "memory")
    if diagnosis.memory_explained:
        memory.paragraph(diagnosis.memory_explained)
    figures = {k: v for k, v in diagnosis.figures_bytes.items() if v is not None}
    if figures:
        memory.table(
            ["figure", "bytes", ""],
            [(k, v, format_bytes(v) if k.endswith("_bytes") else "") for k, v in figures.items()],
            numeric_columns=(1, 2),
        )

    if snapshot is not None:
        _snapshot_sections(page, diagnosis, snapshot, device)
    if prediction is not None:
        _prediction_timeline(page, prediction)

    attribution = diagnosis.attribution
    if attribution is not None and (attribution.top_sites or attribution.largest_tensors):
        where = page.section(f"What was live at the {attribution.moment}", "attribution")
        if attribution.by_category_bytes:
            where.table(
                ["category", "live"],
                [
                    (c, format_bytes(b))
                    for c, b in sorted(attribution.by_category_bytes.items(), key=lambda kv: -kv[1])
                ],
                numeric_columns=(1,),
                caption="Memory by category",
            )
        if attribution.top_sites:
            where.table(
                ["site", "function", "live", "tensors"],
                [
                    (
                        f"{s.filename}:{s.line}" if s.filename else "unknown",
                        s.function or "",
                        format_bytes(s.live_bytes),
                        s.count,
                    )
                    for s in attribution.top_sites
                ],
                numeric_columns=(2, 3),
                caption="Top allocation sites",
            )
        if attribution.largest_tensors:
            where.table(
                ["size", "allocated at"],
                [(format_bytes(t.size_bytes), t.site) for t in attribution.largest_tensors],
                numeric_columns=(0,),
                caption="Largest live tensors",
            )

    if diagnosis.warnings:
        notes = page.section("Warnings", "warnings")
        for warning in diagnosis.warnings:
            notes.paragraph(warning, css_class="warning")
    return page.render()


def _moment_label(diagnosis: Diagnosis) -> str:
    """The timeline marker's label: "OOM" only where the snapshot recorded one."""
    moment = diagnosis.attribution.moment if diagnosis.attribution is not None else "oom"
    return {"oom": "OOM", "peak": "peak", "final": "end"}.get(moment, moment)


def _prediction_timeline(page: HtmlPage, data: Mapping[str, Any]) -> None:
    """The predicted step's allocated/reserved levels (``Prediction.timeline``), the OOM marked."""
    points = [p for p in data.get("timeline") or () if isinstance(p, Mapping)]
    try:
        series = [
            ChartSeries(
                name, tuple((int(p["event_index"]), int(p[f"{name}_bytes"])) for p in points)
            )
            for name in ("allocated", "reserved")
        ]
    except (KeyError, TypeError, ValueError):
        return  # an edited or older file: the page keeps every other section
    if not points:
        return
    series += _category_series(points)
    oom = data.get("oom") if isinstance(data.get("oom"), Mapping) else None
    usable = data.get("usable_bytes")
    svg = line_chart_svg(
        series,
        x_label="trace event",
        marker_x=oom.get("event_index") if oom else None,
        marker_label="OOM" if oom else None,
        limit_bytes=usable if isinstance(usable, int) else None,
        limit_label="usable by PyTorch" if isinstance(usable, int) else None,
    )
    page.section("Memory timeline", "timeline").figure(
        svg,
        "Predicted allocated and reserved bytes, and the largest categories, over the traced steps"
        + (" up to the OOM, where the replay stops." if oom else "."),
    )


# Lines a reader can still tell apart: the largest categories, the rest left to "allocated".
_CATEGORY_LINES = 3  # with allocated and reserved, five legend entries fit 900 px


def _category_series(points: Sequence[Mapping[str, Any]]) -> list[ChartSeries]:
    """One line per largest category (``TimelinePoint.by_category_bytes``), where recorded."""
    peak_by_category: dict[str, int] = {}
    for point in points:
        levels = point.get("by_category_bytes")
        if not isinstance(levels, Mapping):
            return []
        for category, nbytes in levels.items():
            if isinstance(nbytes, int):
                peak_by_category[category] = max(peak_by_category.get(category, 0), nbytes)
    largest = sorted(peak_by_category, key=lambda c: (-peak_by_category[c], c))[:_CATEGORY_LINES]
    return [
        ChartSeries(
            category,
            tuple(
                (int(p["event_index"]), int(p["by_category_bytes"].get(category, 0)))
                for p in points
            ),
        )
        for category in largest
    ]


def _snapshot_sections(
    page: HtmlPage, diagnosis: Diagnosis, snapshot: Snapshot, device: int | None
) -> None:
    device = _device_of(snapshot, device)
    timeline = snapshot_timeline(snapshot, device)
    if timeline:
        oom_index = diagnosis.figures_bytes.get("event_index")
        total = diagnosis.figures_bytes.get("total_bytes")
        svg = line_chart_svg(
            [
                ChartSeries(
                    "allocated", tuple((p.event_index, p.allocated_bytes) for p in timeline)
                ),
                ChartSeries("reserved", tuple((p.event_index, p.reserved_bytes) for p in timeline)),
            ],
            x_label="trace event",
            marker_x=oom_index,
            marker_label=_moment_label(diagnosis) if oom_index is not None else None,
            limit_bytes=total,
            limit_label="device total" if total is not None else None,
        )
        page.section("Memory timeline", "timeline").figure(
            svg,
            f"Allocated and reserved bytes after each of the {len(snapshot.trace_for(device))} "
            "recorded events (the ring buffer keeps only the newest).",
        )
    segments = snapshot.segments_for(device)
    if segments:
        runs = segment_runs(segments)
        free = [r.size_bytes for r in runs if r.state == "free"]
        page.section("Segment map", "segments").figure(
            block_map_svg(runs),
            f"{len(segments)} segments, {format_bytes(sum(s.total_size for s in segments))} "
            f"reserved, in address order; largest free block "
            f"{format_bytes(max(free) if free else 0)}. The state when the snapshot was taken "
            "(the OOM, for snapshots from oomkit run / oomkit.watch).",
        )


def write_diagnosis_html(
    path: str | os.PathLike[str],
    diagnosis: Diagnosis,
    *,
    snapshot: Snapshot | None = None,
    device: int | None = None,
    source: str | None = None,
    prediction: Mapping[str, Any] | None = None,
) -> Path:
    """Write :func:`diagnosis_html` to ``path`` (UTF-8) and return the path."""
    page = diagnosis_html(
        diagnosis, snapshot=snapshot, device=device, source=source, prediction=prediction
    )
    return write_output(path, page, flag="--html")

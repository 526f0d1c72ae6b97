"""``oomkit diff A B``: why peak memory moved between two runs, in parts that add up exactly.

Each side is first reduced to a :class:`RunMemory`: its peak-reserved moment, what was allocated
then (by category and by allocation site where the input has them), its timeline, and a sequence
of comparable items (allocations, or per-step peaks) for finding where two runs of one program
part ways. :func:`diff_runs` then splits B's peak minus A's:

    peak_reserved_delta = allocated_delta + placement_delta        (exactly)
    peak_delta          = peak_reserved_delta + outside_delta      (exactly)

where ``allocated`` is ``memory_allocated`` at each side's peak-reserved moment, ``placement``
is reserved minus allocated then (the share of the peak that is cache and fragmentation, the
part allocator settings move), and ``outside`` is memory outside PyTorch where both sides know
it (0 otherwise). Monitor logs are reduced in :mod:`oomkit.runtime.monitor_memory`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from oomkit.core.allocator import round_size
from oomkit.core.replay import config_from_settings, recorded_torch_version
from oomkit.core.snapshot import Snapshot
from oomkit.diagnose.attribution import site_of, thin_timeline, trace_history
from oomkit.errors import DiffInputError, PredictionFormatError
from oomkit.units import format_bytes

__all__ = [
    "DiffDivergence",
    "RunDiff",
    "RunKind",
    "RunMemory",
    "SiteDelta",
    "diff_runs",
    "run_memory_from_prediction",
    "run_memory_from_snapshot",
]

RunKind = Literal["snapshot", "prediction", "monitor"]
# How many per-site and per-category differences a diff lists.
TOP_DELTAS = 15
# Timelines keep at most this many points (each the maximum of a run of events).
MAX_TIMELINE_POINTS = 600


@dataclass(frozen=True)
class RunMemory:
    """One run's memory, reduced for a diff.

    Attributes:
        kind: "snapshot", "prediction" or "monitor".
        name: what it was read from (a file name).
        gpu: the GPU it ran or was predicted on, where the input names it.
        peak_reserved_bytes: the highest reserved level, at the first allocation that reaches
            it (simulated for predictions, recorded for snapshots — which the simulator reproduces decision for decision, see
            ``replay --verify`` — measured for monitor logs).
        allocated_at_peak_bytes: allocated bytes at that moment (monitor logs: the peak
            allocated of the step in which reserved peaked, an upper bound).
        outside_bytes: memory outside PyTorch at that moment, or None when unknown.
        by_category_bytes: allocated bytes at that moment by category (oomkit's tags).
        by_site_bytes: allocated bytes at that moment by allocation site (``file:line in
            function``) or module, ``site_kind`` says which.
        site_kind: "frame", "module" or None when the input has neither.
        peak_at: the peak's event index (snapshots, predictions) or step (monitor logs).
        timeline: ``(x, allocated_bytes, reserved_bytes)`` points, x in ``timeline_unit``.
        timeline_unit: "trace event" or "step".
        sequence: comparable items in order (allocations with their size and site, or per-step
            peaks), for finding where two runs of one program diverge.
        segments_at_peak: classic segment size -> how many were live at the peak, for
            snapshots (the allocator's segment decisions up to then); empty otherwise.
        notes: what the reduction assumed.
    """

    kind: RunKind
    name: str
    gpu: str | None
    peak_reserved_bytes: int
    allocated_at_peak_bytes: int
    outside_bytes: int | None
    by_category_bytes: Mapping[str, int]
    by_site_bytes: Mapping[str, int]
    site_kind: Literal["frame", "module"] | None
    peak_at: int | None
    timeline: tuple[tuple[float, int, int], ...]
    timeline_unit: str
    sequence: tuple[str, ...]
    segments_at_peak: Mapping[int, int] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    @property
    def placement_bytes(self) -> int:
        """Reserved minus allocated at the peak-reserved moment (cache and fragmentation)."""
        return self.peak_reserved_bytes - self.allocated_at_peak_bytes


@dataclass(frozen=True)
class SiteDelta:
    """Bytes at each side's peak-reserved moment for one category or site, and B minus A."""

    name: str
    a_bytes: int
    b_bytes: int

    @property
    def delta_bytes(self) -> int:
        """B minus A."""
        return self.b_bytes - self.a_bytes


@dataclass(frozen=True)
class DiffDivergence:
    """Where two runs of one program part ways.

    Attributes:
        index: the first item (``unit``) that differs; None when one sequence is a prefix of
            the other and they have the same length (no divergence).
        matched: how many items matched before it.
        a: A's item there (None past A's end); b: B's.
        unit: "allocation" or "step".
    """

    index: int | None
    matched: int
    a: str | None
    b: str | None
    unit: str


@dataclass(frozen=True)
class RunDiff:
    """B minus A, split into parts that add up exactly (see the module docstring)."""

    a: RunMemory
    b: RunMemory
    allocated_delta_bytes: int
    placement_delta_bytes: int
    outside_delta_bytes: int
    by_category: tuple[SiteDelta, ...]
    top_sites: tuple[SiteDelta, ...]
    divergence: DiffDivergence | None
    segment_deltas: tuple[SiteDelta, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def peak_reserved_delta_bytes(self) -> int:
        """Change in peak reserved memory, B minus A (= allocated + placement deltas)."""
        return self.b.peak_reserved_bytes - self.a.peak_reserved_bytes

    @property
    def peak_delta_bytes(self) -> int:
        """Change in peak device memory: reserved delta plus the outside delta."""
        return self.peak_reserved_delta_bytes + self.outside_delta_bytes


def _site_label(frames: Sequence[Any], tags: Mapping[str, str]) -> str:
    frame = site_of(frames)
    if frame is None:
        module = tags.get("module")
        return f"module {module}" if module else "(no user frame recorded)"
    # The file's base name: the same program recorded in two checkouts has other paths.
    return f"{os.path.basename(frame.filename)}:{frame.line} in {frame.name}"


def run_memory_from_snapshot(
    snapshot: Snapshot, *, device: int | None = None, torch_version: str | None = None
) -> RunMemory:
    """Reduce one device of a snapshot to its peak-reserved moment and its allocations.

    Args:
        snapshot: from ``load_snapshot``.
        device: the device; None = the first used one.
        torch_version: the release whose rounding to use for freed blocks; None = inferred.

    Raises:
        DiffInputError: the device is not in the snapshot.
    """
    devices = snapshot.devices() or [0]
    dev = devices[0] if device is None else device
    if dev not in devices:
        raise DiffInputError(
            f"{snapshot.source or 'the snapshot'} has no device {dev}; it holds "
            f"{', '.join(map(str, devices))}. Pass --device with one of them."
        )
    events = snapshot.trace_for(dev)
    segments = snapshot.segments_for(dev)
    version = torch_version or recorded_torch_version(snapshot)
    config, _ = config_from_settings(snapshot.allocator_settings, version)
    divisions = config.roundup_power2_divisions
    history = trace_history(events, segments, lambda n: round_size(n, divisions))
    name = os.path.basename(snapshot.source) if snapshot.source else "<snapshot>"
    notes: list[str] = []
    levels = list(zip(history.allocated_bytes, history.reserved_bytes, strict=True))
    if levels:
        peak_reserved = max(r for _, r in levels)
        # The moment fragmentation is measured at everywhere (TraceHistory.peak_reserved_moment).
        peak_at: int | None = history.peak_reserved_moment()
        allocated = levels[peak_at][0] if peak_at is not None else 0
    else:
        peak_reserved, allocated, peak_at = (
            history.start_reserved_bytes,
            history.start_allocated_bytes,
            None,
        )
        notes.append(f"{name}: no trace events; the snapshot's final state stands for its peak")
    if history.start_reserved_bytes > peak_reserved:
        peak_reserved, allocated, peak_at = (
            history.start_reserved_bytes,
            history.start_allocated_bytes,
            -1,
        )
    at = len(events) if peak_at is None else peak_at
    by_category: dict[str, int] = {}
    by_site: dict[str, int] = {}
    has_frames = False
    for rec in history.records:
        if not rec.live_at(at):
            continue
        tags = dict(rec.tags)
        if "category" in tags:
            by_category[tags["category"]] = by_category.get(tags["category"], 0) + rec.size_bytes
        has_frames = has_frames or bool(rec.frames)
        label = _site_label(rec.frames, tags)
        by_site[label] = by_site.get(label, 0) + rec.size_bytes
    segments_at_peak = _segments_live_at(events, segments, at)
    sequence = []
    for ev in events:
        if ev.action == "alloc":
            sequence.append(f"alloc {ev.size} B at {_site_label(ev.frames, dict(ev.tags))}")
        elif ev.action == "free_requested":
            sequence.append(f"free {ev.size} B")
    timeline = thin_timeline(
        [(float(i), a, r) for i, (a, r) in enumerate(levels)], MAX_TIMELINE_POINTS
    )
    return RunMemory(
        kind="snapshot",
        name=name,
        gpu=None,
        peak_reserved_bytes=peak_reserved,
        allocated_at_peak_bytes=allocated,
        outside_bytes=None,
        by_category_bytes=by_category,
        by_site_bytes=by_site,
        site_kind="frame" if has_frames else ("module" if by_site else None),
        peak_at=peak_at,
        timeline=timeline,
        timeline_unit="trace event",
        sequence=tuple(sequence),
        segments_at_peak=segments_at_peak,
        notes=tuple(notes),
    )


def _segments_live_at(
    events: Sequence[Any], final_segments: Sequence[Any], at: int
) -> dict[int, int]:
    """Classic segment sizes live just after event ``at`` -> how many (expandable ones skipped).

    The final segments, with every segment_alloc / segment_free after the moment undone (§11.2;
    expandable segments map and unmap pages instead, §8.2, and are not counted here).
    """
    live = {seg.address: seg.total_size for seg in final_segments if not seg.is_expandable}
    for ev in reversed(events[at + 1 :]):
        if ev.action == "segment_alloc":
            live.pop(ev.address, None)
        elif ev.action == "segment_free":
            live[ev.address] = ev.size
    counts: dict[int, int] = {}
    for size in live.values():
        counts[size] = counts.get(size, 0) + 1
    return counts


def _need(data: Mapping[str, Any], key: str, kind: type | tuple[type, ...], name: str) -> Any:
    value = data.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise PredictionFormatError(
            f"{name}: '{key}' is missing or not a {getattr(kind, '__name__', kind)}; save "
            "predictions with `oomkit predict ... --json > p.json`"
        )
    return value


def run_memory_from_prediction(data: Mapping[str, Any], *, name: str) -> RunMemory:
    """Reduce a saved prediction (``oomkit predict --json``) to its peak-reserved moment.

    Raises:
        PredictionFormatError: the object is not a saved prediction.
    """
    if not isinstance(data, Mapping):
        raise PredictionFormatError(f"{name}: not a JSON object")
    at = _need(data, "peak_reserved_at", Mapping, name)
    reserved = _need(at, "reserved_bytes", int, name)
    allocated = _need(at, "allocated_bytes", int, name)
    if not 0 <= allocated <= reserved:
        raise PredictionFormatError(
            f"{name}: peak_reserved_at has allocated {allocated} B above reserved {reserved} B"
        )
    categories = at.get("by_category_bytes") or {}
    # By site: none. A saved prediction keeps only its top 10 modules, so a module outside one
    # side's list would read as 0 B there: categories are complete, modules are not.
    gpu = data.get("gpu")
    gpu_name = gpu.get("name") if isinstance(gpu, Mapping) else None
    context = data.get("context_overhead_bytes")
    timeline = []
    for point in data.get("timeline") or []:
        if isinstance(point, Mapping) and isinstance(point.get("event_index"), int):
            timeline.append(
                (
                    float(point["event_index"]),
                    int(point.get("allocated_bytes", 0)),
                    int(point.get("reserved_bytes", 0)),
                )
            )
    sequence = tuple(
        f"peak allocated {p.get('peak_allocated_bytes')} B, reserved "
        f"{p.get('peak_reserved_bytes')} B"
        for p in data.get("step_peaks") or []
        if isinstance(p, Mapping)
    )
    return RunMemory(
        kind="prediction",
        name=name,
        gpu=gpu_name if isinstance(gpu_name, str) else None,
        peak_reserved_bytes=reserved,
        allocated_at_peak_bytes=allocated,
        outside_bytes=context if isinstance(context, int) else None,
        by_category_bytes={k: int(v) for k, v in categories.items() if isinstance(v, int)},
        by_site_bytes={},
        site_kind=None,
        peak_at=at.get("event_index") if isinstance(at.get("event_index"), int) else None,
        timeline=thin_timeline(timeline, MAX_TIMELINE_POINTS),
        timeline_unit="trace event",
        sequence=sequence,
    )


def _deltas(a: Mapping[str, int], b: Mapping[str, int]) -> tuple[SiteDelta, ...]:
    rows = [SiteDelta(k, a.get(k, 0), b.get(k, 0)) for k in set(a) | set(b)]
    rows = [r for r in rows if r.delta_bytes != 0]
    rows.sort(key=lambda r: (-abs(r.delta_bytes), r.name))
    return tuple(rows[:TOP_DELTAS])


def _divergence(a: RunMemory, b: RunMemory) -> DiffDivergence | None:
    if not a.sequence and not b.sequence:
        return None
    unit = "allocation" if a.kind == "snapshot" else "step"
    matched = 0
    for x, y in zip(a.sequence, b.sequence, strict=False):
        if x != y:
            return DiffDivergence(matched, matched, x, y, unit)
        matched += 1
    if len(a.sequence) == len(b.sequence):
        return DiffDivergence(None, matched, None, None, unit)
    longer_a = len(a.sequence) > matched
    return DiffDivergence(
        matched,
        matched,
        a.sequence[matched] if longer_a else None,
        None if longer_a else b.sequence[matched],
        unit,
    )


def _segment_bytes(run: RunMemory) -> dict[str, int]:
    """Bytes held in classic segments of each size at the peak, keyed by the size."""
    return {
        f"{format_bytes(size)} segments": size * n for size, n in run.segments_at_peak.items()
    }


def diff_runs(a: RunMemory, b: RunMemory, *, force: bool = False) -> RunDiff:
    """B minus A, in parts that add up exactly.

    Args:
        a: the reference run.
        b: the run compared with it.
        force: compare runs of different kinds or on different GPUs anyway.

    Raises:
        DiffInputError: the two are of different kinds, or name different GPUs, without force.
    """
    if a.kind != b.kind and not force:
        raise DiffInputError(
            f"{a.name} is a {a.kind} and {b.name} a {b.kind}: their peaks are not measured the "
            "same way. Compare two of one kind, or pass --force."
        )
    if a.gpu and b.gpu and a.gpu != b.gpu and not force:
        raise DiffInputError(
            f"{a.name} is for {a.gpu} and {b.name} for {b.gpu}: a change of GPU moves the peak by "
            "itself. Predict both for one GPU, or pass --force."
        )
    both_outside = a.outside_bytes is not None and b.outside_bytes is not None
    outside = (b.outside_bytes or 0) - (a.outside_bytes or 0) if both_outside else 0
    notes = list(a.notes + b.notes)
    if not both_outside:
        notes.append("memory outside PyTorch is not known on both sides: its part is 0")
    return RunDiff(
        a=a,
        b=b,
        allocated_delta_bytes=b.allocated_at_peak_bytes - a.allocated_at_peak_bytes,
        placement_delta_bytes=b.placement_bytes - a.placement_bytes,
        outside_delta_bytes=outside,
        by_category=_deltas(a.by_category_bytes, b.by_category_bytes),
        top_sites=_deltas(a.by_site_bytes, b.by_site_bytes),
        divergence=_divergence(a, b),
        segment_deltas=_deltas(_segment_bytes(a), _segment_bytes(b)),
        notes=tuple(notes),
    )

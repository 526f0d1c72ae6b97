"""Why a recorded program ran out of memory, from its memory snapshot.

``diagnose_snapshot`` reads the figures an OOM message would print from the snapshot, ideally one
taken at the OOM: the device trace's last ``oom`` entry gives the request (its ``size``, the
rounded size) and ``device_free`` (cudaMemGetInfo at the OOM; CUDACachingAllocator.cpp malloc,
ref §4 step 10); walking the trace gives allocated and reserved memory at that moment and the
largest free block. These go through the same classification as an error text
(``diagnose_oom_text``), and then the trace adds what a message cannot show:

- ``leak``: the trace repeats an iteration (the sequence of allocation sizes and sites recurs
  with a fixed period) and the allocated memory at each iteration's trough rises steadily. The
  first iteration is left out when there are four or more (warm-up: optimizer state, caches).
- ``transient_spike``: at the OOM (or the peak) most of the memory is short-lived: the failed
  request plus allocations made just before the moment and freed just after, at least as much
  as the steady level under them.

Without an ``oom`` entry the snapshot's peak-allocated moment is diagnosed instead, and the
diagnosis says so. Remedies are priced by replaying the trace (``_remedies``).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace

from oomkit.core.allocator import round_size
from oomkit.core.gpus import DEFAULT_CONTEXT_OVERHEAD_BYTES, GpuSpec
from oomkit.core.replay import config_from_settings, recorded_torch_version
from oomkit.core.snapshot import Snapshot, SnapshotSegment
from oomkit.core.trace import TraceEvent
from oomkit.diagnose._model_remedies import caught_oom_remedy, estimated_model_remedies
from oomkit.diagnose._remedies import (
    allocator_remedies,
    batch_remedy,
    empty_cache_remedy,
    leak_remedy,
    set_max_split_size_note,
    spike_remedy,
)
from oomkit.diagnose.attribution import (
    MIN_LEAK_BYTES,
    TraceHistory,
    attribute,
    site_of,
    trace_history,
)
from oomkit.diagnose.diagnosis import Diagnosis, Finding, Remedy, diagnose_oom_text
from oomkit.diagnose.oom_text import OomText
from oomkit.diagnose.script_frames import script_of
from oomkit.errors import UnknownDeviceError
from oomkit.units import format_bytes

__all__ = ["Iterations", "diagnose_snapshot", "find_iterations", "leak_finding", "spike_finding"]

# A leak must grow by at least MIN_LEAK_BYTES (and 1% of the peak) to be reported, as for the
# per-step leak test of memory_health: smaller growth is real but never the cause of an OOM.
_MIN_LEAK_BYTES = MIN_LEAK_BYTES
# "Short-lived" for a spike: made and freed within this many trace events of the moment (or
# 1/50 of the trace, whichever is more).
_MIN_SPIKE_WINDOW_EVENTS = 8
_SEGMENT_ACTIONS = ("segment_alloc", "segment_free", "segment_map", "segment_unmap")


@dataclass(frozen=True)
class Iterations:
    """A repeated iteration found in the trace.

    Attributes:
        period_allocs: allocations per iteration.
        window_starts: trace index where each complete iteration starts, then where the last
            one ends.
        minima_bytes: the lowest allocated memory during each complete iteration.
    """

    period_allocs: int
    window_starts: tuple[int, ...]
    minima_bytes: tuple[int, ...]


def _pick_device(snapshot: Snapshot, device: int | None) -> int:
    devices = snapshot.devices()
    if device is not None:
        if device not in devices and not (not devices and device == 0):
            listed = ", ".join(str(d) for d in devices) or "none"
            raise UnknownDeviceError(
                f"the snapshot has no device {device}; it holds device(s) {listed}. "
                f"Pass one of those (--device {devices[0] if devices else 0})."
            )
        return device
    for d in devices:
        if any(ev.action == "oom" for ev in snapshot.trace_for(d)):
            return d
    return devices[0] if devices else 0


def _site_key(frames: Sequence) -> tuple[str, int] | None:
    frame = site_of(frames)
    return None if frame is None else (frame.filename, frame.line)


def _period(keys: Sequence[object]) -> int | None:
    """The smallest period p >= 2 with keys[j] == keys[j + p] for 90% of j past the first quarter.

    Only gaps between repeats of one key are tried, so a long trace costs a few passes.
    """
    n = len(keys)
    positions: dict[object, list[int]] = defaultdict(list)
    for j, key in enumerate(keys):
        positions[key].append(j)
    candidates: set[int] = set()
    for pos in positions.values():
        if len(pos) >= 3:
            candidates.update(b - a for a, b in zip(pos, pos[1:], strict=False))
    start = n // 4
    for p in sorted(c for c in candidates if 2 <= c <= n // 3):  # at least three iterations
        allowed = (n - p - start) // 10
        bad = 0
        for j in range(start, n - p):
            if keys[j] != keys[j + p]:
                bad += 1
                if bad > allowed:
                    break
        else:
            return p
    return None


def find_iterations(history: TraceHistory, upto: int) -> Iterations | None:
    """Repeated iterations in the trace up to event ``upto``, or None when none recur.

    Iterations are found from the recurring sequence of (size, user frame) of the allocations;
    each window starts at the trough of allocated memory, and every window must free something.
    """
    events = history.events
    alloc_at = [i for i in range(upto + 1) if events[i].action == "alloc"]
    keys = [(events[i].size, _site_key(events[i].frames)) for i in alloc_at]
    p = _period(keys)
    if p is None:
        return None
    levels = history.allocated_bytes

    def before(j: int) -> int:
        i = alloc_at[j]
        return levels[i - 1] if i > 0 else history.start_allocated_bytes

    n = len(keys)
    phase = min(range(max(0, n - 2 * p), n - p), key=lambda j: (before(j), j)) % p
    starts = [alloc_at[j] for j in range(phase, n, p)]
    if len(starts) < 2:
        return None
    minima = []
    for s, e in zip(starts, starts[1:], strict=False):
        if not any(ev.action == "free_requested" for ev in events[s:e]):
            return None  # an iteration frees its temporaries; this is a growing list, not a loop
        below = levels[s - 1] if s > 0 else history.start_allocated_bytes
        minima.append(min(below, *levels[s:e]))
    return Iterations(p, tuple(starts), tuple(minima))


def leak_finding(history: TraceHistory, iterations: Iterations | None, upto: int) -> Finding | None:
    """A ``leak`` finding when the troughs of the iterations rise steadily, else None."""
    if iterations is None:
        return None
    minima = list(iterations.minima_bytes)
    starts = list(iterations.window_starts)
    if len(minima) >= 4:  # the first iteration warms up (optimizer state, cuDNN/cuBLAS caches)
        minima, starts = minima[1:], starts[1:]
    if len(minima) < 3:
        return None
    rises = [b - a for a, b in zip(minima, minima[1:], strict=False)]
    if any(d < 0 for d in rises) or 3 * sum(d > 0 for d in rises) < 2 * len(rises):
        return None
    growth = minima[-1] - minima[0]
    if growth < max(_MIN_LEAK_BYTES, max(history.allocated_bytes, default=0) // 100):
        return None
    per_iteration = growth // len(rises)
    # Where it leaks: allocations made once per counted iteration and still live at the moment.
    kept: dict[str, list[int]] = defaultdict(list)
    for rec in history.records:
        if starts[0] <= rec.alloc_index <= upto and rec.live_at(upto):
            frame = site_of(rec.frames)
            label = f"{frame.filename}:{frame.line} in {frame.name}" if frame else ""
            kept[label].append(rec.size_bytes)
    site = None
    per_site = 0
    for label, sizes in kept.items():
        if label and len(sizes) >= len(rises) and sum(sizes) > per_site:
            site, per_site = label, sum(sizes)
    evidence = {
        "leaked_bytes": growth,
        "growth_per_iteration_bytes": per_iteration,
        "first_minimum_bytes": minima[0],
        "last_minimum_bytes": minima[-1],
        "iterations": len(minima),
        "allocations_per_iteration": iterations.period_allocs,
    }
    if site is not None:
        evidence["leak_site_bytes"] = per_site
    return Finding(
        "leak",
        growth,
        f"allocated memory at the start of each iteration grew by {format_bytes(per_iteration)}"
        f" per iteration, {format_bytes(growth)} over {len(minima)} iterations"
        + (f"; kept from {site}" if site else ""),
        evidence,
    )


def spike_finding(history: TraceHistory, index: int, request_bytes: int) -> Finding | None:
    """A ``transient_spike`` finding when short-lived memory dominates the moment, else None.

    Short-lived: allocated within the window before ``index`` and freed within it after
    (``_MIN_SPIKE_WINDOW_EVENTS`` or 1/50 of the trace). The failed request counts as
    short-lived when other short-lived memory is there or when it alone is at least the level
    under it.
    """
    window = max(_MIN_SPIKE_WINDOW_EVENTS, len(history.events) // 50)
    transient = [
        r
        for r in history.records
        if r.live_at(index)
        and r.alloc_index >= index - window
        and r.freed_index is not None
        and r.freed_index <= index + window
    ]
    transient_bytes = sum(r.size_bytes for r in transient)
    peak = history.allocated_bytes[index] + request_bytes
    spike = transient_bytes + request_bytes
    steady = peak - spike
    if spike <= 0 or spike < steady:
        return None
    largest = max(transient, key=lambda r: r.size_bytes, default=None)
    frame = site_of(largest.frames) if largest is not None else None
    site = f"{frame.filename}:{frame.line} in {frame.name}" if frame else None
    return Finding(
        "transient_spike",
        spike,
        f"{format_bytes(spike)} of the {format_bytes(peak)} needed at the "
        + ("OOM" if request_bytes else "peak")
        + f" was short-lived ({len(transient)} allocation(s) made and freed within {window} "
        f"events" + (" plus the failed request" if request_bytes else "") + "), over a steady "
        f"level of {format_bytes(steady)}" + (f"; the largest from {site}" if site else ""),
        {
            "spike_bytes": spike,
            "steady_bytes": steady,
            "peak_bytes": peak,
            "transient_bytes": transient_bytes,
            "requested_bytes": request_bytes,
        },
    )


def _largest_free_at(
    segments: Sequence[SnapshotSegment], history: TraceHistory, index: int | None
) -> int | None:
    """The largest free block of the default pool just after event ``index`` (None: the end).

    The final segments minus the blocks live then; unknown (None) when segments were created or
    released after the moment, since the layout then differed.
    """
    events = history.events
    if index is not None and any(ev.action in _SEGMENT_ACTIONS for ev in events[index + 1 :]):
        return None
    at = len(events) if index is None else index
    busy = sorted((r.address, r.address + r.size_bytes) for r in history.records if r.live_at(at))
    largest = 0
    for seg in segments:
        if seg.pool_id != (0, 0):
            continue
        # Pending frees (record_stream) are not reusable yet either.
        pending = [
            (b.address, b.address + b.size) for b in seg.blocks if b.state == "active_pending_free"
        ]
        cursor, end = seg.address, seg.address + seg.total_size
        # Blocks never straddle segments: only those starting inside this one matter.
        inside = busy[bisect_left(busy, (cursor, cursor)) : bisect_left(busy, (end, end))]
        for lo, hi in sorted([*inside, *pending]):
            if hi <= cursor or lo >= end:
                continue
            largest = max(largest, lo - cursor)
            cursor = max(cursor, hi)
        largest = max(largest, end - cursor)
    return largest


def diagnose_snapshot(
    snapshot: Snapshot,
    *,
    device: int | None = None,
    gpu: GpuSpec | None = None,
    torch_version: str | None = None,
    memory_fraction: float | None = None,
    price_settings: bool = True,
) -> Diagnosis:
    """Diagnose the OOM a snapshot recorded (or, without one, its peak).

    Args:
        snapshot: from ``load_snapshot``.
        device: the device to diagnose; None picks the first with an ``oom`` entry, else the
            first used device.
        gpu: the GPU it ran on (snapshots do not record it); without it, memory held outside
            PyTorch cannot be told from the CUDA context and is not assessed.
        torch_version: the PyTorch version to model; None infers it from the file.
        memory_fraction: ``set_per_process_memory_fraction`` in effect, if any (snapshots record
            it only when set through the allocator settings).
        price_settings: replay the trace under alternative allocator settings to price them.

    Returns:
        The diagnosis (``source == "snapshot"``), with the attribution at the moment diagnosed.

    Raises:
        UnknownDeviceError: ``device`` is not in the snapshot.
    """
    device = _pick_device(snapshot, device)
    events = snapshot.trace_for(device)
    script = _script_recorded(events)
    segments = snapshot.segments_for(device)
    version = torch_version if torch_version is not None else recorded_torch_version(snapshot)
    config, settings_warnings = config_from_settings(snapshot.allocator_settings, version)
    divisions = config.roundup_power2_divisions
    history = trace_history(events, segments, lambda n: round_size(n, divisions))
    warnings = list(settings_warnings)
    oom_index = next((i for i in range(len(events) - 1, -1, -1) if events[i].action == "oom"), None)
    last = len(events) - 1

    index: int | None  # the moment diagnosed: the OOM, else the peak (None: no trace)
    if oom_index is not None:
        ev = events[oom_index]
        q, f = ev.size, ev.address
        a, r = history.allocated_bytes[oom_index], history.reserved_bytes[oom_index]
        spec = gpu
        if spec is None:
            spec = GpuSpec(
                "an unrecorded GPU",
                r + f + DEFAULT_CONTEXT_OVERHEAD_BYTES,
                DEFAULT_CONTEXT_OVERHEAD_BYTES,
            )
            warnings.append(
                "the snapshot does not record the GPU: memory outside PyTorch (other "
                "processes, NCCL) was not assessed; pass --gpu NAME"
            )
        t = spec.total_memory_bytes
        fraction = (
            memory_fraction if memory_fraction is not None else (config.per_process_memory_fraction)
        )
        allowed = int(fraction * t) if fraction is not None and fraction < 1.0 else None
        parsed = OomText(
            "native",
            "",
            device=device,
            requested_bytes=q,
            total_bytes=t,
            free_bytes=f,
            allocated_bytes=a,
            reserved_bytes=r,
            allowed_bytes=allowed,
        )
        base = diagnose_oom_text(parsed, spec, expandable_segments=config.expandable_segments)
        largest_free = _largest_free_at(segments, history, oom_index)
        findings = [_with_largest_free(x, largest_free) for x in base.causes]
        # The text diagnosis estimates expandable segments; the replay below prices it.
        remedies = [x for x in base.remedies if x.title != "expandable segments"]
        # Its note that the run already had expandable segments on (the recorded settings).
        warnings += [w for w in base.warnings if "already had it on" in w]
        memory = base.memory_explained + (
            "" if gpu is not None else " (The GPU is not recorded: the context figure is typical.)"
        )
        moment, index, request = "oom", oom_index, q
        figures = {
            "requested_bytes": q,
            "allocated_bytes": a,
            "reserved_bytes": r,
            "free_bytes": f,
            "total_bytes": t if gpu is not None else None,
            "allowed_bytes": allowed,
            "largest_free_block_bytes": largest_free,
        }
        deficit = base.deficit_bytes
    else:
        index = (
            max(range(len(events)), key=lambda i: (history.allocated_bytes[i], -i))
            if events
            else None
        )
        a = history.allocated_bytes[index] if index is not None else history.start_allocated_bytes
        r = history.reserved_bytes[index] if index is not None else history.start_reserved_bytes
        moment, request = ("peak" if index is not None else "final"), 0
        # Each figure names its moment: the peak of allocated memory (diagnosed here), the
        # peak of reserved memory (where fragmentation is measured, as `oomkit diff` does), the
        # end of the snapshot (its segments).
        when = "the peak of allocated memory" if moment == "peak" else "the end of the snapshot"
        largest_free = _largest_free_at(segments, history, index)
        findings = [
            Finding(
                "shortage",
                0,
                f"at {when} tensors held {format_bytes(a)} and PyTorch "
                f"reserved {format_bytes(r)}",
                {"allocated_bytes": a, "reserved_bytes": r},
            )
        ]
        remedies = []
        warnings.append(
            f"the snapshot records no OOM: its state at {when} was diagnosed. Take the snapshot "
            "in the except handler of torch.OutOfMemoryError (or run under `oomkit run`)"
        )
        memory = (
            f"Allocated ({format_bytes(a)}, torch.cuda.memory_allocated) is what live tensors "
            f"used at {when}. Reserved ({format_bytes(r)}, torch.cuda.memory_reserved) is "
            f"what PyTorch's caching allocator held then: the allocated memory plus "
            f"{format_bytes(r - a)} cached for reuse."
            + _at_peak_reserved(history, index)
            + " nvidia-smi shows the reserved memory plus the CUDA context, libraries such as "
            "cuBLAS and NCCL, and other processes."
        )
        peak = history.peak_reserved_moment()
        figures = {
            "allocated_bytes": a,
            "reserved_bytes": r,
            "largest_free_block_bytes": largest_free,
            # The one fragmentation figure (`oomkit diff`'s): reserved - allocated at the first
            # moment reserved memory is at its peak.
            "fragmentation_at_peak_reserved_bytes": None
            if peak is None
            else history.reserved_bytes[peak] - history.allocated_bytes[peak],
        }
        deficit = None
        # Only without an OOM: at one, PyTorch has already released wholly free segments.
        empty = empty_cache_remedy(segments)
        remedies += [empty] if empty is not None else []

    upto = index if index is not None else last
    exceeds = findings[0].cause == "request_exceeds_device"
    if events and index is not None and not exceeds:
        iterations = find_iterations(history, upto)
        leak = leak_finding(history, iterations, upto)
        spike = spike_finding(history, index, request)
        for extra in (leak, spike):
            if extra is not None:
                findings.append(extra)
        if leak is not None:
            remedies.append(leak_remedy(leak.explained_bytes, _site_of_summary(leak)))
        if spike is not None:
            remedies.append(spike_remedy(spike.explained_bytes, _site_of_summary(spike)))
        lowest = _steady_level(history, iterations, upto)
        if oom_index is not None and lowest is not None:
            available = r + events[oom_index].address
            allowed_bytes = figures.get("allowed_bytes")
            if allowed_bytes:
                available = min(available, allowed_bytes)
            batch = batch_remedy(
                need_bytes=a + request,
                steady_bytes=lowest,
                available_bytes=available,
                measured_from="the trace: the step's peak above its lowest allocated level",
            )
            remedies += [batch] if batch is not None else []
    if price_settings and events and not exceeds and findings[0].cause != "fraction_limit":
        capacity = None
        if oom_index is not None:
            capacity = r + events[oom_index].address
        priced, replay_warnings = allocator_remedies(
            snapshot, device, capacity_bytes=capacity, torch_version=version, script=script
        )
        remedies += priced
        warnings += replay_warnings
    note = set_max_split_size_note([fr for ev in events for fr in ev.frames], script)
    remedies += [note] if note is not None else []
    attribution = attribute(history, index, moment)
    if not exceeds and any(f.cause in ("shortage", "transient_spike") for f in findings):
        # Only oomkit's traces carry category tags; a plain PyTorch snapshot offers none.
        cats = attribution.by_category_bytes
        remedies += estimated_model_remedies(
            cats,
            training=cats.get("gradient", 0) + cats.get("optimizer_state", 0) > 0,
            compute_capability=gpu.compute_capability if gpu is not None else None,
        )
    held = _held_after_caught_oom(history, oom_index)
    remedies += [caught_oom_remedy(held)] if held else []

    findings.sort(key=lambda x: -x.explained_bytes)
    remedies.sort(key=Remedy.rank_key)
    return Diagnosis(
        cause=findings[0].cause,
        causes=tuple(findings),
        remedies=tuple(_dedupe(remedies)),
        memory_explained=memory,
        deficit_bytes=deficit,
        warnings=tuple(dict.fromkeys(warnings)),
        source="snapshot",
        attribution=attribution,
        figures_bytes=figures | {"event_index": index},
    )


def _at_peak_reserved(history: TraceHistory, index: int | None) -> str:
    """The sentence on fragmentation at peak reserved, where that is another moment."""
    peak = history.peak_reserved_moment()
    if peak is None or index is None or peak == index:
        return ""
    reserved, allocated = history.reserved_bytes[peak], history.allocated_bytes[peak]
    return (
        f" At the peak of reserved memory ({format_bytes(reserved)}, trace event {peak}) "
        f"{format_bytes(allocated)} was allocated: {format_bytes(reserved - allocated)} reserved "
        "but unallocated, the fragmentation `oomkit diff` reports."
    )


def _held_after_caught_oom(history: TraceHistory, last_oom: int | None) -> int:
    """Bytes of the step that failed first still live at a later OOM (a traceback holds them).

    The failed step starts at the last lowest allocated level between the first allocation
    (parameters, or whatever the trace starts with, counts as state) and the first ``oom``
    entry; its blocks still live at the last ``oom`` entry were kept by the handler. A heuristic.
    """
    events = history.events
    if last_oom is None:
        return 0
    first = next(i for i, ev in enumerate(events) if ev.action == "oom")
    begin = next((i for i, ev in enumerate(events) if ev.action == "alloc"), first)
    if first == last_oom or begin >= first:
        return 0
    levels = history.allocated_bytes
    start = min(range(begin, first), key=lambda i: (levels[i], -i))
    return sum(
        rec.size_bytes
        for rec in history.records
        if start < rec.alloc_index < first and rec.live_at(last_oom)
    )


def _with_largest_free(finding: Finding, largest_free: int | None) -> Finding:
    if finding.cause != "fragmentation" or largest_free is None:
        return finding
    return replace(
        finding,
        summary=f"{finding.summary}; the largest free block was {format_bytes(largest_free)}",
        evidence_bytes={**finding.evidence_bytes, "largest_free_block_bytes": largest_free},
    )


def _site_of_summary(finding: Finding) -> str | None:
    for marker in ("; kept from ", "; the largest from "):
        if marker in finding.summary:
            return finding.summary.split(marker, 1)[1]
    return None


def _steady_level(history: TraceHistory, iterations: Iterations | None, upto: int) -> int | None:
    """What stays allocated across steps, or None when the trace cannot tell.

    The last iteration's trough; without repeated iterations, what was live when recording
    began (a recording started after the model was built: parameters and optimizer state),
    if the trace never dips below it. A trace that starts empty cannot tell parameters from
    activations.
    """
    if iterations is not None:
        return iterations.minima_bytes[-1]
    start = history.start_allocated_bytes
    if start <= 0 or min(history.allocated_bytes[: upto + 1], default=start) < start:
        return None
    return start


# The events searched for a stack that shows the script (a bound on a long trace's time; the
# main thread's allocations show it from the first).
_SCRIPT_SEARCH_EVENTS = 10_000


def _script_recorded(events: Sequence[TraceEvent]) -> str | None:
    """The script the recorded stacks show Python running: the outermost Python frame of an
    event's stack (``_record_memory_history(stacks="all")`` puts C++ frames around them; only
    ``.py`` files are Python's), where it is a script's top level (``script_of``)."""
    for event in events[:_SCRIPT_SEARCH_EVENTS]:
        python = [frame for frame in event.frames if frame.filename.endswith(".py")]
        if python:
            script = script_of(python[-1].filename, python[-1].name)
            if script is not None:
                return script
    return None


def _dedupe(remedies: list[Remedy]) -> list[Remedy]:
    seen: set[str] = set()
    out = []
    for remedy in remedies:
        if remedy.title not in seen:
            seen.add(remedy.title)
            out.append(remedy)
    return out

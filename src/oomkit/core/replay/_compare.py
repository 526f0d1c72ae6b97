"""Comparing a replay with its recording: segment decisions, final state, divergence context."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from oomkit.core.allocator.state import snapshot_keys
from oomkit.core.replay.reconstruct import SeedSegment
from oomkit.core.replay.result import Divergence, SegmentEvent
from oomkit.core.trace import TraceEvent

__all__ = [
    "first_divergence",
    "first_segment_difference",
    "format_event",
    "normalise_segments",
    "seed_segment_keys",
    "seed_segments_as_dicts",
    "simulated_segment_keys",
]

# Trace events shown before and after a divergence.
CONTEXT_BEFORE = 4
CONTEXT_AFTER = 2

SegmentKey = tuple[int, int, int, str, bool, tuple[tuple[int, int, str], ...]]


def format_event(index: int, event: TraceEvent) -> str:
    """One trace event as a line of divergence context."""
    return (
        f"[{index}] {event.action} {event.address:#x} size={event.size:,} stream={event.stream}"
    )


def first_divergence(
    recorded: Sequence[SegmentEvent],
    recorded_trace_index: Sequence[int],
    simulated: Sequence[SegmentEvent],
    simulated_trace_index: Sequence[int],
    events: Sequence[TraceEvent],
) -> tuple[int, Divergence | None]:
    """How many segment events match in order, and where the first difference is.

    Args:
        recorded: the trace's segment events, in order.
        recorded_trace_index: the trace index of each recorded segment event.
        simulated: the simulator's ``segment_log``.
        simulated_trace_index: the trace index being replayed when each simulated one was logged.
        events: the trace, for the context lines.

    Returns:
        ``(matched, divergence)``; ``divergence`` is None when both sequences are equal.
    """
    matched = 0
    for rec, sim in zip(recorded, simulated, strict=False):
        if tuple(rec) != tuple(sim):
            break
        matched += 1
    if matched == len(recorded) == len(simulated):
        return matched, None
    expected = tuple(recorded[matched]) if matched < len(recorded) else None
    actual = tuple(simulated[matched]) if matched < len(simulated) else None
    if matched < len(recorded):
        where: int | None = recorded_trace_index[matched]
    elif matched < len(simulated_trace_index):
        where = simulated_trace_index[matched]
    else:
        where = None
    context: tuple[str, ...] = ()
    if where is not None and events:
        lo = max(0, where - CONTEXT_BEFORE)
        hi = min(len(events), where + CONTEXT_AFTER + 1)
        context = tuple(
            ("> " if j == where else "  ") + format_event(j, events[j]) for j in range(lo, hi)
        )
    return matched, Divergence(
        segment_event_index=matched,
        trace_event_index=where,
        expected=expected,  # type: ignore[arg-type]
        actual=actual,  # type: ignore[arg-type]
        context=context,
    )


def normalise_segments(segments: Iterable[Mapping]) -> list[SegmentKey]:
    """Segments as comparable keys: address, size, stream, pool kind, expandable flag and the
    (address, size, state) of every block. Requested sizes are left out: a free block's is
    stale (§11.2)."""
    out = []
    for seg in segments:
        blocks = tuple(
            (int(b["address"]), int(b["size"]), str(b["state"])) for b in seg["blocks"]
        )
        out.append(
            (
                int(seg["address"]),
                int(seg["total_size"]),
                int(seg.get("stream", 0)),
                str(seg.get("segment_type")),
                bool(seg.get("is_expandable")),
                blocks,
            )
        )
    return sorted(out)


def simulated_segment_keys(segments: Iterable[dict[str, Any]]) -> list[SegmentKey]:
    """``normalise_segments`` of ``CachingAllocator.snapshot()``'s own dicts, whose fields are
    already ints, strs and bools: no conversions (this runs on every verify, issue 19; the
    allocator's compiled ``snapshot_keys``, issue 41)."""
    return snapshot_keys(segments)


def seed_segment_keys(segments: Iterable[SeedSegment]) -> list[SegmentKey]:
    """``normalise_segments(seed_segments_as_dicts(segments))`` without building the dicts."""
    return sorted(
        [
            (
                s.address,
                s.total_size,
                s.stream,
                "small" if s.is_small else "large",
                s.expandable,
                tuple([(b.address, b.size, b.state) for b in s.blocks]),
            )
            for s in segments
        ]
    )


def first_segment_difference(
    simulated: Iterable[Mapping], recorded: Iterable[Mapping]
) -> str | None:
    """The first segment where two final states differ, described in one line; None if equal."""
    sim = {key[0]: key for key in normalise_segments(simulated)}
    rec = {key[0]: key for key in normalise_segments(recorded)}
    for address in sorted(set(sim) | set(rec)):
        s, r = sim.get(address), rec.get(address)
        if s == r:
            continue
        if s is None:
            return f"the recording has a segment at {address:#x} that the simulator does not"
        if r is None:
            return f"the simulator has a segment at {address:#x} that the recording does not"
        if s[:5] != r[:5]:
            return (
                f"segment {address:#x}: recorded {r[1]:,} B stream {r[2]} {r[3]}, "
                f"simulated {s[1]:,} B stream {s[2]} {s[3]}"
            )
        for sb, rb in zip(s[5], r[5], strict=False):
            if sb != rb:
                return (
                    f"segment {address:#x}: recorded block {rb[0]:#x} {rb[1]:,} B {rb[2]}, "
                    f"simulated {sb[0]:#x} {sb[1]:,} B {sb[2]}"
                )
        return f"segment {address:#x}: recorded {len(r[5])} blocks, simulated {len(s[5])}"
    return None


def seed_segments_as_dicts(segments: Iterable[SeedSegment]) -> list[dict]:
    """Reconstructed or recorded segments in the shape of ``CachingAllocator.snapshot()``."""
    return [
        {
            "address": s.address,
            "total_size": s.total_size,
            "stream": s.stream,
            "segment_type": "small" if s.is_small else "large",
            "is_expandable": s.expandable,
            "blocks": [
                {
                    "address": b.address,
                    "size": b.size,
                    "requested_size": b.requested_size,
                    "state": b.state,
                }
                for b in s.blocks
            ],
        }
        for s in segments
    ]

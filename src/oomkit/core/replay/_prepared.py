"""What every replay of one snapshot's device starts from, computed once per snapshot object.

``tune`` and ``replay --what-if`` replay one snapshot under many settings. The trace without
private-pool entries, the recorded setting, the final segments, the reconstructed start state
and the positions of the segment decisions do not depend on the setting replayed, so they are
computed at the first replay and reused by the next ones (and, computed before the process pool
forks, by its workers). They are kept while the snapshot object lives (by identity: a snapshot
is never mutated) and dropped with it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from oomkit.core.allocator import DEFAULT_CAPACITY_BYTES, AllocatorConfig, round_size
from oomkit.core.allocator.state import check_seed_segments
from oomkit.core.replay._compare import SegmentKey, seed_segment_keys
from oomkit.core.replay._recorded import (
    config_from_settings,
    default_pool_events,
    final_segments_for,
    recorded_torch_version,
)
from oomkit.core.replay.columns import TraceColumns, trace_columns
from oomkit.core.replay.engine import CREATE, RELEASE, SEGMENT_ACTIONS
from oomkit.core.replay.reconstruct import (
    LARGE_PAGE_BYTES,
    SeedSegment,
    StartState,
    reconstruct_walked,
    small_pool_pages,
)
from oomkit.core.replay.result import SegmentEvent
from oomkit.core.trace import TraceEvent
from oomkit.errors import OomkitError

if TYPE_CHECKING:
    from oomkit.core.snapshot import Snapshot

__all__ = [
    "Prepared",
    "SeedPlan",
    "completion_groups",
    "prepared",
    "recorded_peak_reserved",
    "seed_plan",
    "verify_capacity",
]

# Trace entries whose positions are noted once: segment decisions and oom entries.
MARKED = frozenset((*SEGMENT_ACTIONS, "oom"))
# ExpandableSegment: reservation = ceil((T + T/8) / page) pages (§8.1).
_RESERVE_NUM, _RESERVE_DEN = 9, 8


@dataclass(frozen=True)
class SeedPlan:
    """A start state as every replay seeds it, made and checked once (issue 41: the tuples
    and checks made per replay were a tenth of a compiled verify's instructions)."""

    # Per start segment: (address, total_size, stream, is_small, blocks, expandable), as
    # CachingAllocator.seed_segments reads it; check_seed_segments(rows), in the same order.
    rows: tuple[tuple[int, int, int, bool, tuple[tuple[int, int, int, bool], ...], bool], ...]
    checks: tuple[OomkitError | None, ...]
    # Per start segment: (address, pending) of its live blocks in address order (pending:
    # freed, its completion deferred).
    held: tuple[tuple[tuple[int, bool], ...], ...]
    held_all: tuple[tuple[int, bool], ...]  # every segment's ``held``, in order
    # Expandable reservations that begin below their lowest run mapped at the start:
    # (base, stream, is_small, first_run), seeded before the runs (reservation_bases).
    reservations: tuple[tuple[int, int, bool, int], ...] = ()


def reservation_bases(
    start: StartState, creations: Sequence[TraceEvent]
) -> tuple[tuple[int, int, bool, int], ...]:
    """§15.5: where an expandable reservation begins when the trace maps pages below the lowest
    run it had mapped at the start (``empty_cache`` unmapped the reservation's first pages
    before the recording began, and a later request maps them again).

    PyTorch maps into the lowest unmapped range of the stream's reservations that has room
    (``try_allocate_expandable_block``, ref §8.3), so where a request maps depends on those
    pages belonging to the reservation; seeded from its runs alone, the reservation would
    begin at the lowest run and the request would map above the highest. One reservation of
    a stream and pool holds all its mappings (it spans the device's memory and an eighth,
    §8.1, and another is made only when none has room), so the lowest ``segment_map`` of the
    stream and pool kind below the lowest run is the reservation's base, or above it. Not
    given when a classic segment (at the start or created in the trace) lies in between.

    Args:
        start: the reconstructed start state.
        creations: the trace's ``segment_alloc`` and ``segment_map`` entries.

    Returns:
        ``(base, stream, is_small, first_run)`` per (stream, pool kind), lowest first.
    """
    lowest: dict[tuple[int, bool], int] = {}
    for seg in start.segments:
        if seg.expandable:
            key = (seg.stream, seg.is_small)
            lowest[key] = min(lowest.get(key, seg.address), seg.address)
    if not lowest:
        return ()
    below: dict[tuple[int, bool], int] = {}
    classic = [
        (seg.address, seg.address + seg.total_size) for seg in start.segments if not seg.expandable
    ]
    for ev in creations:
        if ev.action == "segment_alloc":
            classic.append((ev.address, ev.address + ev.size))
            continue
        key = (ev.stream, small_pool_pages(ev.size))
        first = lowest.get(key)
        if first is not None and ev.address < first:
            below[key] = min(below.get(key, ev.address), ev.address)
    bases = []
    for key, base in below.items():
        first = lowest[key]
        if any(lo < first and hi > base for lo, hi in classic):
            continue
        bases.append((base, key[0], key[1], first))
    return tuple(sorted(bases))


def seed_plan(start: StartState, creations: Sequence[TraceEvent] = ()) -> SeedPlan:
    """``start``'s :class:`SeedPlan`; ``creations``, the trace's ``segment_alloc`` and
    ``segment_map`` entries, place the reservations (:func:`reservation_bases`)."""
    rows = tuple(
        (
            seg.address,
            seg.total_size,
            seg.stream,
            seg.is_small,
            tuple((b.address, b.size, b.requested_size, b.state != "inactive") for b in seg.blocks),
            seg.expandable,
        )
        for seg in start.segments
    )
    held = tuple(
        tuple(
            (b.address, b.state == "active_pending_free")
            for b in seg.blocks
            if b.state in ("active_allocated", "active_pending_free")
        )
        for seg in start.segments
    )
    return SeedPlan(
        rows=rows,
        checks=tuple(check_seed_segments(rows)),
        held=held,
        held_all=tuple(pair for pairs in held for pair in pairs),
        reservations=reservation_bases(start, creations),
    )


@dataclass(frozen=True)
class Prepared:
    """One device's replay inputs that no replayed setting or capacity changes."""

    events: tuple[TraceEvent, ...]
    private_events: int
    version: str | None
    recorded_config: AllocatorConfig
    settings_warnings: tuple[str, ...]
    final: tuple[SeedSegment, ...]
    private_segments: int
    start: StartState
    # Trace indices of the segment decisions and oom entries, and the decisions themselves.
    marks: tuple[int, ...]
    recorded: tuple[tuple[int, SegmentEvent], ...]
    allocs: int  # alloc entries in ``events``
    columns: TraceColumns  # ``events`` as the replay loop reads them
    final_keys: list[SegmentKey]  # seed_segment_keys(final): what a verify compares with
    seed: SeedPlan  # seed_plan(start, the trace's segment creations)
    groups: dict[int, int]  # completion_groups(events, marks)
    recorded_peak: int  # recorded_peak_reserved(start, recorded)
    # verify_capacity(None, start, recorded, final): a verify's device size unless one is given.
    verify_capacity: int


# id(snapshot) -> (a weak reference to it, {(device, torch_version): Prepared}).
_CACHE: dict[int, tuple[weakref.ref[Snapshot], dict[tuple[int, str | None], Prepared]]] = {}


def prepared(snapshot: Snapshot, device: int, torch_version: str | None) -> Prepared:
    """The replay inputs of ``snapshot``'s ``device`` (cached while the snapshot lives).

    Args:
        snapshot: the loaded snapshot (never mutated).
        device: a device it holds (the caller checked it).
        torch_version: the version to model; None reads it from the snapshot's keys.
    """
    key = id(snapshot)
    entry = _CACHE.get(key)
    if entry is None or entry[0]() is not snapshot:
        ref = weakref.ref(snapshot, _forget(key))
        entry = _CACHE[key] = (ref, {})
    by_device = entry[1]
    found = by_device.get((device, torch_version))
    if found is None:
        found = by_device[(device, torch_version)] = _prepare(snapshot, device, torch_version)
    return found


def _forget(key: int) -> Callable[[weakref.ref[Snapshot]], None]:
    """The weak reference's callback: drop the snapshot's entry when it dies."""

    def forget(ref: weakref.ref[Snapshot]) -> None:
        entry = _CACHE.get(key)
        if entry is not None and entry[0] is ref:  # not a later snapshot given the same id
            del _CACHE[key]

    return forget


def _prepare(snapshot: Snapshot, device: int, torch_version: str | None) -> Prepared:
    keys = snapshot.keys_seen
    if keys and "trace:pool_id" not in keys:
        # The reader notes every key of every trace entry it read, and tags an entry with its
        # private pool only from a "pool_id" key: without one no entry needs dropping, and the
        # trace is not read again (issue 19). A snapshot built otherwise notes no keys.
        events, private_events = snapshot.trace_for(device), 0
    else:
        events, private_events = default_pool_events(snapshot.trace_for(device))
    version = torch_version if torch_version is not None else recorded_torch_version(snapshot)
    recorded_config, settings_warnings = config_from_settings(
        snapshot.allocator_settings, version
    )
    final, private_segments = final_segments_for(snapshot, device)
    divisions: tuple[int, ...] | None = recorded_config.roundup_power2_divisions
    if not any(d > 1 for d in divisions or ()):
        # round_size divides only with divisions > 1: None is the same rounding, sooner.
        divisions = None
    start, walk = reconstruct_walked(final, events, lambda n: round_size(n, divisions))
    # The reconstruction's walk over the trace also found the segment decisions and the oom
    # entries; the passes of a replay read these few positions instead of the whole trace
    # again (issue 19).
    marks = tuple(reversed(walk.marks))
    recorded = tuple(
        (i, (ev.action, ev.address, ev.size))
        for i in marks
        if (ev := events[i]).action in SEGMENT_ACTIONS
    )
    return Prepared(
        events=events,
        private_events=private_events,
        version=version,
        recorded_config=recorded_config,
        settings_warnings=tuple(settings_warnings),
        final=tuple(final),
        private_segments=private_segments,
        start=start,
        marks=marks,
        recorded=recorded,
        allocs=walk.allocs,
        # The reader refuses a trace entry whose address, size or stream is not an int
        # (read_entries), and notes keys: a snapshot built otherwise notes none.
        columns=trace_columns(
            events, actions=walk.actions, allocs=walk.alloc_events, ints=bool(keys)
        ),
        final_keys=seed_segment_keys(final),
        seed=seed_plan(start, [ev for i in marks if (ev := events[i]).action in CREATE]),
        groups=completion_groups(events, marks),
        recorded_peak=recorded_peak_reserved(start, recorded),
        verify_capacity=verify_capacity(None, start, recorded, final),
    )


def completion_groups(
    events: Sequence[TraceEvent], marks: Sequence[int] | None = None
) -> dict[int, int]:
    """``free_completed`` entries that directly precede a segment event or an ``oom``.

    Args:
        events: the trace.
        marks: the trace indices of its segment events and ``oom`` entries, in order (found
            here when not given); each group is found by walking back from one of them.

    Returns:
        trace index of each such entry -> index of the first entry of its group.
    """
    if marks is None:
        marks = [i for i, ev in enumerate(events) if ev.action in MARKED]
    groups: dict[int, int] = {}
    for j in marks:
        i = j
        while i > 0 and events[i - 1].action == "free_completed":
            i -= 1
        # A free_completed right after its own free_requested is usually a plain free, but
        # a deferred free that Step 9 completed at once looks the same.
        for k in range(i, j):
            groups[k] = i
    return groups


def recorded_peak_reserved(
    start: StartState, recorded: Sequence[tuple[int, SegmentEvent]]
) -> int:
    """The recording's own reserved peak: the starting reservation plus its segment events."""
    reserved = sum(s.total_size for s in start.segments)
    peak = reserved
    for _, (action, _address, size) in recorded:
        if action in CREATE:
            reserved += size
            peak = max(peak, reserved)
        elif action in RELEASE:
            reserved -= size
    return peak


def verify_capacity(
    capacity_bytes: int | None,
    start: StartState,
    recorded: Sequence[tuple[int, SegmentEvent]],
    final: Sequence[SeedSegment],
) -> int:
    """The device size that sizes expandable reservations in verify mode (§15.7).

    The user's capacity when given (the real device's makes the reservations exact); else
    80 GiB, raised if needed so that one reservation holds the largest mapped range seen.
    """
    if capacity_bytes is not None:
        return capacity_bytes
    largest = 0
    for seg in (*start.segments, *final):
        if seg.expandable:
            largest = max(largest, seg.total_size)
    for _, (action, _address, size) in recorded:
        if action in ("segment_map", "segment_unmap"):
            largest = max(largest, size)
    # pages * page >= T * 9/8, so T >= extent * 8/9 makes a reservation cover the extent; one
    # large page (kLargeBuffer) more is the margin for the page rounding.
    needed = -(-largest * _RESERVE_DEN // _RESERVE_NUM) + LARGE_PAGE_BYTES if largest else 0
    return max(DEFAULT_CAPACITY_BYTES, needed)

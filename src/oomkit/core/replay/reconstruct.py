"""Reconstruct the allocator state at the first event of a recorded trace.

Most recorded traces begin mid-run: recording started after the model was built, or the ring
buffer dropped the oldest entries. The state at the first event is rebuilt by walking the trace
backwards from the snapshot's final ``segments`` (../shared/ref/cuda-caching-allocator.md §15.1),
then recovering the sizes of blocks that were live before recording began and freed during it,
which the trace shows only as requested sizes (§15.2).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from oomkit.core.replay.columns import ALLOC, FREE_COMPLETED, FREE_REQUESTED, OTHER
from oomkit.core.trace import TraceEvent

__all__ = [
    "BlockState",
    "SeedBlock",
    "SeedSegment",
    "StartState",
    "reconstruct_start_state",
    "layout_segment",
]

BlockState = Literal["active_allocated", "active_pending_free", "inactive"]
LIVE_STATES = ("active_allocated", "active_pending_free")

# CUDACachingAllocator.cpp kSmallBuffer: every classic small-pool segment is exactly 2 MiB, and no
# large-pool segment can be (large segments are >= kMinLargeAlloc = 10 MiB), so a released classic
# segment of 2 MiB was a small one (§15.1).
SMALL_SEGMENT_BYTES = 2 * 2**20
# CUDACachingAllocator.cpp should_split: a large-pool classic block is split only when the leftover
# is > kSmallSize (1 MiB), so every free large-pool classic block is larger than 1 MiB (§4 Step 11).
LARGE_SPLIT_LEFTOVER_BYTES = 2**20
# CUDACachingAllocator.cpp kLargeBuffer: page size of large-pool expandable segments (§8.1).
LARGE_PAGE_BYTES = 20 * 2**20


def small_pool_pages(size_bytes: int) -> bool:
    """Whether a mapped or unmapped range of ``size_bytes`` is small-pool pages: ranges are
    whole pages, 2 MiB in the small pool and 20 MiB in the large (§8.1, §8.4)."""
    return size_bytes % LARGE_PAGE_BYTES != 0


@dataclass(frozen=True, slots=True)
class SeedBlock:
    """One block of a segment, as the snapshot's ``blocks`` list describes it."""

    address: int
    size: int
    requested_size: int
    state: BlockState


# SeedBlock's slots, set directly: a frozen dataclass's __init__ goes through object.__setattr__
# per field (about twice the time), and the final segments and the reconstruction make one
# record per block of every replay (issue 19).
_NEW = object.__new__
_SET_ADDRESS = SeedBlock.__dict__["address"].__set__
_SET_SIZE = SeedBlock.__dict__["size"].__set__
_SET_REQUESTED = SeedBlock.__dict__["requested_size"].__set__
_SET_STATE = SeedBlock.__dict__["state"].__set__


def new_seed_block(address: int, size: int, requested_size: int, state: BlockState) -> SeedBlock:
    """``SeedBlock(address, size, requested_size, state)``, made faster (the same record)."""
    block: SeedBlock = _NEW(SeedBlock)
    _SET_ADDRESS(block, address)
    _SET_SIZE(block, size)
    _SET_REQUESTED(block, requested_size)
    _SET_STATE(block, state)
    return block


@dataclass(frozen=True, slots=True)
class SeedSegment:
    """One segment (or, for an expandable segment, one contiguous mapped run of it).

    ``blocks`` lists the segment's blocks in address order. Final-state inputs may list only the
    live ones; :func:`layout_segment` fills the gaps with free blocks.
    """

    address: int
    total_size: int
    stream: int
    is_small: bool
    expandable: bool
    blocks: tuple[SeedBlock, ...]

    @property
    def end(self) -> int:
        return self.address + self.total_size


_SEGMENT_SLOTS = tuple(
    SeedSegment.__dict__[name].__set__
    for name in ("address", "total_size", "stream", "is_small", "expandable", "blocks")
)


def new_seed_segment(
    address: int,
    total_size: int,
    stream: int,
    is_small: bool,
    expandable: bool,
    blocks: tuple[SeedBlock, ...],
) -> SeedSegment:
    """``SeedSegment(...)``, made as :func:`new_seed_block` makes a block (the same record)."""
    segment: SeedSegment = _NEW(SeedSegment)
    set_address, set_total, set_stream, set_small, set_expandable, set_blocks = _SEGMENT_SLOTS
    set_address(segment, address)
    set_total(segment, total_size)
    set_stream(segment, stream)
    set_small(segment, is_small)
    set_expandable(segment, expandable)
    set_blocks(segment, blocks)
    return segment


@dataclass(frozen=True)
class StartState:
    """The reconstructed state at the first trace event.

    ``segments`` tile every block (free gaps included), in address order. ``hidden_blocks`` is
    the number of live-at-start blocks whose size the trace hid and that were sized from their
    request (§15.2).
    """

    segments: tuple[SeedSegment, ...]
    hidden_blocks: int
    warnings: tuple[str, ...]


def reconstruct_start_state(
    final_segments: Sequence[SeedSegment],
    events: Sequence[TraceEvent],
    round_size: Callable[[int], int],
) -> StartState:
    """Walk a trace backwards from the final segments to the state at its first event.

    Args:
        final_segments: the snapshot's segments for one device, blocks in address order.
        events: that device's trace, oldest first.
        round_size: ``round_size`` (§2.1) under the setting that was in effect when the blocks
            live at the start were allocated, i.e. the recorded setting.

    Returns:
        The starting state; every segment's blocks tile it exactly.
    """
    return reconstruct_walked(final_segments, events, round_size)[0]


def reconstruct_walked(
    final_segments: Sequence[SeedSegment],
    events: Sequence[TraceEvent],
    round_size: Callable[[int], int],
) -> tuple[StartState, _Walk]:
    """:func:`reconstruct_start_state`, and its walk: what else the pass over the trace noted
    (the positions of the segment decisions and ``oom`` entries, the number of allocs)."""
    walk = _walk(final_segments, events)
    warnings = walk.warnings
    live = walk.held

    segments = sorted([*walk.classic.values(), *_merge_runs(walk.runs)], key=_address)
    starts = [s.address for s in segments]
    ends = [s.address + s.total_size for s in segments]  # not .end: a call per live block
    by_segment: dict[int, list[int]] = {s.address: [] for s in segments}
    for addr in sorted(live):
        i = bisect.bisect_right(starts, addr) - 1
        if i < 0 or addr >= ends[i]:
            warnings.append(
                f"block at {addr:#x} is live at the start but lies in no segment; it was dropped"
            )
            continue
        by_segment[segments[i].address].append(addr)

    # The walk noted where each address was first allocated: the gap queries of hidden blocks
    # need no other pass over the trace.
    hidden = any(facts[0] is None for facts in live.values())
    first_allocs = _FirstAllocs.from_first_index(walk.first_alloc) if hidden else None
    out: list[SeedSegment] = []
    hidden_count = 0
    for seg in segments:
        addrs = by_segment[seg.address]
        blocks: list[SeedBlock] = []
        end = seg.address + seg.total_size
        for k, addr in enumerate(addrs):
            size, requested, state, completed_at, final_block = live[addr]
            limit = addrs[k + 1] if k + 1 < len(addrs) else end
            if size is None:
                hidden_count += 1
                assert first_allocs is not None
                size = _recover_size(
                    addr, requested, completed_at, limit, seg, round_size, first_allocs
                )
            if addr + size > limit:
                warnings.append(
                    f"block at {addr:#x} ({size} B) overlaps the next block or the segment end; "
                    f"it was cut to {limit - addr} B"
                )
                size = limit - addr
            if (
                final_block is not None
                and size == final_block.size
                and requested == final_block.requested_size
                and state == final_block.state
            ):
                # Live at both ends with the same facts: the final record serves as it is.
                blocks.append(final_block)
            else:
                blocks.append(new_seed_block(addr, size, requested, state))
        out.append(_layout_ordered(seg, blocks))
    return StartState(tuple(out), hidden_count, tuple(warnings)), walk


class _Walk:
    """What the backward walk of a trace leaves: the state at its first event, before layout."""

    __slots__ = (
        "classic",
        "runs",
        "held",
        "first_alloc",
        "warnings",
        "marks",
        "allocs",
        "actions",
        "alloc_events",
    )

    def __init__(self) -> None:
        # Classic segments by address, and expandable mapped runs: their place, size, stream
        # and pool only (the layout gives each its blocks; the ``blocks`` they carry are never
        # read, so a final segment serves as it is, issue 41).
        self.classic: dict[int, SeedSegment] = {}
        self.runs: list[SeedSegment] = []
        # Blocks held at the start: address -> [size (None: hidden, only the requested size is
        # known), requested_size, state, trace index of its first free_completed or None, the
        # final SeedBlock it started from or None].
        # Lists, not objects: one is made and dropped for every block the trace frees and
        # allocates, and the walk runs over every event of every replay (issue 19).
        self.held: dict[int, list] = {}
        # address -> the trace index of its first alloc (the walk sees the earliest last).
        self.first_alloc: dict[int, int] = {}
        self.warnings: list[str] = []
        # Trace indices of the segment events and oom entries, last first.
        self.marks: list[int] = []
        self.allocs = 0  # alloc entries
        # Each event's action code (columns.py), and the alloc events, in trace order: the
        # replay's trace columns start from them instead of reading every event again (a
        # fresh-copy replay builds them every time; issue 41). The codes are written into a
        # list made whole (OTHER) before the walk, by index: a store, not an append call, per
        # request event, and none for the others (10% of the walk, issue 41).
        self.actions: list[int] = []
        self.alloc_events: list[TraceEvent] = []


def _walk(final_segments: Sequence[SeedSegment], events: Sequence[TraceEvent]) -> _Walk:
    """§15.1: walk backwards from the final segments. Segment events add or remove whole
    segments; request events move a block between allocated, pending and absent."""
    walk = _Walk()
    classic, walked, first_alloc, warnings = walk.classic, walk.held, walk.first_alloc, walk.warnings
    marks = walk.marks
    for seg in final_segments:
        if seg.expandable:
            walk.runs.append(seg)
        else:
            classic[seg.address] = seg
        for b in seg.blocks:
            if b.state in LIVE_STATES:
                walked[b.address] = [b.size, b.requested_size, b.state, None, b]

    pop = walked.pop
    get = walked.get
    index = len(events)
    codes = walk.actions = [OTHER] * index
    # Noted last first, reversed at the end.
    alloc_event = walk.alloc_events.append
    for ev in reversed(events):
        index -= 1
        action = ev.action
        if action == "free_completed":
            codes[index] = FREE_COMPLETED
            prior = get(ev.address)
            if prior is not None and prior[2] == "active_pending_free":
                # A second free_completed without an alloc between: keep the earlier facts.
                prior[3] = index
            else:
                walked[ev.address] = [None, ev.size, "active_pending_free", index, None]
        elif action == "alloc":
            codes[index] = ALLOC
            alloc_event(ev)
            address = ev.address
            first_alloc[address] = index
            if pop(address, None) is None:
                warnings.append(
                    f"event {index}: alloc at {address:#x} has no matching live block in the "
                    "later state; the trace may be incomplete"
                )
        elif action == "free_requested":
            codes[index] = FREE_REQUESTED
            block = get(ev.address)
            if block is None:
                walked[ev.address] = [None, ev.size, "active_allocated", None, None]
            else:
                block[2] = "active_allocated"
        elif action == "segment_free":
            marks.append(index)
            classic[ev.address] = SeedSegment(
                ev.address, ev.size, ev.stream, ev.size == SMALL_SEGMENT_BYTES, False, ()
            )
        elif action == "segment_alloc":
            marks.append(index)
            if classic.pop(ev.address, None) is None:
                warnings.append(
                    f"event {index}: segment_alloc at {ev.address:#x} has no matching "
                    "segment in the later state; the trace may be incomplete"
                )
        elif action == "segment_unmap":
            marks.append(index)
            walk.runs = _add_run(walk.runs, ev)
        elif action == "segment_map":
            marks.append(index)
            walk.runs = _remove_run(walk.runs, ev.address, ev.size)
        elif action == "oom":
            # Carries no state change, but its position is noted (as a segment event's).
            marks.append(index)
        # "snapshot" and unknown actions carry no state change.
    walk.alloc_events.reverse()
    walk.allocs = len(walk.alloc_events)
    return walk


def layout_segment(segment: SeedSegment, live: Sequence[SeedBlock] | None = None) -> SeedSegment:
    """Fill every gap between a segment's live blocks with one free block.

    Free neighbours always merge (§5.2), so each gap is exactly one inactive block.

    Args:
        segment: the segment; its ``blocks`` are the live ones unless ``live`` is given.
        live: the live blocks, replacing ``segment.blocks``.
    """
    blocks: list[SeedBlock] = []
    cursor = segment.address
    for b in sorted(segment.blocks if live is None else live, key=_address):
        if b.state not in LIVE_STATES:
            continue
        if b.address > cursor:
            blocks.append(SeedBlock(cursor, b.address - cursor, 0, "inactive"))
        blocks.append(b)
        cursor = b.address + b.size
    if cursor < segment.end:
        blocks.append(SeedBlock(cursor, segment.end - cursor, 0, "inactive"))
    return SeedSegment(
        segment.address,
        segment.total_size,
        segment.stream,
        segment.is_small,
        segment.expandable,
        tuple(blocks),
    )


def _layout_ordered(segment: SeedSegment, live: list[SeedBlock]) -> SeedSegment:
    """:func:`layout_segment` of live blocks already in address order (the reconstruction's)."""
    blocks: list[SeedBlock] = []
    cursor = segment.address
    for b in live:
        if b.address > cursor:
            blocks.append(new_seed_block(cursor, b.address - cursor, 0, "inactive"))
        blocks.append(b)
        cursor = b.address + b.size
    end = segment.address + segment.total_size
    if cursor < end:
        blocks.append(new_seed_block(cursor, end - cursor, 0, "inactive"))
    return new_seed_segment(
        segment.address,
        segment.total_size,
        segment.stream,
        segment.is_small,
        segment.expandable,
        tuple(blocks),
    )


def _address(item: SeedBlock | SeedSegment) -> int:
    return item.address


def _recover_size(
    addr: int,
    requested_size: int,
    completed_at: int | None,
    limit: int,
    seg: SeedSegment,
    round_size: Callable[[int], int],
    first_allocs: _FirstAllocs,
) -> int:
    """The true size of a live-at-start block whose trace entries show only its request (§15.2).

    ``completed_at``: the trace index of the block's first ``free_completed``, if any.
    """
    size = round_size(max(requested_size, 1))
    if seg.is_small or seg.expandable:
        # Small-pool and expandable blocks are split whenever the leftover is >= 512 bytes
        # (should_split), so they are exactly the rounded size.
        return size
    end = addr + size
    # The first later alloc that lands in the gap after the block, while the block is still
    # live, takes the front of the free block there: that address is where the block really
    # ends (at ``end`` itself when the rounded size was right).
    first = first_allocs.earliest_in(end, limit)
    if first is not None and (completed_at is None or first[0] < completed_at):
        return first[1] - addr
    # Free large-pool classic blocks are always > 1 MiB, so a smaller gap is the block's own
    # unsplit leftover (§4 Step 11).
    if 0 < limit - end <= LARGE_SPLIT_LEFTOVER_BYTES:
        return limit - addr
    return size


class _FirstAllocs:
    """The trace's allocs by address: where each address was first allocated, for the gap
    queries of :func:`_recover_size` (issue 19: one index of the trace, then one bisect per
    hidden block, instead of a list of allocs per hidden block scanned in full).

    The earliest alloc in an address range is the smallest first-alloc index of the addresses
    in it; if that one is too late for a block, every alloc in the range is.
    """

    __slots__ = ("addresses", "first_index")

    def __init__(self, events: Sequence[TraceEvent]) -> None:
        indices = [i for i, ev in enumerate(events) if ev.action == "alloc"]
        addresses = [events[i].address for i in indices]
        # Built back to front, so each address keeps its smallest index (C loops, no Python one).
        indices.reverse()
        addresses.reverse()
        self.first_index: dict[int, int] = dict(zip(addresses, indices, strict=True))
        self.addresses = sorted(self.first_index)

    @classmethod
    def from_first_index(cls, first_index: dict[int, int]) -> _FirstAllocs:
        """The index from ``address -> trace index of its first alloc`` (the backward walk's)."""
        made = cls.__new__(cls)
        made.first_index = first_index
        made.addresses = sorted(first_index)
        return made

    def earliest_in(self, start: int, end: int) -> tuple[int, int] | None:
        """The (trace index, address) of the earliest alloc at an address in [start, end)."""
        addresses = self.addresses
        lo = bisect.bisect_left(addresses, start)
        hi = bisect.bisect_left(addresses, end, lo)
        if lo == hi:
            return None
        first_index = self.first_index
        return min((first_index[a], a) for a in addresses[lo:hi])


def _first_alloc_addresses(
    events: Sequence[TraceEvent], hidden: Sequence[int]
) -> dict[int, list[tuple[int, int]]]:
    """For each hidden block, the (trace index, address) of the allocs above it, in trace order.

    Only allocs below the next hidden block's address are listed. The plain form of what
    :class:`_FirstAllocs` answers (tests compare the two).
    """
    if not hidden:
        return {}
    ordered = sorted(hidden)
    out: dict[int, list[tuple[int, int]]] = {h: [] for h in ordered}
    lowest = ordered[0]
    find = bisect.bisect_right
    index = -1
    for ev in events:
        index += 1
        if ev.action == "alloc":
            a = ev.address
            # Allocs strictly above a hidden block's start, and below the next one's.
            if a > lowest:
                h = ordered[find(ordered, a) - 1]
                if h != a:
                    out[h].append((index, a))
    return out


def _add_run(runs: list[SeedSegment], ev: TraceEvent) -> list[SeedSegment]:
    """Backwards over ``segment_unmap``: the range was mapped before it."""
    is_small = None
    for r in runs:
        if r.stream == ev.stream and (r.end == ev.address or ev.address + ev.size == r.address):
            is_small = r.is_small
            break
    if is_small is None:
        is_small = small_pool_pages(ev.size)
    return [*runs, SeedSegment(ev.address, ev.size, ev.stream, is_small, True, ())]


def _remove_run(runs: list[SeedSegment], start: int, size: int) -> list[SeedSegment]:
    """Backwards over ``segment_map``: the range was unmapped before it."""
    end = start + size
    out: list[SeedSegment] = []
    for r in runs:
        if r.end <= start or r.address >= end:
            out.append(r)
            continue
        if r.address < start:
            out.append(replace(r, total_size=start - r.address))
        if r.end > end:
            out.append(replace(r, address=end, total_size=r.end - end))
    return out


def _merge_runs(runs: list[SeedSegment]) -> list[SeedSegment]:
    """Adjacent mapped ranges of one stream form one run (the snapshot reports them that way)."""
    merged: list[SeedSegment] = []
    for r in sorted(runs, key=lambda r: r.address):
        last = merged[-1] if merged else None
        if last is not None and last.end == r.address and last.stream == r.stream:
            merged[-1] = replace(last, total_size=last.total_size + r.total_size)
        else:
            merged.append(r)
    return merged

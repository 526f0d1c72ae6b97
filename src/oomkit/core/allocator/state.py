"""Reading and seeding the allocator's state: ``snapshot()`` (ref §11.2) and ``seed_segment``.

``snapshot()`` returns segment dicts shaped like ``torch.cuda.memory._snapshot()["segments"]``.
``seed_segment`` rebuilds a segment that existed before a recorded trace began (ref §15.1).
Functions over the allocator's parts, which :class:`CachingAllocator` calls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import TYPE_CHECKING, Any

from oomkit.core.allocator.active_blocks import ActiveBlocks
from oomkit.core.allocator.block import Block, Segment
from oomkit.core.allocator.constants import SMALL_BUFFER
from oomkit.core.allocator.device_memory import DeviceMemory
from oomkit.core.allocator.expandable import ExpandableSegments
from oomkit.core.allocator.pools import BlockPool, first_at_least
from oomkit.core.allocator.settings import AllocatorSettings
from oomkit.core.allocator.stats import (
    ACTIVE,
    ACTIVE_BYTES,
    ALLOCATED_BYTES,
    ALLOCATION,
    INACTIVE_SPLIT,
    INACTIVE_SPLIT_BYTES,
    LARGE_POOL,
    OVERSIZE_ALLOCATIONS,
    OVERSIZE_SEGMENTS,
    REQUESTED_BYTES,
    RESERVED_BYTES,
    SEGMENT,
    SMALL_POOL,
    AllocatorStats,
    StatTally,
)
from oomkit.errors import AllocatorUsageError, OomkitError

if TYPE_CHECKING:
    from oomkit.core.allocator.private_pools import PrivatePool

__all__ = [
    "unlink_all","HeldRanges", "SeedBlock", "SeedTarget", "all_blocks", "check_seed_segments",
    "seed_reservation", "seed_segment", "seed_segments", "snapshot", "snapshot_keys"]

# (address, size, requested_size, allocated)
SeedBlock = tuple[int, int, int, bool]
_ADDRESS_KEY = itemgetter("address")


# ------------------------------------------------------------------ snapshot


def all_blocks(
    small: BlockPool,
    large: BlockPool,
    private_pools: Iterable[PrivatePool],
    active: ActiveBlocks,
) -> Iterator[Block]:
    """get_all_blocks: default pools, every private pool (§3.5), then the active blocks."""
    for pool in (small, large):
        yield from pool.ordered()
    for private in private_pools:
        yield from private.small.ordered()
        yield from private.large.ordered()
    yield from active.values()


def snapshot(held: Iterable[Block], device: int) -> list[dict[str, Any]]:
    """The segments of the ``held`` blocks as ``torch.cuda.memory._snapshot()["segments"]`` lists them (§11.2).

    Sorted by address. An expandable segment is one entry per contiguous mapped run.
    Block ``state`` is ``active_allocated``, ``active_pending_free`` or ``inactive``.
    """
    result: list[dict[str, Any]] = []
    for head in held:
        # DeviceCachingAllocator::snapshot: one entry per head of a mapped run.
        if head.prev is not None and head.prev.mapped:
            continue
        segment = head.segment
        blocks: list[dict[str, Any]] = []
        # The sizes are summed in locals, not in the dict (every verify runs this, issue 19).
        total = allocated = active = requested = 0
        block: Block | None = head
        while block is not None and block.mapped:
            size = block.size
            total += size
            if block.allocated:
                state = "active_allocated"
                allocated += size
                active += size
                requested += block.requested_size
            elif block.event_count > 0 or block.stream_uses:
                state = "active_pending_free"
                active += size
                requested += block.requested_size
            else:
                state = "inactive"
            blocks.append(
                {
                    "address": block.ptr,
                    "size": size,
                    "requested_size": block.requested_size,
                    "state": state,
                    "frames": [],
                }
            )
            block = block.next
        result.append(
            {
                "device": device,
                "address": head.ptr,
                "total_size": total,
                "stream": head.stream,
                "segment_type": "small" if segment.is_small else "large",
                # SegmentInfo::owner_private_pool_id: (0, 0) for the default pools.
                "segment_pool_id": owner.id if (owner := segment.pool.owner) is not None else (0, 0),
                "allocated_size": allocated,
                "active_size": active,
                "requested_size": requested,
                "is_expandable": segment.expandable,
                "frames": [],
                "blocks": blocks,
            }
        )
    result.sort(key=_ADDRESS_KEY)
    return result


def snapshot_keys(
    segments: Iterable[dict[str, Any]],
) -> list[tuple[int, int, int, str, bool, tuple[tuple[int, int, str], ...]]]:
    """:func:`snapshot`'s segments as sorted, comparable keys: address, total size, stream,
    segment type, expandable and each block's (address, size, state). A verify compares them
    with the recording's final segments (compiled with the allocator: every verify runs this
    over thousands of blocks, issue 41)."""
    keys = []
    for seg in segments:
        blocks = []
        # Typed, so a compiled build iterates a list and reads dicts natively (issue 41).
        seg_blocks: list[dict[str, Any]] = seg["blocks"]
        for b in seg_blocks:
            blocks.append((b["address"], b["size"], b["state"]))
        keys.append(
            (
                seg["address"],
                seg["total_size"],
                seg["stream"],
                seg["segment_type"],
                seg["is_expandable"],
                tuple(blocks),
            )
        )
    keys.sort()
    return keys


def unlink_all(pools: Iterable[BlockPool], active: ActiveBlocks) -> None:
    """Empty ``pools`` and ``active`` and cut every block's links to its neighbours.

    Blocks link to their neighbours both ways (and to their pool through their segment), so a
    dropped allocator's blocks are reference cycles that only a garbage collection frees,
    walking every one of them (issue 41: the collection after a real-trace replay cost a tenth
    of it). Cut, they are freed by reference counting as soon as nothing holds them.
    """
    blocks = list(active.values())
    active.clear()
    for pool in pools:
        blocks += pool.ordered()
        blocks += pool.unmapped_blocks()
        pool.clear()
    for block in blocks:
        block.prev = None
        block.next = None
        block.same = None


# ------------------------------------------------------------------ seeding


class HeldRanges:
    """The address ranges the allocator holds, in address order, for seeding's overlap check.

    Seeding a recorded start state adds one segment after another; checking each against every
    held block is quadratic (908,000 block visits for 999 segments, issue 19). This index answers
    "does ``[address, end)`` overlap held memory?" by bisection. It is rebuilt from the held
    blocks only when the allocator created, released, mapped or unmapped memory since it was
    last used (``stamp``: the segment log's length and the reserved total), which seeding does
    not do, so seeding a start state of ``n`` segments is ``O(n log n)`` plus the list inserts.
    """

    __slots__ = ("starts", "ends", "stamp")

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.stamp: tuple[int, int] | None = None

    def refresh(self, held: Callable[[], Iterable[Block]], stamp: tuple[int, int]) -> None:
        """Rebuild from ``held()`` unless nothing changed since ``stamp`` was recorded."""
        if stamp == self.stamp:
            return
        ranges = sorted((b.ptr, b.ptr + b.size) for b in held())
        self.starts = [r[0] for r in ranges]
        self.ends = [r[1] for r in ranges]
        self.stamp = stamp

    def overlapping(self, address: int, end: int) -> int | None:
        """The start of a held range that overlaps ``[address, end)``, or None."""
        # Held ranges are disjoint, so sorted by start they are sorted by end too: only the
        # last range that starts before ``end`` can reach past ``address``.
        i = first_at_least(self.starts, end) - 1
        if i >= 0 and self.ends[i] > address:
            return self.starts[i]
        return None

    def add(self, address: int, end: int, stamp: tuple[int, int]) -> None:
        """Record the newly held ``[address, end)``; ``stamp`` is the allocator's after it."""
        i = first_at_least(self.starts, address)
        self.starts.insert(i, address)
        self.ends.insert(i, end)
        self.stamp = stamp


@dataclass(frozen=True)
class SeedTarget:
    """The parts of an allocator that seeding writes to."""

    small: BlockPool
    large: BlockPool
    active: ActiveBlocks
    device: DeviceMemory
    expandable: ExpandableSegments
    stats: AllocatorStats
    settings: AllocatorSettings
    held_blocks: Callable[[], Iterator[Block]]
    held_ranges: HeldRanges = field(default_factory=HeldRanges)
    # Where seed_segment notes its stat increases (applied at its end unless deferred).
    tally: StatTally = field(default_factory=StatTally)

    def stamp(self) -> tuple[int, int]:
        """What changes whenever held memory does, except through seeding (see HeldRanges)."""
        return len(self.device.segment_log), self.device.total_bytes


def seed_segment(
    target: SeedTarget,
    address: int,
    total_size: int,
    stream: int,
    is_small: bool,
    blocks: Sequence[SeedBlock],
    expandable: bool = False,
) -> None:
    """Add a segment that existed before the replayed trace began (ref §15.1).

    Seeded memory counts in the current stats (reserved, allocated, active, segment,
    inactive_split, ...) and their peaks; no trace entry is logged.

    Args:
        target: the allocator's parts the segment is added to.
        address: the segment's (or, for expandable, the mapped run's) first address.
        total_size: its size in bytes.
        stream: the stream it belongs to.
        is_small: a small-pool segment (2 MiB classic segments are small, ref §15.1).
        blocks: ``(address, size, requested_size, allocated)`` tiling the segment in
            address order; free neighbours must already be merged.
        expandable: the range is the mapped part of an expandable reservation.

    Raises:
        AllocatorUsageError: the blocks do not tile the segment, two free blocks touch,
            or the range overlaps memory the allocator already holds.
    """
    _check_seed(address, total_size, stream, blocks)
    _seed_checked(target, address, total_size, stream, bool(is_small), blocks, bool(expandable))


def seed_reservation(
    target: SeedTarget, base: int, stream: int, is_small: bool, first_run: int
) -> None:
    """An expandable reservation of ``stream``'s pool that begins at ``base``, below
    ``first_run``, its lowest run mapped at the start (ref §15.5): pages between are unmapped
    at the start. Seed it before the runs; they are then placed in it.

    Raises:
        AllocatorUsageError: ``base`` is not below ``first_run`` by whole pages, or a
            reservation of the allocator already holds it.
    """
    if not all(isinstance(v, int) for v in (base, stream, first_run)):
        raise AllocatorUsageError(
            "seed_reservation: base, stream and first_run must be ints; got "
            f"{base!r}, {stream!r}, {first_run!r}."
        )
    pool = target.small if is_small else target.large
    expandable = target.expandable
    page = expandable.page_size(pool)
    if not 0 < base < first_run or (first_run - base) % page:
        raise AllocatorUsageError(
            f"seed_reservation: base {base:#x} must lie whole {page}-byte pages below the first "
            f"mapped run at {first_run:#x}."
        )
    for seg in expandable.segments:
        if seg.address <= base < seg.address + seg.size or base < seg.address <= first_run:
            raise AllocatorUsageError(
                f"seed_reservation: [{base:#x}, {first_run:#x}] meets the reservation at "
                f"{seg.address:#x}; seed reservations before their runs, one per pool."
            )
    expandable.new_segment(pool, stream, base)


def seed_segments(
    target: SeedTarget,
    segments: Iterable[Any],
    checks: Sequence[OomkitError | None] | None = None,
) -> list[OomkitError | None]:
    """:func:`seed_segment` for each ``(address, total_size, stream, is_small, blocks,
    expandable)``, their stat increases applied together at the end (``StatTally``: the same
    stats as one call each; issue 41).

    Args:
        target: the allocator's parts the segments are added to.
        segments: the segments, in the order they are seeded.
        checks: :func:`check_seed_segments` of ``segments``, when the caller computed it once
            for segments it seeds many times (a replayed start state): the checks of the
            arguments are not run again (the overlap check is: it depends on the allocator).

    Returns:
        Per segment, the error that refused it (the segment is not seeded), or None.
    """
    tally = target.tally
    refused: list[OomkitError | None] = []
    tally.deferred = True
    try:
        i = 0
        for address, total_size, stream, is_small, blocks, expandable in segments:
            try:
                if checks is None:
                    _check_seed(address, total_size, stream, blocks)
                else:
                    failed = checks[i]
                    if failed is not None:
                        raise failed
                _seed_checked(
                    target, address, total_size, stream, bool(is_small), blocks, bool(expandable)
                )
            except OomkitError as exc:
                refused.append(exc)
            else:
                refused.append(None)
            i += 1
    finally:
        tally.deferred = False
        tally.apply(target.stats)
    return refused


def check_seed_segments(segments: Iterable[Any]) -> list[OomkitError | None]:
    """Per ``(address, total_size, stream, is_small, blocks, expandable)``, the error that
    :func:`seed_segment`'s argument checks raise for it, or None (for ``seed_segments``'
    ``checks``)."""
    found: list[OomkitError | None] = []
    for address, total_size, stream, _is_small, blocks, _expandable in segments:
        try:
            _check_seed(address, total_size, stream, blocks)
        except OomkitError as exc:
            found.append(exc)
        else:
            found.append(None)
    return found


def _seed_checked(
    target: SeedTarget,
    address: int,
    total_size: int,
    stream: int,
    is_small: bool,
    blocks: Sequence[Any],
    expandable: bool,
) -> None:
    """:func:`seed_segment` once ``_check_seed`` has passed: the scalars are ints and bools
    here, so a compiled build reads them natively (scripts/compile_allocator.py makes only
    ``seed_segment`` and ``_check_seed`` take ``Any``, for their own checks; issue 41)."""
    held = target.held_ranges
    held.refresh(target.held_blocks, target.stamp())
    overlap = held.overlapping(address, address + total_size)
    if overlap is not None:
        raise AllocatorUsageError(
            f"seed_segment: [{address:#x}, +{total_size}) overlaps a block the "
            f"allocator already holds at {overlap:#x}."
        )
    pool = target.small if is_small else target.large
    device = target.device
    stats = target.tally
    max_split = target.settings.max_split
    # Without max_split_size, max_split is SIZE_MAX, a big integer in compiled code: the flag is
    # tested before a size is compared with it (a generic comparison per block, issue 41).
    split_limited = target.settings.split_limited
    if expandable:
        segment, before, after = _seed_reservation(
            target.expandable, pool, address, total_size, stream
        )
    else:
        segment = Segment(address, total_size, stream, is_small, device.new_counter(), pool=pool)
        before = after = None
    chain: list[Block] = []
    for ptr, size, requested, allocated in blocks:
        block = Block(ptr, size, stream, segment)
        block.requested_size = requested
        block.allocated = bool(allocated)
        chain.append(block)
    # Linked in address order (an index loop: a compiled zip() is a generic call).
    for j in range(1, len(chain)):
        left = chain[j - 1]
        right = chain[j]
        left.next = right
        right.prev = left
    if before is not None:
        before.next = chain[0]
        chain[0].prev = before
    if after is not None:
        after.prev = chain[-1]
        chain[-1].next = after
    kind = SMALL_POOL if is_small else LARGE_POOL
    # DeviceMemory.add_reserved, its stat noted in the tally with the others.
    device.total_bytes += total_size
    stats.up(kind, RESERVED_BYTES, total_size)
    if not expandable:
        device.segments[address] = segment
        stats.up(kind, SEGMENT, 1)
        if split_limited and total_size >= max_split:
            stats.up_all(OVERSIZE_SEGMENTS, 1)
    split = len(chain) > 1
    # Seeding only increases the stats, so one increase per stat and segment leaves the same
    # current values and peaks as one per block (issue 19: a call per block and stat was most
    # of the seeding time).
    allocations = allocated_bytes = requested_bytes = oversize = 0
    inactive = inactive_bytes = 0
    active = target.active
    for block in chain:
        if block.allocated:
            active.add(block)
            allocations += 1
            allocated_bytes += block.size
            requested_bytes += block.requested_size
            if split_limited and block.size >= max_split:
                oversize += 1
        else:
            pool.insert(block)
            if split and not expandable:
                inactive += 1
                inactive_bytes += block.size
    if allocations:
        stats.up(kind, ALLOCATION, allocations)
        stats.up(kind, ACTIVE, allocations)
        stats.up(kind, ALLOCATED_BYTES, allocated_bytes)
        stats.up(kind, ACTIVE_BYTES, allocated_bytes)
        stats.up(kind, REQUESTED_BYTES, requested_bytes)
    if oversize:
        stats.up_all(OVERSIZE_ALLOCATIONS, oversize)
    if inactive:
        stats.up(kind, INACTIVE_SPLIT, inactive)
        stats.up(kind, INACTIVE_SPLIT_BYTES, inactive_bytes)
    if not stats.deferred:
        stats.apply(target.stats)
    held.add(address, address + total_size, target.stamp())
    end = segment.address + segment.size
    if end > device.next_address:
        # Synthetic addresses stay above everything seeded.
        device.next_address = (end + SMALL_BUFFER - 1) // SMALL_BUFFER * SMALL_BUFFER


def _check_seed(address: int, total_size: int, stream: int, blocks: Sequence[SeedBlock]) -> None:
    if not isinstance(address, int) or address <= 0:
        raise AllocatorUsageError(f"seed_segment: address must be a positive int; got {address!r}.")
    if not isinstance(total_size, int) or total_size <= 0:
        raise AllocatorUsageError(
            f"seed_segment: total_size must be a positive int; got {total_size!r}."
        )
    if not isinstance(stream, int):
        raise AllocatorUsageError(f"seed_segment: stream must be an int; got {stream!r}.")
    if not blocks:
        raise AllocatorUsageError(
            "seed_segment: blocks is empty; give the blocks that tile the segment, "
            "with free gaps as (address, size, requested_size, False)."
        )
    expected = address
    prev_free = False
    for entry in blocks:
        ptr, size, _requested, allocated = entry
        if ptr != expected or not isinstance(size, int) or size <= 0:
            raise AllocatorUsageError(
                f"seed_segment: blocks must tile [{address:#x}, +{total_size}) in address "
                f"order; block {entry!r} does not start at {expected:#x} or has no size."
            )
        if not allocated and prev_free:
            raise AllocatorUsageError(
                f"seed_segment: free block at {ptr:#x} follows another free block; free "
                "neighbours always merge, so give them as one block."
            )
        prev_free = not allocated
        expected = ptr + size
    if expected != address + total_size:
        raise AllocatorUsageError(
            f"seed_segment: the blocks cover {expected - address} bytes but total_size is "
            f"{total_size}; they must tile the segment exactly."
        )


def _seed_reservation(
    expandable: ExpandableSegments, pool: BlockPool, address: int, total_size: int, stream: int
) -> tuple[Segment, Block | None, Block | None]:
    """Place a mapped run inside the (stream, pool kind) reservation, creating it if needed.

    Returns the segment and the unmapped blocks left before and after the run.
    """
    segment = None
    for seg in expandable.segments:
        if (
            seg.stream == stream
            and seg.pool is pool
            and seg.address <= address < seg.address + seg.size
        ):
            segment = seg
            break
    if segment is None:
        # The reservation base is the first run seen (ref §15.5); keep it clear of any
        # other reservation that starts above it.
        limit = None
        for seg in expandable.segments:
            if seg.address > address and (limit is None or seg.address < limit):
                limit = seg.address
        page = expandable.page_size(pool)
        size = None
        if limit is not None:
            size = (limit - address) // page * page
        unmapped_block = expandable.new_segment(pool, stream, address, size)
        segment = unmapped_block.segment
    page = segment.page_size
    offset = address - segment.address
    if offset % page or total_size % page or address + total_size > segment.address + segment.size:
        raise AllocatorUsageError(
            f"seed_segment: expandable range [{address:#x}, +{total_size}) is not whole "
            f"{page}-byte pages of its reservation at {segment.address:#x}."
        )
    # Find the unmapped block that contains the run and cut the run out of it.
    holder = None
    for entry in pool.unmapped:
        b = entry[-1]
        if b.segment is segment and b.ptr <= address and address + total_size <= b.ptr + b.size:
            holder = b
            break
    if holder is None:
        raise AllocatorUsageError(
            f"seed_segment: expandable range [{address:#x}, +{total_size}) overlaps a "
            "mapped range seeded before."
        )
    pool.remove_unmapped(holder)
    before = after = None
    prev, nxt = holder.prev, holder.next
    if address > holder.ptr:
        before = Block(holder.ptr, address - holder.ptr, stream, segment)
        before.mapped = False
        before.prev = prev
        if prev is not None:
            prev.next = before
        pool.insert_unmapped(before)
    elif prev is not None:
        before = prev
    run_end = address + total_size
    holder_end = holder.ptr + holder.size
    if run_end < holder_end:
        after = Block(run_end, holder_end - run_end, stream, segment)
        after.mapped = False
        after.next = nxt
        if nxt is not None:
            nxt.prev = after
        pool.insert_unmapped(after)
    elif nxt is not None:
        after = nxt
    pages = segment.mapped_pages
    assert pages is not None
    end = (offset + total_size) // page
    if end > len(pages):
        pages.extend(bytes(end - len(pages)))
    for i in range(offset // page, end):
        pages[i] = 1
    return segment, before, after

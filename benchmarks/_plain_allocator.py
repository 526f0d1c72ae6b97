"""A plain re-implementation of the caching allocator and of a verify replay, for comparison.

``benchmarks/replay_speed.py`` measures oomkit's replay against this (issue 41: the replay should
run at 10x a plain implementation of the same rules). It is what a competent engineer writes in
an afternoon from ../shared/ref/cuda-caching-allocator.md and CUDACachingAllocator.cpp: blocks
as small classes in a doubly linked list per segment, each pool's free blocks as one sorted
list of ``(stream, size, address)`` keys searched with ``bisect``, a dict of live blocks by
address, stats in a dict, no inlining or other tricks.

Rules it models (the ones the real traces of the benchmark use; anything else raises):

- rounding (round_size): below 512 B to 512 B, else up to a multiple of 512 B; no
  ``roundup_power2_divisions``;
- pools (get_pool): requests up to 1 MiB from the small pool, larger ones from the large pool;
- new segments (get_allocation_size): 2 MiB for the small pool, 20 MiB below 10 MiB, else the
  request rounded up to 2 MiB;
- best fit (get_free_block): the first free block of the request's stream with size >= the
  request, ties by address; no ``max_split_size``;
- splitting (should_split): small pool when at least 512 B remain, large pool when more than
  1 MiB remains;
- free (free_block): merge with a free neighbour before and after, back into the pool; a free
  whose completion is recorded later keeps its block until ``free_completed``;
- out of memory (malloc): a failed cudaMalloc releases every free, unsplit segment
  (release_cached_blocks, after completing pending frees) and retries once;
- stats: current and peak of allocated, reserved, active and requested bytes, the device
  allocation and free counts and the retries.

The verify replay takes what oomkit's replay reconstructs (the start state, the recorded segment
events, the final segments: the same inputs for both) and reads the recording as oomkit's first
reading does: cudaMalloc succeeds when the recording shows a creation not yet made, at the
recorded address; a run of recorded segment releases is one release_cached_blocks. It returns
peak allocated and reserved bytes, the segment events, how many matched the recording, and
whether the final state equals the snapshot's. Not modelled: expandable segments,
``max_split_size``, GC, private pools, the 2026 tie-break, the second readings of ambiguous
points (oomkit's ``_verify_run``).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

KB = 1024
MB = 1024 * KB
MIN_BLOCK = 512
SMALL_SIZE = 1 * MB
SMALL_BUFFER = 2 * MB
LARGE_BUFFER = 20 * MB
MIN_LARGE_ALLOC = 10 * MB
ROUND_LARGE = 2 * MB


class PlainOutOfMemory(Exception):
    """A request the plain allocator could not serve."""


class Segment:
    def __init__(self, address: int, size: int, stream: int, small: bool) -> None:
        self.address = address
        self.size = size
        self.stream = stream
        self.small = small


class Block:
    def __init__(self, address: int, size: int, stream: int, segment: Segment) -> None:
        self.address = address
        self.size = size
        self.stream = stream
        self.segment = segment
        self.allocated = False
        self.pending = False  # freed, waiting for its free_completed
        self.requested = 0
        self.prev: Block | None = None
        self.next: Block | None = None


class Pool:
    """The free blocks of one pool, sorted by (stream, size, address)."""

    def __init__(self, small: bool) -> None:
        self.small = small
        self.keys: list[tuple[int, int, int]] = []
        self.blocks: dict[int, Block] = {}

    def add(self, block: Block) -> None:
        bisect.insort(self.keys, (block.stream, block.size, block.address))
        self.blocks[block.address] = block

    def remove(self, block: Block) -> None:
        key = (block.stream, block.size, block.address)
        i = bisect.bisect_left(self.keys, key)
        assert self.keys[i] == key
        del self.keys[i]
        del self.blocks[block.address]

    def best_fit(self, stream: int, size: int) -> Block | None:
        i = bisect.bisect_left(self.keys, (stream, size, 0))
        if i < len(self.keys) and self.keys[i][0] == stream:
            return self.blocks[self.keys[i][2]]
        return None


@dataclass
class Stat:
    """c10 Stat: current, peak, allocated (sum of increases), freed (sum of decreases)."""

    current: int = 0
    peak: int = 0
    allocated: int = 0
    freed: int = 0

    def update(self, amount: int) -> None:
        self.current += amount
        if amount > 0:
            self.allocated += amount
        else:
            self.freed -= amount
        self.peak = max(self.peak, self.current)


STAT_NAMES = (
    "allocation",
    "segment",
    "active",
    "inactive_split",
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "requested_bytes",
)
STAT_TYPES = ("all", "small_pool", "large_pool")


class Stats:
    """DeviceStats: each array stat for the aggregate and per pool, plus the counters."""

    def __init__(self) -> None:
        self.stats = {(name, kind): Stat() for name in STAT_NAMES for kind in STAT_TYPES}
        self.counters = {
            "num_alloc_retries": 0,
            "num_ooms": 0,
            "num_device_alloc": 0,
            "num_device_free": 0,
        }

    def update(self, name: str, small: bool, amount: int) -> None:
        """update_stat_array: the aggregate and the pool's stat."""
        if amount == 0:
            return
        self.stats[(name, "all")].update(amount)
        self.stats[(name, "small_pool" if small else "large_pool")].update(amount)

    def count(self, name: str) -> None:
        self.counters[name] += 1

    def memory_stats(self) -> dict[str, int]:
        """As torch.cuda.memory_stats() names them."""
        out = dict(self.counters)
        for (name, kind), stat in self.stats.items():
            for field_name in ("current", "peak", "allocated", "freed"):
                out[f"{name}.{kind}.{field_name}"] = getattr(stat, field_name)
        return out


class PlainAllocator:
    """The caching allocator's rules above, one device.

    Args:
        device_malloc: whether a cudaMalloc of the given size succeeds now.
        segment_address: the address of a new segment of the given size.
    """

    def __init__(
        self,
        device_malloc: Callable[[int], bool],
        segment_address: Callable[[int], int],
    ) -> None:
        self.device_malloc = device_malloc
        self.segment_address = segment_address
        self.small = Pool(True)
        self.large = Pool(False)
        self.segments: dict[int, Segment] = {}
        self.active: dict[int, Block] = {}
        self.stats = Stats()
        self.segment_log: list[tuple[str, int, int]] = []

    @staticmethod
    def round_size(nbytes: int) -> int:
        if nbytes < MIN_BLOCK:
            return MIN_BLOCK
        return (nbytes + MIN_BLOCK - 1) // MIN_BLOCK * MIN_BLOCK

    @staticmethod
    def allocation_size(size: int) -> int:
        if size <= SMALL_SIZE:
            return SMALL_BUFFER
        if size < MIN_LARGE_ALLOC:
            return LARGE_BUFFER
        return (size + ROUND_LARGE - 1) // ROUND_LARGE * ROUND_LARGE

    def pool_for(self, size: int) -> Pool:
        return self.small if size <= SMALL_SIZE else self.large

    # -- malloc ------------------------------------------------------------------------------

    def malloc(self, nbytes: int, stream: int = 0) -> int:
        size = self.round_size(nbytes)
        pool = self.pool_for(size)
        block = pool.best_fit(stream, size)
        if block is not None:
            pool.remove(block)
        else:
            block = self.new_segment(pool, size, stream)
        # alloc_found_block
        remaining = block.size - size
        if pool.small:
            split = remaining >= MIN_BLOCK
        else:
            split = remaining > SMALL_SIZE
        small = pool.small
        if split:
            already_split = block.prev is not None or block.next is not None
            rest = Block(block.address + size, remaining, stream, block.segment)
            rest.prev = block
            rest.next = block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            pool.add(rest)
            if already_split:
                self.stats.update("inactive_split_bytes", small, -size)
            else:
                self.stats.update("inactive_split_bytes", small, remaining)
                self.stats.update("inactive_split", small, 1)
        elif block.prev is not None or block.next is not None:
            self.stats.update("inactive_split_bytes", small, -block.size)
            self.stats.update("inactive_split", small, -1)
        block.allocated = True
        block.requested = nbytes
        self.active[block.address] = block
        self.stats.update("allocation", small, 1)
        self.stats.update("allocated_bytes", small, block.size)
        self.stats.update("active", small, 1)
        self.stats.update("active_bytes", small, block.size)
        self.stats.update("requested_bytes", small, nbytes)
        return block.address

    def new_segment(self, pool: Pool, size: int, stream: int) -> Block:
        alloc_size = self.allocation_size(size)
        if not self.device_malloc(alloc_size):
            self.release_cached_blocks(synchronize=True)
            self.stats.count("num_alloc_retries")
            if not self.device_malloc(alloc_size):
                self.stats.count("num_ooms")
                raise PlainOutOfMemory(f"cannot allocate {size} bytes")
        address = self.segment_address(alloc_size)
        segment = Segment(address, alloc_size, stream, pool.small)
        self.segments[address] = segment
        self.stats.update("segment", pool.small, 1)
        self.stats.update("reserved_bytes", pool.small, alloc_size)
        self.stats.count("num_device_alloc")
        self.segment_log.append(("segment_alloc", address, alloc_size))
        return Block(address, alloc_size, stream, segment)

    # -- free --------------------------------------------------------------------------------

    def free(self, address: int, deferred: bool = False) -> None:
        block = self.active[address]
        block.allocated = False
        self.stats.update("allocation", block.segment.small, -1)
        self.stats.update("allocated_bytes", block.segment.small, -block.size)
        if deferred:
            block.pending = True
        else:
            self.free_block(block)

    def complete_free(self, address: int) -> None:
        block = self.active[address]
        assert block.pending
        block.pending = False
        self.free_block(block)

    def free_block(self, block: Block) -> None:
        del self.active[block.address]
        small = block.segment.small
        original_size = block.size
        pool = self.pool_for_segment(block.segment)
        net_blocks = 0
        net_bytes = 0
        for neighbour in (block.prev, block.next):
            if neighbour is None or neighbour.allocated or neighbour.pending:
                continue
            pool.remove(neighbour)
            if neighbour is block.prev:
                block.address = neighbour.address
                block.prev = neighbour.prev
                if block.prev is not None:
                    block.prev.next = block
            else:
                block.next = neighbour.next
                if block.next is not None:
                    block.next.prev = block
            block.size += neighbour.size
            net_blocks -= 1
            net_bytes -= neighbour.size
        pool.add(block)
        if block.prev is not None or block.next is not None:
            net_blocks += 1
            net_bytes += block.size
        self.stats.update("inactive_split", small, net_blocks)
        self.stats.update("inactive_split_bytes", small, net_bytes)
        self.stats.update("active", small, -1)
        self.stats.update("active_bytes", small, -original_size)
        self.stats.update("requested_bytes", small, -block.requested)

    def pool_for_segment(self, segment: Segment) -> Pool:
        return self.small if segment.small else self.large

    # -- releasing memory ----------------------------------------------------------------------

    def release_cached_blocks(self, synchronize: bool = False) -> None:
        if synchronize:
            for block in [b for b in self.active.values() if b.pending]:
                self.complete_free(block.address)
        for pool in (self.large, self.small):
            for key in list(pool.keys):
                block = pool.blocks[key[2]]
                if block.prev is None and block.next is None:
                    pool.remove(block)
                    segment = block.segment
                    del self.segments[segment.address]
                    self.stats.update("segment", segment.small, -1)
                    self.stats.update("reserved_bytes", segment.small, -segment.size)
                    self.stats.count("num_device_free")
                    self.segment_log.append(("segment_free", segment.address, segment.size))

    # -- the state -------------------------------------------------------------------------------

    def seed(self, address: int, size: int, stream: int, small: bool, blocks: list[Any]) -> None:
        """A segment that existed before the trace: ``blocks`` as (address, size, requested,
        state) in address order, tiling it."""
        segment = Segment(address, size, stream, small)
        self.segments[address] = segment
        self.stats.update("segment", small, 1)
        self.stats.update("reserved_bytes", small, size)
        pool = self.pool_for_segment(segment)
        previous = None
        for b_address, b_size, requested, state in blocks:
            block = Block(b_address, b_size, stream, segment)
            block.prev = previous
            if previous is not None:
                previous.next = block
            previous = block
            if state == "inactive":
                pool.add(block)
                if len(blocks) > 1:
                    self.stats.update("inactive_split", small, 1)
                    self.stats.update("inactive_split_bytes", small, b_size)
            else:
                block.allocated = True
                block.requested = requested
                self.active[b_address] = block
                self.stats.update("allocation", small, 1)
                self.stats.update("allocated_bytes", small, b_size)
                self.stats.update("active", small, 1)
                self.stats.update("active_bytes", small, b_size)
                self.stats.update("requested_bytes", small, requested)
        # Seeded pending frees are freed (deferred) once every segment is in place.

    def state(self) -> list[tuple[int, int, list[tuple[int, int, str]]]]:
        """Every segment as (address, size, [(block address, size, state), ...]), by address."""
        by_segment: dict[int, list[tuple[int, int, str]]] = {a: [] for a in self.segments}
        every = [*self.active.values(), *self.small.blocks.values(), *self.large.blocks.values()]
        for block in every:
            if block.allocated:
                state = "active_allocated"
            elif block.pending:
                state = "active_pending_free"
            else:
                state = "inactive"
            by_segment[block.segment.address].append((block.address, block.size, state))
        return [
            (address, self.segments[address].size, sorted(by_segment[address]))
            for address in sorted(self.segments)
        ]


@dataclass
class PlainResult:
    events: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    memory_stats: dict[str, int]
    segment_events: list[tuple[str, int, int]]
    segment_events_matched: int
    final_state_matches: bool


def plain_verify(
    events: Sequence[Any],
    start_segments: Sequence[Any],
    recorded: Sequence[tuple[int, tuple[str, int, int]]],
    final_segments: Sequence[Any],
) -> PlainResult:
    """Replay a recorded trace with the recorded outcomes and compare it with the recording.

    Args:
        events: the trace (``action``, ``address``, ``size``, ``stream`` per entry).
        start_segments: the state at its first event (``address``, ``total_size``, ``stream``,
            ``is_small``, ``blocks`` of ``address``, ``size``, ``requested_size``, ``state``).
        recorded: (trace index, (action, address, size)) of each recorded segment event.
        final_segments: the snapshot's segments at the end, as ``start_segments``.
    """
    current = 0

    def expected_creation() -> tuple[str, int, int] | None:
        k = len(allocator.segment_log)
        if k < len(recorded) and recorded[k][1][0] == "segment_alloc" and recorded[k][0] < current:
            return recorded[k][1]
        return None

    def device_malloc(size: int) -> bool:
        return expected_creation() is not None

    def segment_address(size: int) -> int:
        creation = expected_creation()
        assert creation is not None
        return creation[1]

    allocator = PlainAllocator(device_malloc, segment_address)
    for seg in start_segments:
        if seg.expandable:
            raise NotImplementedError("expandable segments are not modelled")
        allocator.seed(
            seg.address,
            seg.total_size,
            seg.stream,
            seg.is_small,
            [(b.address, b.size, b.requested_size, b.state) for b in seg.blocks],
        )
    live: dict[int, int] = {}  # recorded address -> simulated address
    pending: dict[int, int] = {}
    for seg in start_segments:
        for b in seg.blocks:
            if b.state == "active_allocated":
                live[b.address] = b.address
            elif b.state == "active_pending_free":
                allocator.free(b.address, deferred=True)
                pending[b.address] = b.address

    n = len(events)
    skip_next = False
    for i, event in enumerate(events):
        if skip_next:
            skip_next = False
            continue
        current = i
        action = event.action
        if action == "alloc":
            live[event.address] = allocator.malloc(event.size, event.stream)
        elif action == "free_requested":
            if event.address not in live:
                continue
            address = live.pop(event.address)
            following = events[i + 1] if i + 1 < n else None
            if (
                following is not None
                and following.action == "free_completed"
                and following.address == event.address
            ):
                allocator.free(address)
                skip_next = True
            else:
                allocator.free(address, deferred=True)
                pending[event.address] = address
        elif action == "free_completed":
            if event.address in pending:
                allocator.complete_free(pending.pop(event.address))
        elif action in ("segment_free", "segment_unmap"):
            if i == 0 or events[i - 1].action not in ("segment_free", "segment_unmap"):
                allocator.release_cached_blocks()
        elif action == "oom":
            try:
                address = allocator.malloc(event.size, event.stream)
            except PlainOutOfMemory:
                pass
            else:
                allocator.free(address)
        elif action in ("segment_alloc", "segment_map", "snapshot"):
            pass  # creations happen inside malloc
        else:
            raise NotImplementedError(f"trace action {action!r}")

    # Verify: the segment events in order, then the final state.
    wanted = [event for _, event in recorded]
    matched = 0
    for got, want in zip(allocator.segment_log, wanted, strict=False):
        if tuple(got) != tuple(want):
            break
        matched += 1
    final = sorted(
        (
            seg.address,
            seg.total_size,
            [(b.address, b.size, b.state) for b in seg.blocks],
        )
        for seg in final_segments
    )
    return PlainResult(
        events=n,
        peak_allocated_bytes=allocator.stats.stats[("allocated_bytes", "all")].peak,
        peak_reserved_bytes=allocator.stats.stats[("reserved_bytes", "all")].peak,
        memory_stats=allocator.stats.memory_stats(),
        segment_events=allocator.segment_log,
        segment_events_matched=matched,
        final_state_matches=allocator.state() == final,
    )

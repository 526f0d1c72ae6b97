"""The simulator: a pure-Python ``DeviceCachingAllocator`` (ref §4-§7, §10, §12).

Every decision mirrors ``c10/cuda/CUDACachingAllocator.cpp``; comments name the function and
the ref section. This module holds malloc and free (written out by hand, the stats as fields of
:class:`~oomkit.core.allocator.stats.StatSlots` bound to locals: a replay runs them millions of
times); the allocator's other parts live
in their own modules with small interfaces and are reached only off the common path.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Final

from oomkit.core.allocator import stats as st
from oomkit.core.allocator.active_blocks import ActiveBlocks
from oomkit.core.allocator.best_fit import find_free_block
from oomkit.core.allocator.block import Block
from oomkit.core.allocator.cache_miss import CacheMiss
from oomkit.core.allocator.config import AllocatorConfig
from oomkit.core.allocator.constants import (
    MIN_BLOCK_MASK,
    MIN_BLOCK_ROUND_UP,
    MIN_BLOCK_SIZE,
    ONE_EXA_BYTES,
    SIZE_MAX,
    SMALL_SIZE,
)
from oomkit.core.allocator.device_memory import SYNTHETIC_ADDRESS_BASE, DeviceMemory, check_capacity
from oomkit.core.allocator.expandable import ExpandableSegments
from oomkit.core.allocator.oom_message import ONE_EXA_MESSAGE, process_memory_info
from oomkit.core.allocator.pending_frees import PendingFrees, not_live_message
from oomkit.core.allocator.pools import BlockPool
from oomkit.core.allocator.private_pools import MempoolId, PrivatePools, StreamFilter
from oomkit.core.allocator.release import CacheRelease
from oomkit.core.allocator.rounding import round_size
from oomkit.core.allocator.settings import AllocatorSettings, check_fraction
from oomkit.core.allocator.state import (
    SeedBlock,
    SeedTarget,
    all_blocks,
    seed_reservation,
    seed_segment,
    seed_segments,
    snapshot,
    unlink_all,
)
from oomkit.core.allocator.stats import (
    _A,
    _AB,
    ALL,
    LARGE_POOL,
    SMALL_POOL,
    AllocatorStats,
    StatsApi,
)
from oomkit.core.allocator.versions import behaviour_for
from oomkit.errors import AllocatorUsageError, OomkitError

__all__ = ["CachingAllocator", "DEFAULT_CAPACITY_BYTES", "SYNTHETIC_ADDRESS_BASE"]

# An 80 GB device as the default (ref §15.7).
DEFAULT_CAPACITY_BYTES: Final = 80 * 2**30


class CachingAllocator(StatsApi):
    """A simulated PyTorch native CUDA caching allocator for one device.

    Args:
        config: allocator settings; ``None`` is PyTorch's default.
        capacity_bytes: device total memory (cudaMemGetInfo total / totalGlobalMem).
        reserved_outside_bytes: device memory used outside this allocator (context, others).
        torch_version: the PyTorch version whose behaviour to model; ``None`` = newest released.
        device_malloc: decides whether obtaining N new bytes (a classic segment or one
            expandable page) succeeds now; default: the capacity rule
            ``reserved + reserved_outside + N <= capacity``.
        segment_address: address of a new classic segment given ``(size, False)``, or the base
            of a new expandable reservation given ``(reserve_size, True)``; default: synthetic,
            increasing, 2 MiB aligned, never reused.
        device: the device index printed in OOM messages.
        process_memory: what NVML would report for the GPU: ``(pid, used_bytes)`` per process,
            read when an OOM message is built (CUDACachingAllocator.cpp malloc's per-process lines); None = no NVML, no sentences.
        pid: this process's id for those sentences; None = ``os.getpid()``.

    Private pools (CUDA graphs, ``torch.cuda.MemPool``: CUDACachingAllocator.cpp PrivatePool): :meth:`create_pool`,
    :meth:`begin_allocate_to_pool`, :meth:`end_allocate_to_pool`, :meth:`release_pool`.
    The ``torch.cuda`` stats functions (:meth:`memory_stats`, ...) come from :class:`StatsApi`.

    Raises:
        AllocatorUsageError: a negative capacity or outside reservation.
    """

    def __init__(
        self,
        config: AllocatorConfig | None = None,
        capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
        reserved_outside_bytes: int = 0,
        torch_version: str | None = None,
        *,
        device_malloc: Callable[[int], bool] | None = None,
        segment_address: Callable[[int, bool], int] | None = None,
        device: int = 0,
        process_memory: Callable[[], Sequence[tuple[int, int]]] | None = None,
        pid: int | None = None,
    ) -> None:
        check_capacity(capacity_bytes, reserved_outside_bytes)
        self.config = config if config is not None else AllocatorConfig()
        self.torch_version = torch_version
        self.rules = rules = behaviour_for(torch_version)
        self.device = device
        self._stats = stats = AllocatorStats()
        # Hot state is held directly for malloc/free; these are stats.lists (never replaced).
        self._stat_lists = stats.lists
        self._settings = settings = AllocatorSettings(self.config, rules, capacity_bytes)
        self._device = dev = DeviceMemory(
            capacity_bytes, reserved_outside_bytes, stats, settings, device_malloc, segment_address
        )
        self.segment_log = dev.segment_log
        self._expandable = exp = ExpandableSegments(dev, stats, settings)
        self._private = PrivatePools(rules)
        # The open allocation scopes (changed in place by PrivatePools).
        self._scopes = self._private.scopes
        by_counter = rules.tie_break_by_creation_order
        self._small = BlockPool(True, by_counter)
        self._large = BlockPool(False, by_counter)
        # active_blocks (and allocated_blocks, the map by address, made when first asked):
        # callers read it, the allocator changes it.
        self.active_blocks = ActiveBlocks()
        self._events = PendingFrees(self.active_blocks, self._free_block, stats)
        release_parts = (settings, dev, exp, self._private, self._events)
        self._release = CacheRelease((self._small, self._large), self.active_blocks, release_parts)
        self._process_memory = process_memory
        self.pid = os.getpid() if pid is None else pid
        miss_parts = (settings, stats, dev, exp, self._release, self._private)
        self._miss = CacheMiss(rules, device, miss_parts, self.process_memory_info)
        self._seed_target = SeedTarget(
            self._small, self._large, self.active_blocks, dev, exp, stats, settings, self._held_blocks
        )
        # DeviceCachingAllocator ctor: stats.max_split_size is captured once (§10.2, §13.26).
        self._max_split_stat = -1 if settings.max_split == SIZE_MAX else settings.max_split

    @property
    def capacity_bytes(self) -> int:
        """Device total memory (cudaMemGetInfo total)."""
        return self._device.capacity_bytes

    @property
    def reserved_outside_bytes(self) -> int:
        """Device memory used outside this allocator."""
        return self._device.reserved_outside_bytes

    # ------------------------------------------------------------------ malloc

    def malloc(self, nbytes: int, stream: int = 0) -> int:
        """Allocate ``nbytes`` on ``stream`` as DeviceCachingAllocator::malloc does.

        Args:
            nbytes: the request in bytes (unrounded).
            stream: the stream the allocation is made on (streams compare by value).

        Returns:
            The block's device address; 0 for a 0-byte request (no allocator call: DeviceCachingAllocator::malloc).

        Raises:
            AllocatorUsageError: negative or non-integer size, or a non-integer stream.
            SimulatedOutOfMemoryError: nothing could serve the request (malloc's OutOfMemoryError).
        """
        if type(nbytes) is not int or nbytes <= 0:
            if type(nbytes) is int and nbytes == 0:
                return 0
            raise AllocatorUsageError(
                f"malloc size must be a non-negative int of bytes; got {nbytes!r}."
            )
        if type(stream) is not int:
            raise AllocatorUsageError(f"stream must be an int; got {stream!r}.")
        return self.serve_block(nbytes, stream).ptr

    def serve(self, nbytes: int, stream: int) -> int:
        """:meth:`malloc` of a checked request: :meth:`serve_block`'s address."""
        return self.serve_block(nbytes, stream).ptr

    def serve_block(self, nbytes: int, stream: int) -> Block:
        """:meth:`malloc` of a request already checked (``nbytes`` a positive int, ``stream`` an
        int: native integers when compiled), returning the block (read it, never change it):
        the replay loop hands it back to :meth:`free_served`, no look-up by address (issue 41).

        Raises:
            SimulatedOutOfMemoryError: as :meth:`malloc`.
        """
        if nbytes >= ONE_EXA_BYTES:
            # NativeCachingAllocator::malloc: fails before the device allocator (§12.4).
            raise self._miss.oom_error(ONE_EXA_MESSAGE, nbytes, nbytes, nbytes, stream)
        # Step 1 (process_events): events complete only at synchronize()/complete_free() or in
        # the Step 9 release here, so there is nothing to reap.
        # Step 2: round, choose the pool, size a new segment (§2).
        settings = self._settings
        if nbytes < MIN_BLOCK_SIZE:
            size = MIN_BLOCK_SIZE
        elif settings.divisions is None:
            # round_size without divisions (§2.1), inlined: a multiple of kMinBlockSize.
            size = (nbytes + MIN_BLOCK_ROUND_UP) & MIN_BLOCK_MASK
        else:
            size = round_size(nbytes, settings.divisions)
        if size <= SMALL_SIZE:
            pool = self._small
            kind = SMALL_POOL
        else:
            pool = self._large
            kind = LARGE_POOL
        # should_split's inputs: is_expandable_segments_active and the pool's no_split flag.
        expandable_active = settings.expandable
        no_split = False
        if self._scopes:
            # get_pool: an open allocation scope diverts the request to a private pool (§3.5).
            pool = self._private.scoped_pool(size, stream, pool)
            no_split = pool.owner is not None and pool.owner.no_split
        # Step 3: get_free_block (best fit, with its special rules; GC clock).
        max_split = settings.max_split
        block = find_free_block(settings, pool, size, stream, expandable_active=expandable_active)
        if block is None:
            # Step 4 (free-memory callbacks) frees nothing in a single simulated process.
            block = self._miss.new_block(pool, size, nbytes, stream)
            if block.segment.pool is not pool:
                # Step 7 served it from a use_on_oom pool: try_mempool_fallback's params carry
                # that pool and is_expandable_segments_active = false.
                pool = block.segment.pool
                expandable_active = False
                no_split = pool.owner is not None and pool.owner.no_split
        # Step 11: alloc_found_block with should_split.
        remaining = block.size - size
        if no_split:
            # MAIN26 should_split: a no_split pool never splits.
            split = False
        elif kind == SMALL_POOL or expandable_active:
            split = remaining >= MIN_BLOCK_SIZE
        else:
            split = (not settings.split_limited or size < max_split) and remaining > SMALL_SIZE
        # The pool kind's stats, and all's peaks: all's current is both pools' sum (stats.py).
        stats = self._stat_lists
        sa = stats[ALL]
        sp = stats[kind]
        so = stats[3 - kind]
        classic = not block.segment.expandable
        if split:
            already_split = block.prev is not None or block.next is not None
            # The allocation takes the front of the block; the old block is the remainder.
            new = Block(block.ptr, size, stream, block.segment)
            prev = new.prev = block.prev
            if prev is not None:
                prev.next = new
            new.next = block
            block.prev = new
            block.ptr += size
            block.size = remaining
            # insert_into_blocks: the remainder goes back with a fresh GC base.
            pool.insert(block)
            if classic:
                if already_split:
                    # An already-split inactive block shrinks by `size` bytes.
                    sp.inactive_split_bytes -= size
                    sp.inactive_split_bytes_freed += size
                else:
                    # A new split inactive block of `remaining` bytes appears.
                    c = sp.inactive_split_bytes + remaining
                    sp.inactive_split_bytes = c
                    if c > sp.inactive_split_bytes_peak:
                        sp.inactive_split_bytes_peak = c
                    if c + so.inactive_split_bytes > sa.inactive_split_bytes_peak:
                        sa.inactive_split_bytes_peak = c + so.inactive_split_bytes
                    c = sp.inactive_split + 1
                    sp.inactive_split = c
                    if c > sp.inactive_split_peak:
                        sp.inactive_split_peak = c
                    if c + so.inactive_split > sa.inactive_split_peak:
                        sa.inactive_split_peak = c + so.inactive_split
            block = new
        elif classic and (block.prev is not None or block.next is not None):
            # An already-split block becomes active whole.
            bsize = block.size
            sp.inactive_split_bytes -= bsize
            sp.inactive_split_bytes_freed += bsize
            sp.inactive_split -= 1
            sp.inactive_split_freed += 1
        block.allocated = True
        block.requested_size = nbytes
        self.active_blocks.add(block)
        bsize = block.size
        # alloc_found_block: allocation, allocated_bytes, active, active_bytes, requested_bytes.
        c = sp.allocation + 1
        sp.allocation = c
        if c > sp.allocation_peak:
            sp.allocation_peak = c
        if c + so.allocation > sa.allocation_peak:
            sa.allocation_peak = c + so.allocation
        c = sp.allocated_bytes + bsize
        sp.allocated_bytes = c
        if c > sp.allocated_bytes_peak:
            sp.allocated_bytes_peak = c
        if c + so.allocated_bytes > sa.allocated_bytes_peak:
            sa.allocated_bytes_peak = c + so.allocated_bytes
        c = sp.active + 1
        sp.active = c
        if c > sp.active_peak:
            sp.active_peak = c
        if c + so.active > sa.active_peak:
            sa.active_peak = c + so.active
        c = sp.active_bytes + bsize
        sp.active_bytes = c
        if c > sp.active_bytes_peak:
            sp.active_bytes_peak = c
        if c + so.active_bytes > sa.active_bytes_peak:
            sa.active_bytes_peak = c + so.active_bytes
        c = sp.requested_bytes + nbytes
        sp.requested_bytes = c
        if c > sp.requested_bytes_peak:
            sp.requested_bytes_peak = c
        if c + so.requested_bytes > sa.requested_bytes_peak:
            sa.requested_bytes_peak = c + so.requested_bytes
        if settings.split_limited and bsize >= max_split:
            self._stats.up_all(st.OVERSIZE_ALLOCATIONS, 1)
        return block

    def process_memory_info(self) -> str:
        """The OOM message's per-process sentences (CUDACachingAllocator.cpp malloc); empty without NVML."""
        if self._process_memory is None:
            return ""
        return process_memory_info(self._process_memory(), self.pid)

    @property
    def device_free_bytes(self) -> int:
        """What cudaMemGetInfo would report as free: capacity minus everything reserved."""
        return self._device.free_bytes

    # ------------------------------------------------------------------ free

    def free(self, ptr: int, *, deferred: bool = False) -> None:
        """Free a block as DeviceCachingAllocator::free does.

        Args:
            ptr: an address returned by :meth:`malloc` (0 is a no-op, like freeing nullptr).
            deferred: treat the free as waiting on an outstanding event: ``allocated`` stats
                drop now, the block stays active (``active_pending_free``) and is not reusable
                until :meth:`complete_free` or :meth:`synchronize`.

        Raises:
            AllocatorUsageError: ``ptr`` is not a live allocation.
        """
        block = self.active_blocks.get(ptr)
        if block is None:
            if ptr == 0 and type(ptr) is int:
                return
            raise AllocatorUsageError(not_live_message(self.active_blocks, ptr, "free"))
        self.free_served(block, bool(deferred))

    def active_block(self, ptr: int) -> Block | None:
        """The active block at address ``ptr`` (allocated, or freed with its free pending), or
        None: what a replay holds for an id that was live before it (:meth:`free_served`)."""
        return self.active_blocks.get(ptr)

    def free_served(self, block: Block, deferred: bool = False) -> None:
        """:meth:`free` of a block :meth:`serve_block` returned (AllocatorUsageError as there)."""
        if not block.allocated:
            raise AllocatorUsageError(not_live_message(self.active_blocks, block.ptr, "free"))
        block.allocated = False
        size = block.size
        if self._settings.split_limited and size >= self._settings.max_split:
            # Uses the current setting, as PyTorch does (§5.1 step 5).
            self._stats.down_all(st.OVERSIZE_ALLOCATIONS, 1)
        if block.stream_uses or deferred:
            # free: allocation and allocated_bytes drop at request time (§5.1 step 3).
            kind = SMALL_POOL if block.segment.is_small else LARGE_POOL
            self._stats.down(kind, _A, 1)
            self._stats.down(kind, _AB, size)
            self._events.insert(block, deferred)
        else:
            self._free_block(block, size)

    def _free_block(self, block: Block, allocated_size: int = 0) -> None:
        """free_block (CUDACachingAllocator.cpp); ``allocated_size``: from free(), whose allocation stats drop here."""
        segment = block.segment
        pool = segment.pool
        kind = SMALL_POOL if segment.is_small else LARGE_POOL
        original_size = block.size
        requested = block.requested_size
        self.active_blocks.remove(block)
        # try_merge_blocks with prev, then with next; insert_into_blocks resets the GC base.
        net_blocks = -pool.merge_free_neighbours(block)
        pool.insert(block)
        net_bytes = original_size - block.size
        stats = self._stat_lists
        sp = stats[kind]
        if not segment.expandable:
            # inactive_split excludes expandable segments.
            if block.prev is not None or block.next is not None:
                net_blocks += 1
                net_bytes += block.size
            # The net change is applied as one increase or one decrease (all's current is the
            # pools' sum: only an increase touches all, for its peak).
            if net_blocks > 0:
                c = sp.inactive_split + net_blocks
                sp.inactive_split = c
                if c > sp.inactive_split_peak:
                    sp.inactive_split_peak = c
                if c + stats[3 - kind].inactive_split > stats[ALL].inactive_split_peak:
                    stats[ALL].inactive_split_peak = c + stats[3 - kind].inactive_split
            elif net_blocks < 0:
                sp.inactive_split += net_blocks
                sp.inactive_split_freed -= net_blocks
            if net_bytes > 0:
                c = sp.inactive_split_bytes + net_bytes
                sp.inactive_split_bytes = c
                if c > sp.inactive_split_bytes_peak:
                    sp.inactive_split_bytes_peak = c
                if c + stats[3 - kind].inactive_split_bytes > stats[ALL].inactive_split_bytes_peak:
                    stats[ALL].inactive_split_bytes_peak = c + stats[3 - kind].inactive_split_bytes
            elif net_bytes < 0:
                sp.inactive_split_bytes += net_bytes
                sp.inactive_split_bytes_freed -= net_bytes
        sp.active -= 1
        sp.active_freed += 1
        sp.active_bytes -= original_size
        sp.active_bytes_freed += original_size
        sp.requested_bytes -= requested
        sp.requested_bytes_freed += requested
        if allocated_size:
            # free: allocation and allocated_bytes drop at request time (§5.1 step 3).
            sp.allocation -= 1
            sp.allocation_freed += 1
            sp.allocated_bytes -= allocated_size
            sp.allocated_bytes_freed += allocated_size

    def record_stream(self, ptr: int, stream: int) -> None:
        """recordStream: the block was used on ``stream``; its free will wait for it (DeviceCachingAllocator::recordStream).

        Raises:
            AllocatorUsageError: ``ptr`` is not a live allocation, or ``stream`` is not an int.
        """
        self._events.record_stream(ptr, stream)

    def complete_free(self, ptr: int) -> None:
        """All events of a pending free completed (the trace's ``free_completed``).

        Raises:
            AllocatorUsageError: ``ptr`` has no pending free.
        """
        self._events.complete_free(ptr)

    def complete_served(self, block: Block) -> None:
        """:meth:`complete_free` of a block :meth:`serve_block` returned (errors as there)."""
        self._events.complete_block(block, block.ptr)

    def synchronize(self) -> None:
        """The device is idle: every event completes (not counted in num_sync_all_streams)."""
        self._events.complete_all()

    # ------------------------------------------------------------------ releasing memory

    def empty_cache(self, pool_id: MempoolId | None = None) -> None:
        """torch.cuda.empty_cache (DeviceCachingAllocator::emptyCache): synchronize events, then release_cached_blocks.

        Args:
            pool_id: MAIN26 ``emptyCache(mempool_id)`` (``MemPool`` teardown): synchronize only
                that pool's events and release only that pool, if it is freeable.

        Raises:
            AllocatorUsageError: see :meth:`CacheRelease.empty_cache`.
        """
        self._release.empty_cache(pool_id)

    def release_cached_blocks(self, *, synchronize: bool = False) -> None:
        """Release every releasable cached block: large, small, then freeable private pools.

        :meth:`empty_cache` after its sync (malloc's release_cached_blocks); replay uses it for cache releases
        that the trace shows but does not name.

        Args:
            synchronize: first complete all outstanding events (synchronize_and_free_events).
        """
        if synchronize:
            self._events.synchronize_and_free()
        self._release.release_synchronized()

    # ------------------------------------------------------------------ settings

    def set_per_process_memory_fraction(self, fraction: float) -> None:
        """Like ``torch.cuda.set_per_process_memory_fraction``: see :func:`check_fraction`."""
        self._settings.apply_fraction(check_fraction(fraction))

    def set_allocator_settings(self, text: str) -> None:
        """``torch.cuda.memory._set_allocator_settings`` (torch/cuda/memory.py): AllocatorConfig.runtime_update.

        Raises ConfigError; ``memory_stats()["max_split_size"]`` keeps the creation value.
        """
        self.config = self.config.runtime_update(text, self.torch_version)
        self._settings.apply_config(self.config)

    @property
    def allowed_memory_maximum(self) -> int | None:
        """The per-process limit in bytes, or None when no fraction limit is set."""
        return self._settings.limit

    @property
    def gc_enabled(self) -> bool:
        """GC runs only with a fraction limit and a threshold > 0 (CUDACachingAllocator.cpp garbage_collect_cached_blocks)."""
        return self._settings.gc_enabled

    # ------------------------------------------------------------------ private pools

    def create_pool(
        self,
        pool_id: MempoolId | None = None,
        *,
        use_on_oom: bool = False,
        no_split: bool = False,
    ) -> MempoolId:
        """``torch.cuda.MemPool(...)``: see :meth:`PrivatePools.create_pool`."""
        return self._private.create_pool(pool_id, use_on_oom=use_on_oom, no_split=no_split)

    def release_pool(self, pool_id: MempoolId) -> None:
        """releasePool: see :meth:`PrivatePools.release_pool`."""
        self._private.release_pool(pool_id)

    def pool_use_count(self, pool_id: MempoolId) -> int:
        """getPoolUseCount (``MemPool.use_count()``): see :meth:`PrivatePools.pool_use_count`."""
        return self._private.pool_use_count(pool_id)

    @property
    def private_pool_ids(self) -> tuple[MempoolId, ...]:
        """Ids of the private pools that exist (graph_pools), in creation order."""
        return self._private.private_pool_ids

    def begin_allocate_to_pool(
        self,
        pool_id: MempoolId,
        stream_filter: StreamFilter | None = None,
        *,
        capture: bool = False,
    ) -> None:
        """beginAllocateToPool: see :meth:`PrivatePools.begin_allocate_to_pool`."""
        self._private.begin_allocate_to_pool(pool_id, stream_filter, capture=capture)

    def end_allocate_to_pool(self, pool_id: MempoolId) -> None:
        """endAllocateToPool: see :meth:`PrivatePools.end_allocate_to_pool`."""
        self._private.end_allocate_to_pool(pool_id)

    def private_pool_cached_bytes(self) -> int:
        """Free cached bytes in every private pool: the OOM message's "allocated in private pools"."""
        return self._private.cached_free_bytes()

    # ------------------------------------------------------------------ state

    def _held_blocks(self) -> Iterator[Block]:
        return all_blocks(self._small, self._large, self._private.pools.values(), self.active_blocks)

    def snapshot(self) -> list[dict[str, Any]]:
        """The segments as ``torch.cuda.memory._snapshot()["segments"]`` lists them (torch/cuda/memory.py _snapshot).

        Sorted by address. An expandable segment is one entry per contiguous mapped run.
        Block ``state`` is ``active_allocated``, ``active_pending_free`` or ``inactive``.
        """
        return snapshot(self._held_blocks(), self.device)

    def close(self) -> None:
        """Free the simulated state now: every block and segment goes at once, without waiting
        for a garbage collection (``state.unlink_all``). The allocator is not used after (a
        replay closes its allocator once its record is built)."""
        pools = [self._small, self._large]
        for private in self._private.pools.values():
            pools += (private.small, private.large)
        unlink_all(pools, self.active_blocks)
        self._events.forget()
        self._device.segments.clear()
        self._expandable.segments.clear()
        # The caller's callbacks (a replay's bound methods: a cycle through it) give way to the
        # defaults, so the caller goes by reference counting.
        device = self._device
        device.device_malloc = device.fits
        device.segment_address = device.synthetic_address

    def seed_segment(
        self, address: int, total_size: int, stream: int, *, is_small: bool,
        blocks: Sequence[SeedBlock], expandable: bool = False,
    ) -> None:
        """Add a segment that existed before the replayed trace began: see
        :func:`oomkit.core.allocator.state.seed_segment` (arguments, AllocatorUsageError)."""
        seed_segment(self._seed_target, address, total_size, stream, is_small, blocks, expandable)

    def seed_reservation(self, base: int, stream: int, *, is_small: bool, first_run: int) -> None:
        """See :func:`oomkit.core.allocator.state.seed_reservation`."""
        seed_reservation(self._seed_target, base, stream, is_small, first_run)

    def seed_segments(
        self, segments: Iterable[Any], checks: Sequence[OomkitError | None] | None = None
    ) -> list[OomkitError | None]:
        """:meth:`seed_segment` for each ``(address, total_size, stream, is_small, blocks,
        expandable)``; per segment, the error that refused it, or None (``checks``: see
        :func:`oomkit.core.allocator.state.seed_segments`)."""
        return seed_segments(self._seed_target, segments, checks)

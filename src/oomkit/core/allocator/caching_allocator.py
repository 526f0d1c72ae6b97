"""The simulator: a pure-Python ``DeviceCachingAllocator`` (ref §4-§7, §10, §12).

Every decision mirrors ``c10/cuda/CUDACachingAllocator.cpp``; comments name the function and
the ref section each rule comes from. Expandable segments (§8) live in ``expandable.py``,
seeding and snapshots in ``state.py``; this module holds malloc, free, the release paths, GC
and the stats.

Performance: malloc and free are written out by hand (no per-call objects apart from the
blocks PyTorch itself creates, stats as flat list slots) because a replay runs them millions
of times.
"""

from __future__ import annotations

import os
from bisect import bisect_left, insort
from collections.abc import Callable, Sequence

from oomkit.core.allocator.block import Block, Segment
from oomkit.core.allocator.config import AllocatorConfig
from oomkit.core.allocator.constants import (
    MIN_BLOCK_SIZE,
    ONE_EXA_BYTES,
    SIZE_MAX,
    SMALL_BUFFER,
    SMALL_SIZE,
)
from oomkit.core.allocator.expandable import ExpandableMixin
from oomkit.core.allocator.oom_message import (
    ONE_EXA_MESSAGE,
    SimulatedOutOfMemoryError,
    oom_message,
    process_memory_info,
    rejection_message,
)
from oomkit.core.allocator.pools import BlockPool, StreamFreeBlocks
from oomkit.core.allocator.private_pools import MempoolId, PrivatePoolMixin
from oomkit.core.allocator.release import ReleaseMixin
from oomkit.core.allocator.rounding import allocation_size, round_size
from oomkit.core.allocator.rules import rules_for
from oomkit.core.allocator.settings import SettingsMixin
from oomkit.core.allocator.state import StateMixin
from oomkit.core.allocator.stats import (
    ACTIVE,
    ACTIVE_BYTES,
    ALL,
    ALLOCATED_BYTES,
    ALLOCATION,
    FREED,
    INACTIVE_SPLIT,
    INACTIVE_SPLIT_BYTES,
    LARGE_POOL,
    OVERSIZE_ALLOCATIONS,
    OVERSIZE_SEGMENTS,
    PEAK,
    REQUESTED_BYTES,
    RESERVED_BYTES,
    SEGMENT,
    SMALL_POOL,
    StatsMixin,
    new_stat_lists,
)
from oomkit.errors import AllocatorUsageError

__all__ = ["CachingAllocator", "DEFAULT_CAPACITY_BYTES", "SYNTHETIC_ADDRESS_BASE"]

# An 80 GB device as the default (ref §15.7).
DEFAULT_CAPACITY_BYTES = 80 * 2**30
# First synthetic segment address: a typical CUDA VA region, 2 MiB aligned.
SYNTHETIC_ADDRESS_BASE = 0x7F00_0000_0000
_ADDRESS_ALIGN = SMALL_BUFFER

# Key of the event queue that holds deferred frees (free(ptr, deferred=True)).
_DEFERRED = object()

# Slots the hot paths touch (stats.py layout: CUR, PEAK, FREED per stat).
_A, _AP, _AF = ALLOCATION, ALLOCATION + PEAK, ALLOCATION + FREED
_ACT, _ACTP, _ACTF = ACTIVE, ACTIVE + PEAK, ACTIVE + FREED
_AB, _ABP, _ABF = ALLOCATED_BYTES, ALLOCATED_BYTES + PEAK, ALLOCATED_BYTES + FREED
_XB, _XBP, _XBF = ACTIVE_BYTES, ACTIVE_BYTES + PEAK, ACTIVE_BYTES + FREED
_RQ, _RQP, _RQF = REQUESTED_BYTES, REQUESTED_BYTES + PEAK, REQUESTED_BYTES + FREED
_IS, _ISP, _ISF = INACTIVE_SPLIT, INACTIVE_SPLIT + PEAK, INACTIVE_SPLIT + FREED
_ISB, _ISBP, _ISBF = INACTIVE_SPLIT_BYTES, INACTIVE_SPLIT_BYTES + PEAK, INACTIVE_SPLIT_BYTES + FREED


class CachingAllocator(
    SettingsMixin, StatsMixin, PrivatePoolMixin, ReleaseMixin, ExpandableMixin, StateMixin
):
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
            read when an OOM message is built (§12.2 PROC); None = no NVML, no sentences.
        pid: this process's id for those sentences; None = ``os.getpid()``.

    Private pools (CUDA graphs, ``torch.cuda.MemPool``, §3.5) are driven through
    :meth:`create_pool`, :meth:`begin_allocate_to_pool`, :meth:`end_allocate_to_pool` and
    :meth:`release_pool` (see ``oomkit.core.allocator.private_pools``).

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
        if not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise AllocatorUsageError(
                f"capacity_bytes must be a non-negative int of bytes; got {capacity_bytes!r}. "
                "Example: capacity_bytes=80 * 2**30 for an 80 GiB device."
            )
        if not isinstance(reserved_outside_bytes, int) or reserved_outside_bytes < 0:
            raise AllocatorUsageError(
                "reserved_outside_bytes must be a non-negative int of bytes; got "
                f"{reserved_outside_bytes!r}."
            )
        self.config = config if config is not None else AllocatorConfig()
        self.torch_version = torch_version
        self.rules = rules_for(torch_version)
        self.capacity_bytes = capacity_bytes
        self.reserved_outside_bytes = reserved_outside_bytes
        self.device = device
        by_counter = self.rules.tie_break_by_creation_order
        self._small = BlockPool(True, by_counter)
        self._large = BlockPool(False, by_counter)
        # active_blocks: allocated blocks and blocks whose free waits on events, by address.
        self._active: dict[int, Block] = {}
        # cuda_events: per stream, the blocks waiting on an event recorded there (FIFO).
        self._events: dict[object, dict[int, Block]] = {}
        # Classic segments by base address; expandable reservations in creation order.
        self._segments: dict[int, Segment] = {}
        self._expandable_segments: list[Segment] = []
        self._stats = new_stat_lists()
        self._num_alloc_retries = 0
        self._num_ooms = 0
        self._num_sync_all_streams = 0
        self._num_device_alloc = 0
        self._num_device_free = 0
        # total_allocated_memory (§3.7): always equal to reserved_bytes.all.current.
        self._total = 0
        # Bytes of expandable pages created by an unfinished map call (default device_malloc).
        self._pending_map = 0
        # allowed_memory_maximum when a fraction limit is set (set_fraction), else None.
        self._limit: int | None = None
        # MAIN26 registration_counter: next segment creation ordinal (§3.6).
        self._next_counter = 0
        self._next_address = SYNTHETIC_ADDRESS_BASE
        self._device_malloc = device_malloc if device_malloc is not None else self._fits
        self._segment_address = (
            segment_address if segment_address is not None else self._synthetic_address
        )
        self.segment_log: list[tuple[str, int, int]] = []
        self._process_memory = process_memory
        self.pid = os.getpid() if pid is None else pid
        self._init_private_pools()
        # MAIN26 num_oom_rejections, and whether this malloc was rejected (§4 step 6.3).
        self._num_oom_rejections = 0
        self._rejected = False
        self._apply_config()
        # DeviceCachingAllocator ctor: stats.max_split_size is captured once (§10.2, §13.26).
        self._max_split_stat = -1 if self._max_split == SIZE_MAX else self._max_split
        if self.config.per_process_memory_fraction is not None:
            # per_process_memory_fraction config: applied when the device allocator is created.
            self._apply_fraction(float(self.config.per_process_memory_fraction))

    # ------------------------------------------------------------------ hooks' defaults

    def _fits(self, nbytes: int) -> bool:
        # Our convention: cudaMalloc succeeds iff everything reserved on the device fits.
        return (
            self._total + self._pending_map + self.reserved_outside_bytes + nbytes
            <= self.capacity_bytes
        )

    def _synthetic_address(self, size: int, expandable: bool) -> int:
        address = self._next_address
        self._next_address = (
            address + (size + _ADDRESS_ALIGN - 1) // _ADDRESS_ALIGN * _ADDRESS_ALIGN
        )
        return address

    def _new_counter(self) -> int:
        counter = self._next_counter
        self._next_counter = counter + 1
        return counter

    # ------------------------------------------------------------------ malloc

    def malloc(self, nbytes: int, stream: int = 0) -> int:
        """Allocate ``nbytes`` on ``stream`` as DeviceCachingAllocator::malloc does (§4).

        Args:
            nbytes: the request in bytes (unrounded).
            stream: the stream the allocation is made on (streams compare by value).

        Returns:
            The block's device address; 0 for a 0-byte request (no allocator call, §4).

        Raises:
            AllocatorUsageError: negative or non-integer size, or a non-integer stream.
            SimulatedOutOfMemoryError: nothing could serve the request (§4 step 10).
        """
        if type(nbytes) is not int or nbytes <= 0:
            if type(nbytes) is int and nbytes == 0:
                return 0
            raise AllocatorUsageError(
                f"malloc size must be a non-negative int of bytes; got {nbytes!r}."
            )
        if type(stream) is not int:
            raise AllocatorUsageError(f"stream must be an int; got {stream!r}.")
        if nbytes >= ONE_EXA_BYTES:
            # NativeCachingAllocator::malloc: fails before the device allocator (§12.4).
            raise self._oom_error(ONE_EXA_MESSAGE, nbytes, nbytes, nbytes, stream)
        # Step 1 (process_events): events complete only at synchronize()/complete_free() or in
        # the Step 9 release here, so there is nothing to reap.
        # Step 2: round, choose the pool, size a new segment (§2).
        if nbytes < MIN_BLOCK_SIZE:
            size = MIN_BLOCK_SIZE
        elif self._divisions is None:
            size = (nbytes + MIN_BLOCK_SIZE - 1) & ~(MIN_BLOCK_SIZE - 1)
        else:
            size = round_size(nbytes, self._divisions)
        if size <= SMALL_SIZE:
            pool = self._small
            kind = SMALL_POOL
        else:
            pool = self._large
            kind = LARGE_POOL
        # should_split's inputs: is_expandable_segments_active and the pool's no_split flag.
        expandable_active = self._expandable
        no_split = False
        if self._scopes:
            # get_pool: an open allocation scope diverts the request to a private pool (§3.5).
            pool = self._scoped_pool(size, stream, pool)
            no_split = pool.owner is not None and pool.owner.no_split
        # Step 3: get_free_block, with its common case written out.
        block: Block | None = None
        if self._limit is not None and self._gc_threshold > 0.0:
            # Step 3.1: the GC clock ticks on every lookup while GC is enabled.
            pool.gc_clock += 1
        sf = pool.streams.get(stream)
        if sf is not None:
            sizes = sf.sizes
            i = bisect_left(sizes, size)
            if i < len(sizes):
                bsize = sizes[i]
                bucket = sf.buckets[bsize]
                block = bucket[0][1]
                if block.segment.expandable or self._max_split != SIZE_MAX:
                    block = self._checked_free_block(pool, sf, block, size)
                else:
                    # Take the best fit out of the set.
                    if len(bucket) == 1:
                        del sf.buckets[bsize]
                        del sizes[i]
                        if not sizes:
                            del pool.streams[stream]
                    else:
                        del bucket[0]
                    pool.count -= 1
                    block.key = None
        if block is None:
            # Step 4 (free-memory callbacks) frees nothing in a single simulated process.
            block = self._malloc_new(pool, size, nbytes, stream)
            if block.segment.pool is not pool:
                # Step 7 served it from a use_on_oom pool: try_mempool_fallback's params carry
                # that pool and is_expandable_segments_active = false.
                pool = block.segment.pool
                expandable_active = False
                no_split = pool.owner.no_split
        # Step 11: alloc_found_block with should_split.
        max_split = self._max_split
        remaining = block.size - size
        if no_split:
            # MAIN26 should_split: a no_split pool never splits.
            split = False
        elif kind == SMALL_POOL or expandable_active:
            split = remaining >= MIN_BLOCK_SIZE
        else:
            split = size < max_split and remaining > SMALL_SIZE
        stats = self._stats
        sa = stats[ALL]
        sp = stats[kind]
        classic = not block.segment.expandable
        if split:
            already_split = block.prev is not None or block.next is not None
            # The allocation takes the front of the block; the old block is the remainder.
            new = Block(block.ptr, size, stream, block.segment)
            prev = block.prev
            new.prev = prev
            if prev is not None:
                prev.next = new
            new.next = block
            block.prev = new
            block.ptr += size
            block.size = remaining
            # insert_into_blocks: the remainder goes back with a fresh GC base (pools.py
            # BlockPool.insert, written out).
            block.gc_count_base = pool.gc_clock
            entry = (
                (block.segment.counter << 64) | block.ptr if pool.by_counter else block.ptr,
                block,
            )
            block.key = entry
            sf = pool.streams.get(stream)
            if sf is None:
                sf = pool.streams[stream] = StreamFreeBlocks()
            remainder_bucket = sf.buckets.get(remaining)
            if remainder_bucket is None:
                sf.buckets[remaining] = [entry]
                insort(sf.sizes, remaining)
            else:
                remainder_bucket.insert(bisect_left(remainder_bucket, (entry[0],)), entry)
            pool.count += 1
            if classic:
                if already_split:
                    # An already-split inactive block shrinks by `size` bytes.
                    for s in (sa, sp):
                        s[_ISB] -= size
                        s[_ISBF] += size
                else:
                    # A new split inactive block of `remaining` bytes appears.
                    for s in (sa, sp):
                        c = s[_ISB] + remaining
                        s[_ISB] = c
                        if c > s[_ISBP]:
                            s[_ISBP] = c
                        c = s[_IS] + 1
                        s[_IS] = c
                        if c > s[_ISP]:
                            s[_ISP] = c
            block = new
        elif classic and (block.prev is not None or block.next is not None):
            # An already-split block becomes active whole.
            bsize = block.size
            for s in (sa, sp):
                s[_ISB] -= bsize
                s[_ISBF] += bsize
                s[_IS] -= 1
                s[_ISF] += 1
        block.allocated = True
        block.requested_size = nbytes
        ptr = block.ptr
        self._active[ptr] = block
        bsize = block.size
        # alloc_found_block: allocation, allocated_bytes, active, active_bytes, requested_bytes.
        for s in (sa, sp):
            c = s[_A] + 1
            s[_A] = c
            if c > s[_AP]:
                s[_AP] = c
            c = s[_AB] + bsize
            s[_AB] = c
            if c > s[_ABP]:
                s[_ABP] = c
            c = s[_ACT] + 1
            s[_ACT] = c
            if c > s[_ACTP]:
                s[_ACTP] = c
            c = s[_XB] + bsize
            s[_XB] = c
            if c > s[_XBP]:
                s[_XBP] = c
            c = s[_RQ] + nbytes
            s[_RQ] = c
            if c > s[_RQP]:
                s[_RQP] = c
        if bsize >= max_split:
            self._up_all(OVERSIZE_ALLOCATIONS, 1)
        return ptr

    def _checked_free_block(
        self,
        pool: BlockPool,
        sf: StreamFreeBlocks,
        block: Block,
        size: int,
        expandable_active: bool | None = None,
    ) -> Block | None:
        """get_free_block (§4 step 3.3-3.6) for expandable blocks and oversize rules.

        ``expandable_active`` None means the config's setting (Step 7 passes False).
        """
        if expandable_active is None:
            expandable_active = self._expandable
        if block.segment.expandable:
            if expandable_active:
                # Step 3.3: prefer a slightly larger interior block over the growable tail;
                # expandable_size counts the unmapped space right after a block.
                def expandable_size(b: Block) -> int:
                    nxt = b.next
                    return b.size + (nxt.size if nxt is not None and not nxt.mapped else 0)

                candidates = sf.iter_from(size)
                next(candidates)
                for nxt_block in candidates:
                    if not block.segment.expandable:
                        break
                    if expandable_size(nxt_block) >= expandable_size(block):
                        break
                    block = nxt_block
            else:
                # Expandable segments turned off: skip every expandable block of this stream.
                found = None
                for candidate in sf.iter_from(size):
                    if not candidate.segment.expandable:
                        found = candidate
                        break
                if found is None:
                    return None
                block = found
        max_split = self._max_split
        if max_split != SIZE_MAX:
            # Step 3.4, oversize rule 1: a small request never takes an oversize block.
            if size < max_split and block.size >= max_split:
                return None
            # Step 3.5, oversize rule 2: a large request takes a block only within the slack.
            if size >= max_split and block.size >= size + self._non_split_rounding:
                return None
        pool.remove(block)
        return block

    def _malloc_new(self, pool: BlockPool, size: int, nbytes: int, stream: int) -> Block:
        """Steps 5-10: GC, new segment, Step 7 (use_on_oom), Step 8, Step 9 (retry), or OOM."""
        alloc_size = allocation_size(size, self._large_segment_size)
        self._rejected = False
        if self._limit is not None and self._gc_threshold > 0.0:
            # Step 5: garbage_collect_cached_blocks.
            self._garbage_collect_cached_blocks()
        block = self._alloc_block(pool, size, alloc_size, stream, False)
        # A throw_on_cudamalloc_oom rejection skips the retry chain (MAIN26 malloc).
        if block is None and not self._rejected:
            if self.rules.mempool_use_on_oom and pool.owner is None:
                # Step 7: try_mempool_fallback (only for default-pool requests).
                block = self._mempool_fallback(size, stream)
            if block is None and self._release_available_cached_blocks(pool, size, stream):
                # Step 8: release_available_cached_blocks, then alloc_block(isRetry=false).
                block = self._alloc_block(pool, size, alloc_size, stream, False)
            if block is None and not self._capture_blocks_release(stream):
                # Step 9: release_cached_blocks, then alloc_block(isRetry=true); skipped
                # while a capture is underway.
                self._release_cached_blocks(None, stream)
                block = self._alloc_block(pool, size, alloc_size, stream, True)
        if block is None:
            if self._rejected:
                # NativeCachingAllocator::malloc: a rejected request raises its own message
                # (§12.4); no num_ooms increment.
                self._rejected = False
                error = self._oom_error(rejection_message(nbytes), nbytes, size, alloc_size, stream)
                error.rejected = True
                raise error
            # Step 10: OOM; nothing freed above is rolled back.
            self._num_ooms += 1
            message = oom_message(
                self.rules,
                alloc_size=alloc_size,
                device=self.device,
                total=self.capacity_bytes,
                free=self.device_free_bytes,
                allocated=self._stats[ALL][ALLOCATED_BYTES],
                reserved=self._stats[ALL][RESERVED_BYTES],
                allowed=self._limit,
                private_pool_cached=self.private_pool_cached_bytes(),
                process_info=self.process_memory_info(),
            )
            raise self._oom_error(message, nbytes, size, alloc_size, stream)
        return block

    def process_memory_info(self) -> str:
        """The OOM message's per-process sentences (reportProcessMemoryInfo, §12.2 PROC).

        Empty without a ``process_memory`` provider (no NVML).
        """
        if self._process_memory is None:
            return ""
        return process_memory_info(self._process_memory(), self.pid)

    @property
    def device_free_bytes(self) -> int:
        """What cudaMemGetInfo would report as free: capacity minus everything reserved."""
        return max(0, self.capacity_bytes - self.reserved_outside_bytes - self._total)

    def _oom_error(
        self, message: str, nbytes: int, size: int, alloc_size: int, stream: int
    ) -> SimulatedOutOfMemoryError:
        return SimulatedOutOfMemoryError(
            message,
            requested_bytes=nbytes,
            rounded_bytes=size,
            alloc_size_bytes=alloc_size,
            allocated_bytes=self._stats[ALL][ALLOCATED_BYTES],
            reserved_bytes=self._stats[ALL][RESERVED_BYTES],
            capacity_bytes=self.capacity_bytes,
            free_bytes=self.device_free_bytes,
            allowed_bytes=self._limit,
            stream=stream,
        )

    def _alloc_block(
        self, pool: BlockPool, size: int, alloc_size: int, stream: int, is_retry: bool
    ) -> Block | None:
        """alloc_block (§4 step 6): a new segment (or expandable pages), or None."""
        if is_retry:
            # Step 6.1: counted at call time, whatever the outcome.
            self._num_alloc_retries += 1
        if self._limit is not None and self._total + alloc_size > self._limit:
            # Step 6.2: the fraction limit is tested against alloc_size; no cudaMalloc.
            return None
        if self._reject_limit is not None and self._total + alloc_size > self._reject_limit:
            # Step 6.3 (MAIN26 throw_on_cudamalloc_oom): reject instead of trying cudaMalloc.
            self._num_oom_rejections += 1
            self._rejected = True
            return None
        owner = pool.owner
        if self._expandable:
            # Step 6.4: the expandable path gets the rounded size, not alloc_size.
            block = self._try_allocate_expandable_block(pool, size, stream)
            if block is not None and owner is not None:
                # alloc_block: one cudaMalloc_count per expandable allocation that succeeded.
                owner.segment_count += 1
            return block
        if not self._device_malloc(alloc_size):
            return None
        if owner is not None:
            owner.segment_count += 1
        ptr = self._segment_address(alloc_size, False)
        segment = Segment(ptr, alloc_size, stream, pool.is_small, self._new_counter(), pool=pool)
        self._segments[ptr] = segment
        block = Block(ptr, alloc_size, stream, segment)
        self._total += alloc_size
        kind = SMALL_POOL if pool.is_small else LARGE_POOL
        self._up(kind, SEGMENT, 1)
        self._up(kind, RESERVED_BYTES, alloc_size)
        if alloc_size >= self._max_split:
            self._up_all(OVERSIZE_SEGMENTS, 1)
        self._num_device_alloc += 1
        self.segment_log.append(("segment_alloc", ptr, alloc_size))
        return block

    # ------------------------------------------------------------------ stats helpers

    def _up(self, kind: int, i: int, amount: int) -> None:
        # increase_stat on `all` and the pool kind: current and peak (allocated is derived).
        stats = self._stats
        for s in (stats[ALL], stats[kind]):
            c = s[i] + amount
            s[i] = c
            if c > s[i + PEAK]:
                s[i + PEAK] = c

    def _down(self, kind: int, i: int, amount: int) -> None:
        # decrease_stat on `all` and the pool kind.
        stats = self._stats
        for s in (stats[ALL], stats[kind]):
            s[i] -= amount
            s[i + FREED] += amount

    def _up_all(self, i: int, amount: int) -> None:
        # increase_stat on a single Stat (the oversize stats).
        s = self._stats[ALL]
        c = s[i] + amount
        s[i] = c
        if c > s[i + PEAK]:
            s[i + PEAK] = c

    def _down_all(self, i: int, amount: int) -> None:
        s = self._stats[ALL]
        s[i] -= amount
        s[i + FREED] += amount

    # ------------------------------------------------------------------ free

    def free(self, ptr: int, *, deferred: bool = False) -> None:
        """Free a block as DeviceCachingAllocator::free does (§5.1).

        Args:
            ptr: an address returned by :meth:`malloc` (0 is a no-op, like freeing nullptr).
            deferred: treat the free as waiting on an outstanding event: ``allocated`` stats
                drop now, the block stays active (``active_pending_free``) and is not reusable
                until :meth:`complete_free` or :meth:`synchronize`.

        Raises:
            AllocatorUsageError: ``ptr`` is not a live allocation.
        """
        block = self._active.get(ptr)
        if block is None or not block.allocated:
            if ptr == 0 and type(ptr) is int:
                return
            raise AllocatorUsageError(self._not_live(ptr, "free"))
        block.allocated = False
        stats = self._stats
        size = block.size
        # free: allocation and allocated_bytes drop at request time (§5.1 step 3).
        for s in (stats[ALL], stats[SMALL_POOL if block.segment.is_small else LARGE_POOL]):
            s[_A] -= 1
            s[_AF] += 1
            s[_AB] -= size
            s[_ABF] += size
        if size >= self._max_split:
            # Uses the current setting, as PyTorch does (§5.1 step 5).
            self._down_all(OVERSIZE_ALLOCATIONS, 1)
        if block.stream_uses or deferred:
            self._insert_events(block, deferred)
        else:
            self._free_block(block)

    def _not_live(self, ptr: object, what: str) -> str:
        if isinstance(ptr, int) and ptr in self._active:
            return (
                f"{what}: address {ptr:#x} was already freed (its free is still pending). "
                "Each allocation may be freed once."
            )
        shown = f"{ptr:#x}" if isinstance(ptr, int) else repr(ptr)
        return (
            f"{what}: {shown} is not an address this allocator handed out, or it was already "
            "freed (PyTorch: 'invalid device pointer'). Pass the value malloc() returned."
        )

    def _insert_events(self, block: Block, deferred: bool) -> None:
        """insert_events: one event per stream in stream_uses, plus one for a deferred free."""
        uses = block.stream_uses
        block.stream_uses = None
        events = self._events
        ptr = block.ptr
        if uses:
            for st in sorted(uses):
                events.setdefault(st, {})[ptr] = block
                block.event_count += 1
        if deferred:
            events.setdefault(_DEFERRED, {})[ptr] = block
            block.event_count += 1

    def _free_block(self, block: Block) -> None:
        """free_block (§5.2): merge with free neighbours and return the block to its pool."""
        segment = block.segment
        pool = segment.pool
        kind = SMALL_POOL if segment.is_small else LARGE_POOL
        original_size = block.size
        requested = block.requested_size
        del self._active[block.ptr]
        net_blocks = 0
        net_bytes = 0
        # try_merge_blocks with prev, then with next.
        src = block.prev
        if (
            src is not None
            and not src.allocated
            and not src.event_count
            and not src.stream_uses
            and src.mapped == block.mapped
        ):
            if src.mapped:
                pool.remove(src)
            else:
                pool.remove_unmapped(src)
            block.ptr = src.ptr
            block.prev = src.prev
            if src.prev is not None:
                src.prev.next = block
            block.size += src.size
            net_blocks -= 1
            net_bytes -= src.size
        src = block.next
        if (
            src is not None
            and not src.allocated
            and not src.event_count
            and not src.stream_uses
            and src.mapped == block.mapped
        ):
            if src.mapped:
                pool.remove(src)
            else:
                pool.remove_unmapped(src)
            block.next = src.next
            if src.next is not None:
                src.next.prev = block
            block.size += src.size
            net_blocks -= 1
            net_bytes -= src.size
        # insert_into_blocks resets the GC base (pools.py BlockPool.insert, written out).
        block.gc_count_base = pool.gc_clock
        entry = ((segment.counter << 64) | block.ptr if pool.by_counter else block.ptr, block)
        block.key = entry
        bsize = block.size
        sf = pool.streams.get(block.stream)
        if sf is None:
            sf = pool.streams[block.stream] = StreamFreeBlocks()
        bucket = sf.buckets.get(bsize)
        if bucket is None:
            sf.buckets[bsize] = [entry]
            insort(sf.sizes, bsize)
        else:
            bucket.insert(bisect_left(bucket, (entry[0],)), entry)
        pool.count += 1
        stats = self._stats
        sa = stats[ALL]
        sp = stats[kind]
        if not segment.expandable:
            # inactive_split excludes expandable segments.
            if block.prev is not None or block.next is not None:
                net_blocks += 1
                net_bytes += block.size
            # The net change is applied as one increase or one decrease.
            if net_blocks > 0:
                self._up(kind, INACTIVE_SPLIT, net_blocks)
            elif net_blocks < 0:
                for s in (sa, sp):
                    s[_IS] += net_blocks
                    s[_ISF] -= net_blocks
            if net_bytes > 0:
                self._up(kind, INACTIVE_SPLIT_BYTES, net_bytes)
            elif net_bytes < 0:
                for s in (sa, sp):
                    s[_ISB] += net_bytes
                    s[_ISBF] -= net_bytes
        for s in (sa, sp):
            s[_ACT] -= 1
            s[_ACTF] += 1
            s[_XB] -= original_size
            s[_XBF] += original_size
            s[_RQ] -= requested
            s[_RQF] += requested

    def record_stream(self, ptr: int, stream: int) -> None:
        """recordStream: the block was used on ``stream``; its free will wait for it (§5.1).

        Raises:
            AllocatorUsageError: ``ptr`` is not a live allocation, or ``stream`` is not an int.
        """
        block = self._active.get(ptr)
        if block is None or not block.allocated:
            raise AllocatorUsageError(self._not_live(ptr, "record_stream"))
        if type(stream) is not int:
            raise AllocatorUsageError(f"stream must be an int; got {stream!r}.")
        if stream == block.stream:
            # Uses on the allocation stream need no synchronization.
            return
        if block.stream_uses is None:
            block.stream_uses = {stream}
        else:
            block.stream_uses.add(stream)

    def complete_free(self, ptr: int) -> None:
        """All events of a pending free completed (the trace's ``free_completed``).

        Raises:
            AllocatorUsageError: ``ptr`` has no pending free.
        """
        block = self._active.get(ptr)
        if block is None or block.allocated or not block.event_count:
            shown = f"{ptr:#x}" if isinstance(ptr, int) else repr(ptr)
            raise AllocatorUsageError(
                f"complete_free: {shown} has no pending free. Call free(ptr, deferred=True) "
                "or record_stream() before free() first."
            )
        for key in list(self._events):
            queue = self._events[key]
            if queue.pop(ptr, None) is not None and not queue:
                del self._events[key]
        block.event_count = 0
        self._free_block(block)

    def synchronize(self) -> None:
        """The device is idle: every outstanding event completes and its free finishes.

        Blocks are freed stream by stream in event order, as process_events would after a
        device synchronize. Unlike :meth:`empty_cache` this does not count in
        ``num_sync_all_streams``.
        """
        self._complete_all_events()

    def _complete_all_events(self) -> None:
        events = self._events
        self._events = {}
        for queue in events.values():
            for block in queue.values():
                block.event_count -= 1
                if block.event_count == 0:
                    self._free_block(block)

    def _synchronize_and_free_events(self) -> None:
        """synchronize_and_free_events (§4 step 9.1)."""
        self._num_sync_all_streams += 1
        self._complete_all_events()

    # ------------------------------------------------------------------ releasing memory

    def empty_cache(self, pool_id: MempoolId | None = None) -> None:
        """torch.cuda.empty_cache (§5.3): synchronize events, then release_cached_blocks.

        Also releases every freeable private pool (use_count 0) and deletes those left empty.

        Args:
            pool_id: MAIN26 ``emptyCache(mempool_id)`` (``MemPool`` teardown): synchronize only
                that pool's events and release only that pool, if it is freeable.

        Raises:
            AllocatorUsageError: V24 rules with an allocation scope open (PyTorch fails the
                internal assert ``captures_underway.empty()``), or a pool id where the modelled
                version has no per-pool emptyCache.
        """
        if pool_id is not None and not self.rules.empty_cache_per_pool:
            raise AllocatorUsageError(
                "empty_cache(pool_id) is modelled from 2026 main (torch >= 2.12); call "
                "empty_cache() for this torch_version."
            )
        if pool_id is None and self._scopes and not self.rules.release_skips_only_real_capture:
            raise AllocatorUsageError(
                "empty_cache() while an allocation scope is open: this torch version fails "
                "the internal assert 'captures_underway.empty()'. Call end_allocate_to_pool "
                "first."
            )
        self._release_cached_blocks(pool_id, None)

    def release_cached_blocks(self, *, synchronize: bool = False) -> None:
        """Release every releasable cached block, large pool then small pool (§4 step 9.2-9.3).

        Freeable private pools are released after the default pools, as in PyTorch.

        This is what :meth:`empty_cache` does after synchronizing; replay uses it for cache
        releases that the trace shows but does not name (ref §15.3).

        Args:
            synchronize: first complete all outstanding events (synchronize_and_free_events).
        """
        if synchronize:
            self._synchronize_and_free_events()
        self._release_pools()

"""Releasing cached memory (ref §4 steps 5, 8, 9; §4.1; §5.3; §7).

``release_cached_blocks`` (§4 step 9, §5.3), ``release_blocks`` (cudaFree of whole free classic
segments and unmapping of free expandable pages), ``release_available_cached_blocks`` (Step 8)
and ``garbage_collect_cached_blocks`` (§7) of CUDACachingAllocator.cpp, as :class:`CacheRelease`
over the allocator's pools, device memory, expandable segments and pending frees.
"""

from __future__ import annotations

from bisect import bisect_left

from oomkit.core.allocator.active_blocks import ActiveBlocks
from oomkit.core.allocator.block import Block
from oomkit.core.allocator.constants import SIZE_MAX
from oomkit.core.allocator.device_memory import DeviceMemory
from oomkit.core.allocator.expandable import ExpandableSegments
from oomkit.core.allocator.pending_frees import PendingFrees
from oomkit.core.allocator.pools import BlockPool
from oomkit.core.allocator.private_pools import MempoolId, PrivatePools
from oomkit.core.allocator.settings import AllocatorSettings
from oomkit.errors import AllocatorUsageError

__all__ = ["CacheRelease"]


def _releasable(block: Block) -> bool:
    """Whether Step 8 may cudaFree this free oversize block as a whole segment.

    Expandable blocks are skipped (PR #134338, ref §15.10). A split block is skipped too: under a
    ``max_split_size`` set from the start PyTorch never splits an oversize block, so every free
    oversize block is a whole segment; only a what-if replay inherits split ones from a state
    recorded without the setting, and those are not released (ref §15.11).
    """
    return not block.segment.expandable and block.prev is None and block.next is None


class CacheRelease:
    """The paths that give cached memory back to the (simulated) driver.

    Args:
        default_pools: the default (small, large) pools.
        active: the allocator's active blocks (a freeable private pool holding none is deleted).
        parts: the allocator's settings, device memory, expandable segments, private pools
            and pending frees.
    """

    __slots__ = (
        "_small",
        "_large",
        "_active",
        "_settings",
        "_device",
        "_expandable",
        "_private",
        "_events",
    )

    def __init__(
        self,
        default_pools: tuple[BlockPool, BlockPool],
        active: ActiveBlocks,
        parts: tuple[
            AllocatorSettings, DeviceMemory, ExpandableSegments, PrivatePools, PendingFrees
        ],
    ) -> None:
        self._small, self._large = default_pools
        self._active = active
        self._settings, self._device, self._expandable, self._private, self._events = parts

    def release_cached_blocks(self, pool_id: MempoolId | None, stream: int | None) -> None:
        """release_cached_blocks (§4 step 9, §5.3).

        ``pool_id`` None: synchronize events and release the default pools (unless a capture
        on ``stream`` forbids it; None: any capture), then every freeable private pool. A pool
        id (MAIN26 emptyCache(id)): synchronize that pool's events and release only it, if it
        is freeable.
        """
        if pool_id is None and not self._private.capture_blocks_release(stream):
            self._events.synchronize_and_free()
            self.release_blocks(self._large)
            self.release_blocks(self._small)
        self._release_freeable_pools(pool_id)

    def empty_cache(self, pool_id: MempoolId | None) -> None:
        """torch.cuda.empty_cache: release_cached_blocks for every pool, or one (§5.3).

        Raises:
            AllocatorUsageError: V24 rules with an allocation scope open (PyTorch fails the
                internal assert ``captures_underway.empty()``), or a pool id where the modelled
                version has no per-pool emptyCache.
        """
        rules = self._private.rules
        if pool_id is not None and not rules.empty_cache_per_pool:
            raise AllocatorUsageError(
                "empty_cache(pool_id) is modelled from 2026 main (torch >= 2.12); call "
                "empty_cache() for this torch_version."
            )
        if pool_id is None and self._private.scopes and not rules.release_skips_only_real_capture:
            raise AllocatorUsageError(
                "empty_cache() while an allocation scope is open: this torch version fails "
                "the internal assert 'captures_underway.empty()'. Call end_allocate_to_pool "
                "first."
            )
        self.release_cached_blocks(pool_id, None)

    def release_synchronized(self) -> None:
        """release_cached_blocks after its event sync: default large, default small, then the
        freeable private pools."""
        self.release_blocks(self._large)
        self.release_blocks(self._small)
        self._release_freeable_pools(None)

    def _release_freeable_pools(self, pool_id: MempoolId | None) -> None:
        self._private.release_freeable(
            pool_id, self.release_blocks, self._events.synchronize_pool, self._active
        )

    def release_blocks(self, pool: BlockPool) -> None:
        """release_blocks: cudaFree unsplit classic blocks; unmap free expandable pages."""
        to_unmap: list[Block] = []
        for block in pool.ordered():
            if block.segment.expandable:
                to_unmap.append(block)
            elif block.prev is None and block.next is None:
                self._device.release_block(block, pool)
        for block in to_unmap:
            self._expandable.unmap_block(block, pool)
            if block.prev is None and block.next is None and not block.mapped:
                self._expandable.release_segment(block, pool)

    def release_available(self, pool: BlockPool, size: int, stream: int) -> bool:
        """release_available_cached_blocks (§4 step 8): free just enough oversize blocks."""
        max_split = self._settings.max_split
        if max_split == SIZE_MAX:
            return False
        key_size = max(size, max_split)
        # This stream's part of the set, in set order; lower_bound(stream, key_size).
        blocks = pool.stream_ordered(stream)
        i = bisect_left([b.size for b in blocks], key_size)
        if i < len(blocks) and _releasable(blocks[i]):
            self._device.release_block(blocks[i], pool)
            return True
        # No single block is large enough (or it is expandable, which is never released
        # here: MAIN26 / PR #134338, ref §15.10; or it is split, ref §15.11): free the largest
        # oversize ones, walking back from the search position; the walk ends at the first
        # block of another stream.
        released = 0
        i -= 1
        while released < key_size and i >= 0:
            cur = blocks[i]
            if cur.size < max_split:
                break
            if _releasable(cur):
                released += cur.size
                self._device.release_block(cur, pool)
            i -= 1
        return released >= key_size

    def garbage_collect(self) -> None:
        """garbage_collect_cached_blocks (§7): free aged unsplit blocks of the default large pool."""
        pool = self._large
        limit = self._settings.limit
        assert limit is not None
        gc_threshold = int(self._settings.gc_threshold * float(limit))
        if self._device.total_bytes <= gc_threshold:
            return
        target = self._device.total_bytes - gc_threshold
        clock = pool.gc_clock
        total_age = 0
        count = 0
        for b in pool.ordered():
            # Unsplit, non-expandable blocks of every stream (PR #134338, ref §15.10).
            if b.prev is None and b.next is None and not b.segment.expandable:
                total_age += clock - b.gc_count_base
                count += 1
        if count == 0:
            return
        reclaimed = 0
        freed = True
        while reclaimed < target and freed and count > 0:
            threshold = total_age / count
            freed = False
            # One pass in set order; it does not stop at the target.
            for b in pool.ordered():
                if b.prev is None and b.next is None and not b.segment.expandable:
                    age = clock - b.gc_count_base
                    if age >= threshold:
                        freed = True
                        reclaimed += b.size
                        total_age -= age
                        count -= 1
                        self._device.release_block(b, pool)

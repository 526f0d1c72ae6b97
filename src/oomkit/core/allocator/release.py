"""Releasing cached memory (ref §4 steps 5, 8, 9; §4.1; §5.3; §7).

``release_blocks`` / ``release_block`` (cudaFree of whole free classic segments and unmapping of
free expandable pages), ``release_available_cached_blocks`` (Step 8) and
``garbage_collect_cached_blocks`` (§7) of CUDACachingAllocator.cpp. A mixin of
:class:`~oomkit.core.allocator.caching_allocator.CachingAllocator`; it uses that class's state.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import TYPE_CHECKING

from oomkit.core.allocator.block import Block, Segment
from oomkit.core.allocator.constants import SIZE_MAX
from oomkit.core.allocator.pools import BlockPool
from oomkit.core.allocator.stats import (
    LARGE_POOL,
    OVERSIZE_SEGMENTS,
    RESERVED_BYTES,
    SEGMENT,
    SMALL_POOL,
)

__all__ = ["ReleaseMixin"]


def _releasable(block: Block) -> bool:
    """Whether Step 8 may cudaFree this free oversize block as a whole segment.

    Expandable blocks are skipped (PR #134338, ref §15.10). A split block is skipped too: under a
    ``max_split_size`` set from the start PyTorch never splits an oversize block, so every free
    oversize block is a whole segment; only a what-if replay inherits split ones from a state
    recorded without the setting, and those are not released (ref §15.11).
    """
    return not block.segment.expandable and block.prev is None and block.next is None


class ReleaseMixin:
    """The paths that give memory back to the (simulated) driver."""

    if TYPE_CHECKING:

        def _down(self, kind: int, i: int, amount: int) -> None:  # pragma: no cover
            ...

        def _down_all(self, i: int, amount: int) -> None:  # pragma: no cover
            ...

        def _unmap_block(self, block: Block, pool: BlockPool) -> None:  # pragma: no cover
            ...

        def _release_expandable_segment(
            self, block: Block, pool: BlockPool
        ) -> None:  # pragma: no cover
            ...

        def _release_freeable_pools(
            self, pool_id: tuple[int, int] | None
        ) -> None: ...  # pragma: no cover

    # Provided by CachingAllocator / ExpandableMixin.
    segment_log: list[tuple[str, int, int]]
    _small: BlockPool
    _large: BlockPool
    _segments: dict[int, Segment]
    _total: int
    _max_split: int
    _limit: int | None
    _gc_threshold: float
    _num_device_free: int

    def _release_pools(self) -> None:
        # release_cached_blocks after its event sync: default large, default small, then the
        # freeable private pools.
        self._release_blocks(self._large)
        self._release_blocks(self._small)
        self._release_freeable_pools(None)

    def _release_blocks(self, pool: BlockPool) -> None:
        """release_blocks: cudaFree unsplit classic blocks; unmap free expandable pages."""
        to_unmap: list[Block] = []
        for block in pool.ordered():
            if block.segment.expandable:
                to_unmap.append(block)
            elif block.prev is None and block.next is None:
                self._release_block(block, pool)
        for block in to_unmap:
            self._unmap_block(block, pool)
            if block.prev is None and block.next is None and not block.mapped:
                self._release_expandable_segment(block, pool)

    def _release_block(self, block: Block, pool: BlockPool) -> None:
        """release_block (§4.1): cudaFree a whole free classic segment."""
        size = block.size
        self._num_device_free += 1
        self.segment_log.append(("segment_free", block.ptr, size))
        self._total -= size
        if pool.owner is not None:
            # release_block: a private pool counts its live cudaMallocs (cudaMalloc_count).
            pool.owner.segment_count -= 1
        kind = SMALL_POOL if pool.is_small else LARGE_POOL
        self._down(kind, SEGMENT, 1)
        self._down(kind, RESERVED_BYTES, size)
        if size >= self._max_split:
            self._down_all(OVERSIZE_SEGMENTS, 1)
        pool.remove(block)
        del self._segments[block.segment.address]

    def _release_available_cached_blocks(self, pool: BlockPool, size: int, stream: int) -> bool:
        """release_available_cached_blocks (§4 step 8): free just enough oversize blocks."""
        max_split = self._max_split
        if max_split == SIZE_MAX:
            return False
        key_size = max(size, max_split)
        # This stream's part of the set, in set order; lower_bound(stream, key_size).
        blocks = pool.stream_ordered(stream)
        i = bisect_left([b.size for b in blocks], key_size)
        if i < len(blocks) and _releasable(blocks[i]):
            self._release_block(blocks[i], pool)
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
                self._release_block(cur, pool)
            i -= 1
        return released >= key_size

    def _garbage_collect_cached_blocks(self) -> None:
        """garbage_collect_cached_blocks (§7): free aged unsplit large blocks."""
        limit = self._limit
        assert limit is not None
        gc_threshold = int(self._gc_threshold * float(limit))
        if self._total <= gc_threshold:
            return
        target = self._total - gc_threshold
        pool = self._large
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
                        self._release_block(b, pool)

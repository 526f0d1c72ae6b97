"""Expandable segments (ref §8): VA reservations whose pages are mapped and unmapped on demand.

Mirrors ``ExpandableSegment`` (map / unmap page math) and the DeviceCachingAllocator methods
``find_expandable_block``, ``map_block``, ``try_allocate_expandable_block``, ``unmap_block``
and ``release_expandable_segment`` of CUDACachingAllocator.cpp, as :class:`ExpandableSegments`,
which maps its pages through the allocator's :class:`~oomkit.core.allocator.device_memory.DeviceMemory`.
"""

from __future__ import annotations

from bisect import bisect_left

from oomkit.core.allocator.block import Block, Segment
from oomkit.core.allocator.constants import EXPANDABLE_RESERVE_DENOMINATOR, SMALL_BUFFER
from oomkit.core.allocator.device_memory import DeviceMemory
from oomkit.core.allocator.pools import BlockPool
from oomkit.core.allocator.settings import AllocatorSettings
from oomkit.core.allocator.stats import AllocatorStats

__all__ = ["ExpandableSegments", "expandable_reserve_size"]


def expandable_reserve_size(capacity_bytes: int, page_bytes: int) -> int:
    """The VA reservation of one expandable segment (§1, ExpandableSegment ctor).

    ``numSegments(totalGlobalMem + totalGlobalMem / 8)`` pages of ``page_bytes``.
    """
    wanted = capacity_bytes + capacity_bytes // EXPANDABLE_RESERVE_DENOMINATOR
    pages = (wanted + page_bytes - 1) // page_bytes
    return pages * page_bytes


class ExpandableSegments:
    """The expandable reservations of one allocator, in creation order, and their operations."""

    __slots__ = ("segments", "_device", "_stats", "_settings")

    def __init__(
        self, device: DeviceMemory, stats: AllocatorStats, settings: AllocatorSettings
    ) -> None:
        self.segments: list[Segment] = []
        self._device = device
        self._stats = stats
        self._settings = settings

    def page_size(self, pool: BlockPool) -> int:
        # ExpandableSegment: 2 MiB pages for the small pool, large_segment_size for the large.
        return SMALL_BUFFER if pool.is_small else self._settings.large_segment_size

    def new_segment(
        self, pool: BlockPool, stream: int, base: int | None, size: int | None = None
    ) -> Block:
        """A fresh reservation as one unmapped block (find_expandable_block, §8.3 step 2)."""
        page = self.page_size(pool)
        if size is None:
            size = expandable_reserve_size(self._device.capacity_bytes, page)
        if base is None:
            base = self._device.segment_address(size, True)
        # MAIN26 gives each new expandable segment a fresh registration counter (§3.6).
        segment = Segment(
            base,
            size,
            stream,
            pool.is_small,
            self._device.new_counter(),
            expandable=True,
            page_size=page,
            pool=pool,
        )
        self.segments.append(segment)
        block = Block(base, size, stream, segment)
        block.mapped = False
        pool.insert_unmapped(block)
        return block

    def _find_expandable_block(self, pool: BlockPool, stream: int, size: int) -> Block:
        """find_expandable_block: the lowest address where ``size`` bytes fit (§8.3 step 1)."""

        def allocatable(b: Block | None) -> bool:
            return b is not None and not b.allocated and not b.event_count and not b.stream_uses

        def has_space(b: Block | None) -> bool:
            total = 0
            while total < size and b is not None and allocatable(b):
                total += b.size
                b = b.next
            return total >= size

        unmapped = pool.unmapped
        i = bisect_left(unmapped, (stream,))
        n = len(unmapped)
        while i < n:
            entry = unmapped[i]
            if entry[0] != stream:
                break
            c: Block = entry[-1]
            # A free block right before the unmapped range can be grown into it.
            if allocatable(c.prev):
                c = c.prev  # type: ignore[assignment]
            if has_space(c):
                return c
            i += 1
        return self.new_segment(pool, stream, None)

    def _map_pages(self, segment: Segment, offset: int, nbytes: int) -> int:
        """ExpandableSegment::map: create and map whole pages; 0 if any creation fails."""
        page = segment.page_size
        begin = offset // page
        end = (offset + nbytes + page - 1) // page
        pages = segment.mapped_pages
        assert pages is not None
        if end > segment.size // page:
            return 0
        if end > len(pages):
            pages.extend(bytes(end - len(pages)))
        device = self._device
        created = 0
        try:
            for i in range(begin, end):
                assert not pages[i], "mapping a page that is already mapped"
                # cuMemCreate per page; an OOM releases the pages created in this call.
                if not device.device_malloc(page):
                    return 0
                created += 1
                device.pending_map_bytes += page
        finally:
            device.pending_map_bytes = 0
        for i in range(begin, end):
            pages[i] = 1
        return (end - begin) * page

    def _map_block(self, to_map: Block, nbytes: int, pool: BlockPool) -> bool:
        """map_block (§8.3 step 3): map pages at the front of an unmapped block."""
        segment = to_map.segment
        mapped = self._map_pages(segment, to_map.ptr - segment.address, nbytes)
        if mapped == 0:
            return False
        pool.remove_unmapped(to_map)
        to_map.mapped = True
        if mapped < to_map.size:
            # to_map -> remaining (unmapped) -> to_map.next
            remaining = Block(to_map.ptr + mapped, to_map.size - mapped, to_map.stream, segment)
            remaining.mapped = False
            remaining.prev = to_map
            remaining.next = to_map.next
            if to_map.next is not None:
                to_map.next.prev = remaining
            to_map.next = remaining
            pool.insert_unmapped(remaining)
            to_map.size = mapped
        map_ptr = to_map.ptr
        pool.merge_free_neighbours(to_map)
        pool.insert(to_map)
        self._device.add_reserved(pool, mapped)
        self._stats.num_device_alloc += 1
        self._device.segment_log.append(("segment_map", map_ptr, mapped))
        return True

    def try_allocate(self, pool: BlockPool, size: int, stream: int) -> Block | None:
        """try_allocate_expandable_block (§8.3): grow a segment to hold ``size`` bytes."""
        candidate = self._find_expandable_block(pool, stream, size)
        if candidate.size < size and candidate.next is None and not candidate.mapped:
            # MAIN26: even a fresh reservation is too small for the request.
            return None
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size), pool):
            return None
        # Pages mapped by earlier iterations stay mapped if a later one fails.
        while candidate.size < size:
            nxt = candidate.next
            if nxt is None or nxt.mapped:
                return None
            if not self._map_block(nxt, min(size - candidate.size, nxt.size), pool):
                return None
            candidate = nxt
        pool.remove(candidate)
        return candidate

    def _unmap_pages(self, segment: Segment, offset: int, nbytes: int) -> tuple[int, int]:
        """ExpandableSegment::unmap: unmap the pages entirely inside the range."""
        page = segment.page_size
        begin = (offset + page - 1) // page
        end = (offset + nbytes) // page
        if begin >= end:
            return offset, 0
        pages = segment.mapped_pages
        assert pages is not None
        for i in range(begin, min(end, len(pages))):
            pages[i] = 0
        return begin * page, (end - begin) * page

    def unmap_block(self, block: Block, pool: BlockPool) -> None:
        """unmap_block (§8.4): unmap the whole pages of a free expandable block."""
        segment = block.segment
        offset, unmapped = self._unmap_pages(segment, block.ptr - segment.address, block.size)
        if unmapped == 0:
            return
        pool.remove(block)
        unmapped_ptr = segment.address + offset
        before = unmapped_ptr - block.ptr
        if before > 0:
            # prev -> before_free -> block
            before_free = Block(block.ptr, before, block.stream, segment)
            before_free.prev = block.prev
            before_free.next = block
            if block.prev is not None:
                block.prev.next = before_free
            block.prev = before_free
            pool.insert(before_free)
        after = block.size - (before + unmapped)
        if after > 0:
            # block -> after_free -> next
            after_free = Block(unmapped_ptr + unmapped, after, block.stream, segment)
            after_free.prev = block
            after_free.next = block.next
            if block.next is not None:
                block.next.prev = after_free
            block.next = after_free
            pool.insert(after_free)
        block.ptr = unmapped_ptr
        block.size = unmapped
        block.mapped = False
        pool.merge_free_neighbours(block)
        pool.insert_unmapped(block)
        self._device.remove_reserved(pool, unmapped)
        if pool.owner is not None and pool.owner.segment_count > 0:
            # unmap_block: every unmap counts down the private pool's cudaMalloc_count
            # (PyTorch asserts it is > 0 first).
            pool.owner.segment_count -= 1
        self._stats.num_device_free += 1
        self._device.segment_log.append(("segment_unmap", unmapped_ptr, unmapped))

    def release_segment(self, block: Block, pool: BlockPool) -> None:
        """release_expandable_segment: free a fully unmapped reservation (no trace entry)."""
        pool.remove_unmapped(block)
        self.segments.remove(block.segment)

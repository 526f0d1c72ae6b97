"""Block pools: the ordered sets of free blocks (ref §3.3, CUDACachingAllocator.cpp ``BlockPool``).

PyTorch keeps a pool's free, mapped blocks in one ``std::set`` ordered by
``BlockComparatorSize``: ``(stream, size, address)`` up to early 2026, and
``(stream, size, registration_counter, address)`` in MAIN26 (§3.6). The simulator stores the
same order in a shape that makes the best-fit lookup cheap in Python:

* per stream, a plain ``list`` of the first free block of each distinct size, in size order,
  searched by size by :func:`first_fit`: compiled, a native binary search reading the blocks'
  ``size`` fields; interpreted, ``bisect``'s C loop over a list of those sizes kept beside the
  blocks (``sizes``, kept by the pure-Python build only: its searches over ints are 4x faster
  than over fields, and a compiled build would box every size into it, issue 41), and
* per (stream, size), the blocks of that size as a chain from that first (lowest tie) block,
  each linking to the next by ``block.same``. They are in ``block.tie`` order: the address, or
  ``counter << 64 | address`` for the 2026 order (addresses are < 2^64, so the integer orders
  exactly like the pair). The tie is an int field of the block, set when it enters the set (-1
  while it is not there): no entry objects, no list per size (most sizes hold one free block,
  and a list made and dropped per insert and removal was a tenth of a compiled replay, issue
  41), and a compiled build compares native integers.

Walking streams in order, sizes in order and each chain gives PyTorch's set order;
:meth:`BlockPool.ordered` does that for the rare paths (GC, release, Step 8).

Unmapped expandable ranges (``BlockPool::unmapped``, ``BlockComparatorAddress``:
``(stream, address)``) are few: a plain sorted list of ``(stream, address, block)`` (``(stream,
address)`` is unique, so the block is never compared).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterator
from types import FunctionType
from typing import TYPE_CHECKING, Final

from oomkit.core.allocator.block import Block

if TYPE_CHECKING:
    # Native 64-bit integers for mypyc (an annotation only: never imported at run time).
    from mypy_extensions import i64

    from oomkit.core.allocator.private_pools import PrivatePool

__all__ = ["BlockPool", "StreamFreeBlocks"]


class StreamFreeBlocks:
    """The free blocks of one stream in one pool."""

    __slots__ = ("heads", "sizes")

    def __init__(self) -> None:
        # The first block of each free size, in size order (each chain goes on by
        # ``block.same``): heads[i].size < heads[i + 1].size.
        self.heads: list[Block] = []
        # [head.size for head in heads], kept only when not NATIVE (first_fit).
        self.sizes: list[int] = []

    def iter_from(self, size: int) -> Iterator[Block]:
        """The blocks with ``block.size >= size`` in set order."""
        heads = self.heads
        for i in range(first_fit(self, size), len(heads)):
            block: Block | None = heads[i]
            while block is not None:
                yield block
                block = block.same

    def ordered(self) -> list[Block]:
        """All blocks in set order."""
        out: list[Block] = []
        for head in self.heads:
            block: Block | None = head
            while block is not None:
                out.append(block)
                block = block.same
        return out


def first_at_least(sizes: list[int], size: int) -> int:
    """``bisect_left(sizes, size)``: the index of the first of the sorted ``sizes`` that is at
    least ``size`` (where ``size`` is, or goes); seeding searches its held ranges' starts here.

    Compiled (:data:`NATIVE`), the binary search below runs on native integers: a call to
    ``bisect`` would box the size, call through the module's globals and compare boxed
    integers. Interpreted, the same loop in bytecode costs four times ``bisect``'s C loop, so
    the pure build calls that: one search, either way.
    """
    if not NATIVE:
        return bisect_left(sizes, size)
    # Native 64-bit indices: no tagged-integer checks on the bounds (issue 41).
    lo: i64 = 0
    hi: i64 = len(sizes)
    while lo < hi:
        mid = (lo + hi) >> 1
        if sizes[mid] < size:
            lo = mid + 1
        else:
            hi = mid
    return lo


def first_fit(sf: StreamFreeBlocks, size: int) -> int:
    """The index in ``sf.heads`` of the first block of at least ``size`` bytes (where a block
    of ``size`` is, or goes): :func:`first_at_least` over the heads' sizes.

    Every best-fit lookup, insert and removal searches a stream's free sizes here. Compiled,
    each step reads a block's native ``size`` field: no list of boxed sizes to unbox, insert
    into and delete from (issue 41: a tenth of a compiled verify's instructions).
    Interpreted, ``bisect`` on ``sf.sizes`` (a key function per step would cost more than
    keeping that list).
    """
    if not NATIVE:
        return bisect_left(sf.sizes, size)
    heads = sf.heads
    lo: i64 = 0
    hi: i64 = len(heads)
    while lo < hi:
        mid = (lo + hi) >> 1
        if heads[mid].size < size:
            lo = mid + 1
        else:
            hi = mid
    return lo


# Whether this module runs compiled (mypyc makes its functions built-in functions).
NATIVE: Final = type(first_at_least) is not FunctionType


class BlockPool:
    """The small or the large pool: a default one, or one half of a private pool (§3.5)."""

    __slots__ = (
        "is_small",
        "streams",
        "last_stream",
        "last_free",
        "unmapped",
        "gc_clock",
        "by_counter",
        "count",
        "owner",
    )

    def __init__(self, is_small: bool, by_counter: bool, owner: PrivatePool | None = None) -> None:
        self.is_small = is_small
        # BlockPool::owner_PrivatePool: None for the two default pools.
        self.owner = owner
        # stream -> its free blocks (the `blocks` set, split by its first key). A stream's
        # entry stays once made (empty when it has no free block).
        self.streams: dict[int, StreamFreeBlocks] = {}
        # The stream looked up last and its entry: most traces use one stream, and a dict
        # look-up per insert, removal and best fit was a twentieth of a compiled replay.
        self.last_stream = 0
        self.last_free = self.stream_free(0)
        self.unmapped: list[tuple[int, int, Block]] = []
        # BlockPool::get_free_blocks_call_count, the GC clock (§7).
        self.gc_clock = 0
        # MAIN26 BlockComparatorSize: registration counter before the address (§3.6).
        self.by_counter = by_counter
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def stream_free(self, stream: int) -> StreamFreeBlocks:
        """The free blocks of ``stream`` in this pool (an empty entry is made if it has none),
        remembered as ``last_stream`` / ``last_free``."""
        sf = self.streams.get(stream)
        if sf is None:
            sf = self.streams[stream] = StreamFreeBlocks()
        self.last_stream = stream
        self.last_free = sf
        return sf

    def clear(self) -> None:
        """Forget every free block and unmapped range (the allocator's close)."""
        self.streams.clear()
        self.unmapped.clear()
        self.count = 0
        self.last_free = self.stream_free(self.last_stream)

    def tie(self, block: Block) -> int:
        """The block's position among free blocks of equal stream and size (§3.6)."""
        if self.by_counter:
            return (block.segment.counter << 64) | block.ptr
        return block.ptr

    def insert(self, block: Block) -> None:
        """BlockPool::insert_into_blocks: add a free block and reset its GC base (§7)."""
        block.gc_count_base = self.gc_clock
        tie = (block.segment.counter << 64) | block.ptr if self.by_counter else block.ptr
        block.tie = tie
        stream = block.stream
        sf = self.last_free if stream == self.last_stream else self.stream_free(stream)
        size = block.size
        heads = sf.heads
        i = first_fit(sf, size)
        if i < len(heads) and heads[i].size == size:
            head = heads[i]
            if tie < head.tie:
                # Most blocks freed into a chain go to its front (its lowest tie).
                block.same = head
                heads[i] = block
            else:
                prev = head
                after = prev.same
                while after is not None and after.tie < tie:
                    prev = after
                    after = prev.same
                block.same = after
                prev.same = block
        else:
            heads.insert(i, block)
            if not NATIVE:
                sf.sizes.insert(i, size)
        self.count += 1

    def merge_free_neighbours(self, block: Block) -> int:
        """try_merge_blocks (CUDACachingAllocator.cpp) with the previous, then the next block;
        returns how many merged.

        A neighbour merges when it is free (not allocated, no pending events or stream uses)
        and has the same mapped state; it leaves this pool's sets and ``block`` grows over it.
        (One loop, not a call per neighbour: free_block runs this on every free, issue 41; a
        ``while`` over the two sides rather than a ``for`` over a tuple of them, which a compiled
        build would make and iterate generically on every free.)
        """
        merged = 0
        before = True  # src is the block before ``block``, then the one after it
        src = block.prev
        while True:
            if (
                src is not None
                and not src.allocated
                and not src.event_count
                and not src.stream_uses
                and src.mapped == block.mapped
            ):
                if src.mapped:
                    self.remove(src)
                else:
                    self.remove_unmapped(src)
                if before:
                    block.ptr = src.ptr
                    prev = block.prev = src.prev
                    if prev is not None:
                        prev.next = block
                else:
                    after = block.next = src.next
                    if after is not None:
                        after.prev = block
                block.size += src.size
                merged += 1
            if not before:
                return merged
            before = False
            src = block.next

    def remove(self, block: Block, index: int = -1) -> None:
        """Take a free block out of the set (its size must be the one it was inserted with).

        ``index``: the block's size index in its stream's ``heads`` when the caller has just
        found it there (the best fit), else -1.
        """
        assert block.tie >= 0, "removing a block that is not in the free set"
        stream = block.stream
        sf = self.last_free if stream == self.last_stream else self.stream_free(stream)
        heads = sf.heads
        i = index if index >= 0 else first_fit(sf, block.size)
        head = heads[i]
        if head is block:
            # The best fit is a chain's first block.
            after = block.same
            if after is None:
                # pop(i), not del: compiled, a native call with the native index (del boxes
                # the index and goes through the generic item deletion, issue 41).
                heads.pop(i)
                if not NATIVE:
                    sf.sizes.pop(i)
            else:
                heads[i] = after
        else:
            prev = head
            after = prev.same
            while after is not block:
                assert after is not None, "removing a block that is not in the free set"
                prev = after
                after = prev.same
            prev.same = block.same
        block.same = None
        block.tie = -1
        self.count -= 1

    def ordered(self) -> list[Block]:
        """Every free block in PyTorch's set order (stream, size, tie-break)."""
        out: list[Block] = []
        for stream in sorted(self.streams):
            out.extend(self.streams[stream].ordered())
        return out

    def stream_ordered(self, stream: int) -> list[Block]:
        """The free blocks of one stream in set order."""
        sf = self.streams.get(stream)
        return sf.ordered() if sf is not None else []

    def insert_unmapped(self, block: Block) -> None:
        """Add an unmapped expandable range (BlockComparatorAddress order)."""
        key = (block.stream, block.ptr, block)
        block.key = key
        insort(self.unmapped, key)

    def remove_unmapped(self, block: Block) -> None:
        """Take an unmapped range out of ``unmapped``."""
        key = block.key
        assert key is not None, "removing a block that is not in the unmapped set"
        unmapped = self.unmapped
        i = bisect_left(unmapped, key)
        assert i < len(unmapped) and unmapped[i][2] is block, "not an unmapped range of this pool"
        del unmapped[i]
        block.key = None

    def unmapped_blocks(self) -> Iterator[Block]:
        """The unmapped ranges in (stream, address) order."""
        for entry in self.unmapped:
            yield entry[-1]

"""BlockPool: the free-block set order and merge_free_neighbours (ref §3.3, §5.2)."""

from __future__ import annotations

from bisect import bisect_left

from hypothesis import given
from hypothesis import strategies as st

from oomkit.core.allocator.block import Block, Segment
from oomkit.core.allocator.pools import BlockPool, first_at_least, first_fit

MiB = 2**20


def _segment(pool: BlockPool, address: int, size: int, counter: int = 0) -> Segment:
    return Segment(address, size, 0, pool.is_small, counter, pool=pool)


def _chain(segment: Segment, sizes: list[int]) -> list[Block]:
    blocks = []
    ptr = segment.address
    for size in sizes:
        blocks.append(Block(ptr, size, segment.stream, segment))
        ptr += size
    for left, right in zip(blocks, blocks[1:], strict=False):
        left.next = right
        right.prev = left
    return blocks


def test_insert_orders_by_size_then_address_and_resets_gc_base():
    """insert_into_blocks: (stream, size, address) order; the block takes the pool's GC clock."""
    pool = BlockPool(False, by_counter=False)
    pool.gc_clock = 7
    a = Block(0x3000, 4 * MiB, 0, _segment(pool, 0x3000, 4 * MiB))
    b = Block(0x1000, 4 * MiB, 0, _segment(pool, 0x1000, 4 * MiB))
    c = Block(0x2000, 2 * MiB, 0, _segment(pool, 0x2000, 2 * MiB))
    d = Block(0x0500, 2 * MiB, 1, _segment(pool, 0x0500, 2 * MiB))
    for block in (a, b, c, d):
        pool.insert(block)
    assert pool.ordered() == [c, b, a, d]
    assert len(pool) == 4
    assert {blk.gc_count_base for blk in (a, b, c, d)} == {7}
    pool.remove(b)
    assert pool.ordered() == [c, a, d]
    assert b.tie == -1  # out of the set
    assert a.tie == 0x3000 and c.tie == 0x2000
    assert len(pool) == 3


def test_by_counter_orders_equal_sizes_by_creation():
    """MAIN26 BlockComparatorSize: registration counter before the address (§3.6)."""
    pool = BlockPool(False, by_counter=True)
    old_high = Block(0x9000, MiB, 0, _segment(pool, 0x9000, MiB, counter=0))
    new_low = Block(0x1000, MiB, 0, _segment(pool, 0x1000, MiB, counter=1))
    pool.insert(new_low)
    pool.insert(old_high)
    assert pool.ordered() == [old_high, new_low]


def test_merge_free_neighbours_absorbs_both_sides():
    """try_merge_blocks with prev then next: one block spans all three, both leave the set."""
    pool = BlockPool(False, by_counter=False)
    left, mid, right, tail = _chain(
        _segment(pool, 0x100000, 10 * MiB), [MiB, 2 * MiB, 3 * MiB, 4 * MiB]
    )
    tail.allocated = True
    pool.insert(left)
    pool.insert(right)
    assert pool.merge_free_neighbours(mid) == 2
    assert (mid.ptr, mid.size) == (0x100000, 6 * MiB)
    assert mid.prev is None
    assert mid.next is tail
    assert tail.prev is mid
    assert len(pool) == 0


def test_merge_free_neighbours_skips_busy_and_unmapped_neighbours():
    """Allocated, event-pending, stream-used or differently mapped neighbours stay apart."""
    pool = BlockPool(False, by_counter=False)
    for busy in ("allocated", "event_count", "stream_uses", "mapped"):
        left, mid = _chain(_segment(pool, 0x100000, 3 * MiB), [MiB, 2 * MiB])
        if busy == "allocated":
            left.allocated = True
        elif busy == "event_count":
            left.event_count = 1
        elif busy == "stream_uses":
            left.stream_uses = {2}
        else:
            left.mapped = False
        assert pool.merge_free_neighbours(mid) == 0, busy
        assert (mid.ptr, mid.size, mid.prev) == (0x100000 + MiB, 2 * MiB, left)


def test_merge_free_neighbours_joins_unmapped_ranges():
    """Two unmapped neighbours merge; the absorbed one leaves ``unmapped``."""
    pool = BlockPool(False, by_counter=False)
    left, mid = _chain(_segment(pool, 0x100000, 40 * MiB), [20 * MiB, 20 * MiB])
    left.mapped = mid.mapped = False
    pool.insert_unmapped(left)
    assert pool.merge_free_neighbours(mid) == 1
    assert (mid.ptr, mid.size) == (0x100000, 40 * MiB)
    assert list(pool.unmapped_blocks()) == []


@given(
    st.lists(st.integers(min_value=1, max_value=2**47), max_size=40, unique=True),
    st.integers(min_value=0, max_value=2**47 + 1),
)
def test_first_at_least_is_bisect_left(sizes: list[int], size: int) -> None:
    """first_at_least (a native binary search when compiled) answers as bisect_left does."""
    sizes.sort()
    assert first_at_least(sizes, size) == bisect_left(sizes, size)
    for i, present in enumerate(sizes):
        assert first_at_least(sizes, present) == i


def test_first_at_least_at_the_ends():
    """Before the first size, past the last, and in an empty list."""
    assert first_at_least([], 512) == 0
    assert first_at_least([1024, 4096], 512) == 0
    assert first_at_least([1024, 4096], 2048) == 1
    assert first_at_least([1024, 4096], 8192) == 2


@given(
    st.lists(st.integers(min_value=1, max_value=2**40).map(lambda n: n * 512), max_size=40),
    st.integers(min_value=0, max_value=2**49 + 1),
)
def test_first_fit_is_bisect_left_over_the_free_sizes(sizes: list[int], size: int) -> None:
    """Inserting free blocks of ``sizes`` leaves one chain head per size, in size order, and
    first_fit (the blocks' fields read natively when compiled, bisect on the pure build's
    list of sizes) finds where ``size`` is or goes, as bisect_left over the distinct sizes."""
    pool = BlockPool(False, False)
    address = 0x7F0000000000
    for block_size in sizes:
        pool.insert(Block(address, block_size, 0, _segment(pool, address, block_size)))
        address += block_size
    sf = pool.stream_free(0)
    distinct = sorted(set(sizes))
    assert [head.size for head in sf.heads] == distinct
    assert first_fit(sf, size) == bisect_left(distinct, size)
    for i, present in enumerate(distinct):
        assert first_fit(sf, present) == i
    for block in list(pool.ordered()):
        pool.remove(block)
    assert sf.heads == [] and sf.sizes == [] and len(pool) == 0

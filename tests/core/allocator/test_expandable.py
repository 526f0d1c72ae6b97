"""Expandable segments (ref §8): page mapping, growth, unmapping and their stats."""

from __future__ import annotations

import pytest

from oomkit.core.allocator import AllocatorConfig, CachingAllocator, SimulatedOutOfMemoryError
from oomkit.core.allocator.expandable import expandable_reserve_size

MiB = 2**20
GiB = 2**30
EXP = AllocatorConfig(expandable_segments=True)


def test_reserve_size_is_nine_eighths_of_capacity_in_pages():
    """§1: ceil((T + T/8) / page) pages."""
    assert expandable_reserve_size(80 * GiB, 20 * MiB) == 4608 * 20 * MiB
    assert expandable_reserve_size(100 * MiB, 20 * MiB) == 6 * 20 * MiB


def test_growth_example_from_the_ref():
    """§8.3 example: 5 MiB maps one 20 MiB page; 30 MiB grows the free tail by one page."""
    a = CachingAllocator(EXP)
    p = a.malloc(5 * MiB)
    base = p
    s = a.memory_stats()
    assert s["reserved_bytes.all.current"] == 20 * MiB
    assert s["segment.all.current"] == 0
    assert s["num_device_alloc"] == 1
    assert a.segment_log == [("segment_map", base, 20 * MiB)]
    q = a.malloc(30 * MiB)
    assert q == base + 5 * MiB
    assert a.segment_log[1] == ("segment_map", base + 20 * MiB, 20 * MiB)
    s = a.memory_stats()
    assert s["reserved_bytes.all.current"] == 40 * MiB
    assert s["allocated_bytes.all.current"] == 35 * MiB
    assert s["inactive_split.all.current"] == 0
    (seg,) = a.snapshot()
    assert seg["is_expandable"] and seg["total_size"] == 40 * MiB
    assert [b["size"] for b in seg["blocks"]] == [5 * MiB, 30 * MiB, 5 * MiB]


def test_expandable_split_ignores_max_split():
    """§4 step 11: with expandable on, any leftover >= 512 is split, whatever max_split."""
    a = CachingAllocator(AllocatorConfig(expandable_segments=True, max_split_size_bytes=40 * MiB))
    a.malloc(50 * MiB)
    (seg,) = a.snapshot()
    assert [b["size"] for b in seg["blocks"]] == [50 * MiB, 10 * MiB]


def test_small_pool_pages_are_2mib():
    """§8.1: small-pool expandable pages are 2 MiB."""
    a = CachingAllocator(EXP)
    a.malloc(1000)
    assert a.segment_log[0][2] == 2 * MiB
    assert a.memory_stats()["reserved_bytes.small_pool.current"] == 2 * MiB


def test_empty_cache_unmaps_whole_free_pages():
    """§8.4: only pages entirely inside a free block are unmapped; edges stay mapped."""
    a = CachingAllocator(EXP)
    p1 = a.malloc(30 * MiB)  # maps 2 pages: [0, 40)
    p2 = a.malloc(5 * MiB)  # [30, 35)
    a.free(p1)
    a.empty_cache()
    # Free [0, 30): page 0 is whole -> unmapped; [20, 30) stays mapped. Free tail [35, 40)
    # covers no whole page.
    assert a.segment_log[-1] == ("segment_unmap", p1, 20 * MiB)
    s = a.memory_stats()
    assert s["reserved_bytes.all.current"] == 20 * MiB
    assert s["num_device_free"] == 1
    (seg,) = a.snapshot()
    assert seg["address"] == p1 + 20 * MiB
    assert [b["size"] for b in seg["blocks"]] == [10 * MiB, 5 * MiB, 5 * MiB]
    a.free(p2)
    a.empty_cache()
    assert a.segment_log[-1] == ("segment_unmap", p1 + 20 * MiB, 20 * MiB)
    assert a.memory_stats()["reserved_bytes.all.current"] == 0
    assert a.snapshot() == []


def test_lowest_hole_is_filled_first():
    """§8.3 step 1: a hole left by an unmap is refilled before the tail grows."""
    a = CachingAllocator(EXP)
    p1 = a.malloc(20 * MiB)
    a.malloc(20 * MiB)
    a.free(p1)
    a.empty_cache()
    assert a.malloc(20 * MiB) == p1
    assert a.segment_log[-1] == ("segment_map", p1, 20 * MiB)


def test_best_fit_prefers_interior_block_over_growable_tail():
    """§4 step 3.3: a slightly larger interior block beats the tail that could grow."""
    a = CachingAllocator(EXP)
    p1 = a.malloc(8 * MiB)
    a.malloc(2 * MiB)  # [8, 10)
    # Tail free block [10, 20): 10 MiB plus the unmapped rest of the reservation.
    a.free(p1)  # interior free block [0, 8)
    q = a.malloc(7 * MiB)
    assert q == p1


def test_oom_with_expandable_keeps_mapped_pages():
    """§8.3: pages mapped before a failing page stay mapped; OOM when nothing fits."""
    a = CachingAllocator(EXP, capacity_bytes=100 * MiB)
    a.malloc(50 * MiB)  # 3 pages
    with pytest.raises(SimulatedOutOfMemoryError, match="Tried to allocate 60.00 MiB"):
        a.malloc(60 * MiB)
    s = a.memory_stats()
    # Growing the free 10 MiB tail needs 3 more pages; the third cannot be created, so the
    # map call releases the two it made and nothing new stays mapped.
    assert s["reserved_bytes.all.current"] == 60 * MiB
    assert s["num_ooms"] == 1


def test_turning_expandable_off_skips_expandable_blocks():
    """§8.5: with the option off, free expandable blocks are not reused."""
    a = CachingAllocator(EXP)
    p = a.malloc(5 * MiB)
    a.free(p)
    a.set_allocator_settings("expandable_segments:False")
    q = a.malloc(5 * MiB)
    assert q != p
    assert a.segment_log[-1] == ("segment_alloc", q, 20 * MiB)


def test_seed_expandable_range():
    """seed_segment(expandable=True): the mapped run joins its (stream, pool) reservation."""
    a = CachingAllocator(EXP)
    base = 0x7000_0000_0000
    a.seed_segment(
        base,
        40 * MiB,
        0,
        is_small=False,
        blocks=[(base, 25 * MiB, 25 * MiB, True), (base + 25 * MiB, 15 * MiB, 0, False)],
        expandable=True,
    )
    s = a.memory_stats()
    assert s["reserved_bytes.all.current"] == 40 * MiB
    assert s["segment.all.current"] == 0
    p = a.malloc(20 * MiB)  # tail 15 MiB + one new page
    assert p == base + 25 * MiB
    assert a.segment_log == [("segment_map", base + 40 * MiB, 20 * MiB)]


def test_an_exabyte_device_maps_pages_without_a_table_of_its_size():
    """The page flags grow as pages map: a 2**60-byte device's reservation costs no 2**39 table."""
    a = CachingAllocator(EXP, capacity_bytes=2**60)
    p = a.malloc(5 * MiB)
    q = a.malloc(30 * MiB)
    (seg,) = a.snapshot()
    assert seg["is_expandable"] and seg["total_size"] == 40 * MiB
    assert q == p + 5 * MiB
    a.free(q)
    a.free(p)
    a.empty_cache()
    assert a.memory_stats()["reserved_bytes.all.current"] == 0
    a.malloc(45 * MiB)
    assert a.memory_stats()["reserved_bytes.all.current"] == 60 * MiB

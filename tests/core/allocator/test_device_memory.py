"""DeviceMemory: the simulated cudaMalloc / cudaFree side of the allocator (ref §4 step 6, §4.1)."""

from __future__ import annotations

import pytest

from oomkit.core.allocator import AllocatorConfig
from oomkit.core.allocator.device_memory import SYNTHETIC_ADDRESS_BASE, DeviceMemory, check_capacity
from oomkit.core.allocator.pools import BlockPool
from oomkit.core.allocator.settings import AllocatorSettings
from oomkit.core.allocator.stats import (
    ALL,
    LARGE_POOL,
    OVERSIZE_SEGMENTS,
    PEAK,
    RESERVED_BYTES,
    SEGMENT,
    AllocatorStats,
)
from oomkit.core.allocator.versions import behaviour_for
from oomkit.errors import AllocatorUsageError

MiB = 2**20


def _device(capacity_bytes: int, outside: int = 0, config: str = "", **hooks):
    stats = AllocatorStats()
    settings = AllocatorSettings(AllocatorConfig.parse(config), behaviour_for(None), capacity_bytes)
    device_malloc = hooks.get("device_malloc")
    segment_address = hooks.get("segment_address")
    memory = DeviceMemory(capacity_bytes, outside, stats, settings, device_malloc, segment_address)
    return memory, stats


def test_fits_counts_reserved_pending_and_outside_bytes():
    """cudaMalloc succeeds iff reserved + pending pages + outside + N <= capacity."""
    memory, _ = _device(100 * MiB, outside=10 * MiB)
    memory.total_bytes = 60 * MiB
    memory.pending_map_bytes = 20 * MiB
    assert memory.fits(10 * MiB)
    assert not memory.fits(10 * MiB + 1)
    assert memory.free_bytes == 30 * MiB


def test_synthetic_addresses_are_2mib_aligned_and_never_reused():
    """Each segment starts 2 MiB aligned after the previous one."""
    memory, _ = _device(100 * MiB)
    assert memory.synthetic_address(MiB + 1, False) == SYNTHETIC_ADDRESS_BASE
    assert memory.synthetic_address(512, True) == SYNTHETIC_ADDRESS_BASE + 2 * MiB
    assert memory.synthetic_address(1, False) == SYNTHETIC_ADDRESS_BASE + 4 * MiB
    assert [memory.new_counter(), memory.new_counter()] == [0, 1]


def test_malloc_segment_and_release_block_account_everything():
    """cudaMalloc adds a segment, reserved bytes and a log entry; cudaFree takes them back."""
    memory, stats = _device(100 * MiB, config="max_split_size_mb:40")
    pool = BlockPool(False, by_counter=True)
    block = memory.malloc_segment(pool, 40 * MiB, 0)
    assert block is not None
    assert (block.ptr, block.size, block.segment.pool) == (SYNTHETIC_ADDRESS_BASE, 40 * MiB, pool)
    assert memory.total_bytes == 40 * MiB
    assert memory.segments == {SYNTHETIC_ADDRESS_BASE: block.segment}
    large = stats.lists[LARGE_POOL]
    assert (large[SEGMENT], large[RESERVED_BYTES]) == (1, 40 * MiB)
    # 40 MiB >= max_split_size: an oversize segment.
    assert stats.lists[ALL][OVERSIZE_SEGMENTS] == 1
    assert stats.num_device_alloc == 1
    pool.insert(block)
    memory.release_block(block, pool)
    assert memory.total_bytes == 0
    assert memory.segments == {}
    assert len(pool) == 0
    assert (large[SEGMENT], large[RESERVED_BYTES], large[RESERVED_BYTES + PEAK]) == (0, 0, 40 * MiB)
    assert stats.lists[ALL][OVERSIZE_SEGMENTS] == 0
    assert stats.num_device_free == 1
    assert memory.segment_log == [
        ("segment_alloc", SYNTHETIC_ADDRESS_BASE, 40 * MiB),
        ("segment_free", SYNTHETIC_ADDRESS_BASE, 40 * MiB),
    ]


def test_malloc_segment_uses_the_hooks():
    """A refusing device_malloc gives None; segment_address places the segment."""
    asked: list[int] = []
    memory, stats = _device(
        100 * MiB,
        device_malloc=lambda n: asked.append(n) or n <= 20 * MiB,
        segment_address=lambda size, expandable: 0x5000_0000,
    )
    pool = BlockPool(False, by_counter=False)
    assert memory.malloc_segment(pool, 40 * MiB, 0) is None
    block = memory.malloc_segment(pool, 20 * MiB, 3)
    assert block is not None
    assert (block.ptr, block.stream) == (0x5000_0000, 3)
    assert asked == [40 * MiB, 20 * MiB]
    assert stats.num_device_alloc == 1


@pytest.mark.parametrize(
    ("capacity", "outside", "match"),
    [
        (-1, 0, "capacity_bytes must be"),
        (1.5, 0, "capacity_bytes must be"),
        (10, -2, "reserved_outside"),
    ],
)
def test_check_capacity_rejects_bad_sizes(capacity, outside, match):
    """Negative or non-integer device sizes are usage errors that say what to pass."""
    with pytest.raises(AllocatorUsageError, match=match):
        check_capacity(capacity, outside)

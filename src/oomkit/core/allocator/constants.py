"""Every constant of PyTorch's native CUDA caching allocator that the simulator models.

Values and names follow ``c10/cuda/CUDACachingAllocator.cpp`` (V24 and MAIN26, where the newest
copies moved them to ``c10/core/AllocatorConfig.h``); see ref/cuda-caching-allocator.md §1.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "MIN_BLOCK_SIZE",
    "MIN_BLOCK_ROUND_UP",
    "MIN_BLOCK_MASK",
    "SMALL_SIZE",
    "SMALL_BUFFER",
    "LARGE_BUFFER",
    "MIN_LARGE_ALLOC",
    "ROUND_LARGE",
    "ONE_EXA_BYTES",
    "UNLIMITED_CAPACITY_BYTES",
    "SIZE_MAX",
    "ROUNDUP_POWER2_INTERVALS",
    "EXPANDABLE_RESERVE_NUMERATOR",
    "EXPANDABLE_RESERVE_DENOMINATOR",
]

# CUDACachingAllocator.cpp kMinBlockSize: every size is rounded up to a multiple of 512 bytes.
MIN_BLOCK_SIZE: Final = 512
# round_size's last step, (size + kMinBlockSize - 1) & ~(kMinBlockSize - 1), its two constants
# folded: malloc inlines that step for every request (caching_allocator.py, rounding.py).
MIN_BLOCK_ROUND_UP: Final = MIN_BLOCK_SIZE - 1
MIN_BLOCK_MASK: Final = ~(MIN_BLOCK_SIZE - 1)
# CUDACachingAllocator.cpp kSmallSize: a rounded size <= 1 MiB goes to the small pool.
SMALL_SIZE: Final = 1 << 20
# CUDACachingAllocator.cpp kSmallBuffer: small-pool segments (and small expandable pages) are 2 MiB.
SMALL_BUFFER: Final = 2 << 20
# CUDACachingAllocator.cpp kLargeBuffer: segment for 1-10 MiB requests, large expandable page,
# and (before PR #136174) the fixed oversize slack of get_free_block.
LARGE_BUFFER: Final = 20 << 20
# CUDACachingAllocator.cpp kMinLargeAlloc: large requests < 10 MiB get a kLargeBuffer segment.
MIN_LARGE_ALLOC: Final = 10 << 20
# CUDACachingAllocator.cpp kRoundLarge: segments for requests >= 10 MiB are 2 MiB multiples.
ROUND_LARGE: Final = 2 << 20
# NativeCachingAllocator::malloc one_exa_bytes: requests at or above 1 EB fail before the cache.
ONE_EXA_BYTES: Final = 1 << 60
# oomkit's, not PyTorch's: a device capacity that no replay runs out of, for what a step needs
# on a device without limit (requests of ONE_EXA_BYTES or more still fail, as in malloc).
UNLIMITED_CAPACITY_BYTES: Final = ONE_EXA_BYTES - (1 << 40)
# std::numeric_limits<size_t>::max(): "unlimited" max_split_size; memory_stats shows it as -1.
SIZE_MAX: Final = (1 << 64) - 1
# CUDAAllocatorConfig kRoundUpPowerOfTwoIntervals: slots from 1 MiB to 64 GiB (§2.2).
ROUNDUP_POWER2_INTERVALS: Final = 16
# ExpandableSegment ctor: the VA reservation covers totalGlobalMem + totalGlobalMem / 8.
EXPANDABLE_RESERVE_NUMERATOR: Final = 9
EXPANDABLE_RESERVE_DENOMINATOR: Final = 8

"""Size rounding, pool choice and segment size (ref §2).

These are the pure functions behind ``DeviceCachingAllocator::round_size``,
``roundup_power2_next_division``, ``get_pool`` and ``get_allocation_size``.
"""

from __future__ import annotations

from collections.abc import Sequence

from oomkit.core.allocator.constants import (
    LARGE_BUFFER,
    MIN_BLOCK_MASK,
    MIN_BLOCK_ROUND_UP,
    MIN_BLOCK_SIZE,
    MIN_LARGE_ALLOC,
    ROUND_LARGE,
    ROUNDUP_POWER2_INTERVALS,
    SMALL_BUFFER,
    SMALL_SIZE,
)

__all__ = [
    "divisions_slot",
    "roundup_power2_next_division",
    "round_size",
    "is_small_size",
    "allocation_size",
]


def divisions_slot(size_bytes: int) -> int:
    """Index of the ``roundup_power2_divisions`` slot that applies to a size (§2.2).

    CUDAAllocatorConfig::roundup_power2_divisions: ``log2(size) - log2(1 MiB)``, clamped to
    ``[0, 15]``; slot k covers ``[2^k MiB, 2^(k+1) MiB)``.
    """
    idx = size_bytes.bit_length() - 1 - 20
    if idx < 0:
        return 0
    if idx >= ROUNDUP_POWER2_INTERVALS:
        return ROUNDUP_POWER2_INTERVALS - 1
    return idx


def roundup_power2_next_division(size_bytes: int, divisions: int) -> int:
    """Round up to the next of ``divisions`` equal steps between two powers of two (§2.1).

    CUDACachingAllocator.cpp roundup_power2_next_division: exact powers of two stay; otherwise
    the step is ``floor_pow2(size) >> floor(log2(divisions))``.
    """
    if size_bytes & (size_bytes - 1) == 0:
        return size_bytes
    power2_floor = 1 << (size_bytes.bit_length() - 1)
    step = power2_floor >> (divisions.bit_length() - 1)
    if step == 0:
        return power2_floor << 1
    low = size_bytes & ~(step - 1)
    return size_bytes if low == size_bytes else low + step


def round_size(size_bytes: int, divisions: Sequence[int] | None = None) -> int:
    """The rounded block size for a request (§2.1, CUDACachingAllocator.cpp round_size).

    Args:
        size_bytes: the user's request, > 0.
        divisions: the 16 ``roundup_power2_divisions`` slots; ``None`` means all 0 (off).

    Returns:
        The rounded size in bytes, a multiple of 512.
    """
    if size_bytes < MIN_BLOCK_SIZE:
        return MIN_BLOCK_SIZE
    if divisions is not None:
        d = divisions[divisions_slot(size_bytes)]
        # round_size: power-of-two rounding only when divisions > 1 and size > 512 * divisions.
        if d > 1 and size_bytes > MIN_BLOCK_SIZE * d:
            return roundup_power2_next_division(size_bytes, d)
    return (size_bytes + MIN_BLOCK_ROUND_UP) & MIN_BLOCK_MASK


def is_small_size(rounded_bytes: int) -> bool:
    """get_pool: a rounded size of at most kSmallSize (1 MiB, inclusive) is a small-pool size."""
    return rounded_bytes <= SMALL_SIZE


def allocation_size(rounded_bytes: int, large_segment_size_bytes: int = LARGE_BUFFER) -> int:
    """The size of a new segment for a rounded request (§2.4, get_allocation_size).

    Args:
        rounded_bytes: the output of :func:`round_size`.
        large_segment_size_bytes: kLargeBuffer, or ``large_segment_size_mb`` where configurable.

    Returns:
        2 MiB for small sizes, the large segment size below 10 MiB, else a 2 MiB multiple.
    """
    if rounded_bytes <= SMALL_SIZE:
        return SMALL_BUFFER
    if rounded_bytes < MIN_LARGE_ALLOC:
        return large_segment_size_bytes
    return (rounded_bytes + ROUND_LARGE - 1) // ROUND_LARGE * ROUND_LARGE

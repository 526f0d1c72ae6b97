"""The sizes and limits PyTorch's allocator-config parsers check, shared by the record and parsers."""

from __future__ import annotations

from oomkit.core.allocator.constants import (
    LARGE_BUFFER,
    MIN_LARGE_ALLOC,
    ROUNDUP_POWER2_INTERVALS,
    SIZE_MAX,
)

__all__ = [
    "DEFAULT_DIVISIONS",
    "LARGE_BUFFER_MB",
    "LAST_SLOT",
    "MAX_MB",
    "MIB",
    "MIN_LARGE_SEGMENT_MB",
    "PINNED_MAX_REGISTER_THREADS",
    "is_mib_multiple",
    "is_pow2",
]

# kMB: the unit of every *_mb setting.
MIB = 1 << 20
# kLargeBuffer / kMB: the fixed large segment size, and the max_split minimum before MAIN26.
LARGE_BUFFER_MB = LARGE_BUFFER // MIB
# CFG-main parseLargeSegmentSize: large_segment_size_mb must be > kMinLargeAlloc / kMB (10).
MIN_LARGE_SEGMENT_MB = MIN_LARGE_ALLOC // MIB
# parseMaxSplitSize and friends: values are capped at SIZE_MAX / kMB before scaling.
MAX_MB = SIZE_MAX // MIB
# CUDAAllocatorConfig::pinned_max_register_threads(): 128.
PINNED_MAX_REGISTER_THREADS = 128
# roundup_power2_divisions' default: every slot 0 (no power-of-two rounding, §2.2).
DEFAULT_DIVISIONS = (0,) * ROUNDUP_POWER2_INTERVALS
# The last slot also holds every size above 2^15 MiB (§2.2).
LAST_SLOT = ROUNDUP_POWER2_INTERVALS - 1


def is_pow2(value: int) -> bool:
    """The parsers' power-of-two check: positive with exactly one bit set."""
    return value > 0 and value & (value - 1) == 0


def is_mib_multiple(value: object) -> bool:
    """Whether ``value`` is a non-negative ``int`` number of bytes that a ``*_mb`` setting writes."""
    return type(value) is int and value >= 0 and value % MIB == 0

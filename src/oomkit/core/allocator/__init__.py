"""The simulated PyTorch CUDA caching allocator (``backend:native``).

``CachingAllocator`` makes the same decisions as ``c10/cuda/CUDACachingAllocator.cpp``:
rounding, pools, best fit per stream, splitting and merging, the release paths, GC,
expandable segments, private pools (CUDA graphs, MemPool), the stats of
``torch.cuda.memory_stats()`` and the OOM message.
See ../shared/ref/cuda-caching-allocator.md for the rules.
"""

from __future__ import annotations

from oomkit.core.allocator.caching_allocator import DEFAULT_CAPACITY_BYTES, CachingAllocator
from oomkit.core.allocator.config import AllocatorConfig
from oomkit.core.allocator.oom_message import SimulatedOutOfMemoryError, format_size
from oomkit.core.allocator.private_pools import MempoolId
from oomkit.core.allocator.rounding import allocation_size, round_size
from oomkit.core.allocator.stats import STAT_KEYS

__all__ = [
    "AllocatorConfig",
    "CachingAllocator",
    "DEFAULT_CAPACITY_BYTES",
    "MempoolId",
    "SimulatedOutOfMemoryError",
    "STAT_KEYS",
    "allocation_size",
    "format_size",
    "round_size",
]

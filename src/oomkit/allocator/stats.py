"""The statistics of ``torch.cuda.memory_stats()`` (ref §10, c10/core/CachingDeviceAllocator.h).

Each ``Stat`` has ``current``, ``peak``, ``allocated`` (sum of increases) and ``freed`` (sum of
decreases). The simulator keeps one flat ``list[int]`` per stat type (``all``, ``small_pool``,
``large_pool``) so the hot path updates plain list slots. ``allocated`` is not stored but
derived as ``current - origin + freed``, where ``origin`` is ``current`` at the last
``reset_accumulated_memory_stats``. Increases move the peak at once (``increase_stat``), as
PyTorch does, so peaks match exactly. The two oversize stats are single ``Stat``s and live in
the ``all`` list only.
"""

from __future__ import annotations

__all__ = [
    "ARRAY_STATS",
    "STAT_TYPES",
    "COUNTERS",
    "STAT_KEYS",
    "CUR",
    "PEAK",
    "FREED",
    "ORIGIN",
    "ALLOCATION",
    "SEGMENT",
    "ACTIVE",
    "INACTIVE_SPLIT",
    "ALLOCATED_BYTES",
    "RESERVED_BYTES",
    "ACTIVE_BYTES",
    "INACTIVE_SPLIT_BYTES",
    "REQUESTED_BYTES",
    "OVERSIZE_ALLOCATIONS",
    "OVERSIZE_SEGMENTS",
    "TYPE_SLOTS",
    "ALL",
    "SMALL_POOL",
    "LARGE_POOL",
    "new_stat_lists",
    "build_memory_stats",
    "reset_peaks",
    "reset_accumulated",
]

# DeviceStats array members, in the order THCPModule_memoryStats emits them.
ARRAY_STATS = (
    "allocation",
    "segment",
    "active",
    "inactive_split",
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "requested_bytes",
)
# StatType: AGGREGATE, SMALL_POOL, LARGE_POOL.
STAT_TYPES = ("all", "small_pool", "large_pool")
ALL, SMALL_POOL, LARGE_POOL = 0, 1, 2
# DeviceStats scalar counters.
COUNTERS = (
    "num_alloc_retries",
    "num_ooms",
    "num_sync_all_streams",
    "num_device_alloc",
    "num_device_free",
)

# Offsets inside one Stat's four slots.
CUR, PEAK, FREED, ORIGIN = 0, 1, 2, 3

# First slot of each stat inside a stat-type list.
ALLOCATION = 0
SEGMENT = 4
ACTIVE = 8
INACTIVE_SPLIT = 12
ALLOCATED_BYTES = 16
RESERVED_BYTES = 20
ACTIVE_BYTES = 24
INACTIVE_SPLIT_BYTES = 28
REQUESTED_BYTES = 32
OVERSIZE_ALLOCATIONS = 36  # "all" list only
OVERSIZE_SEGMENTS = 40  # "all" list only
TYPE_SLOTS = 44

_STAT_FIELDS = ("current", "peak", "allocated", "freed")


def _stat_keys() -> tuple[str, ...]:
    keys: list[str] = list(COUNTERS) + ["max_split_size"]
    for name in ARRAY_STATS:
        for t in STAT_TYPES:
            keys.extend(f"{name}.{t}.{f}" for f in _STAT_FIELDS)
    for name in ("oversize_allocations", "oversize_segments"):
        keys.extend(f"{name}.{f}" for f in _STAT_FIELDS)
    return tuple(sorted(keys))


# Every key of torch.cuda.memory_stats(), sorted as torch/cuda/memory.py returns them.
STAT_KEYS = _stat_keys()


def new_stat_lists() -> list[list[int]]:
    """Zeroed stats: one list per stat type."""
    return [[0] * TYPE_SLOTS for _ in STAT_TYPES]


def _put(out: dict[str, int], prefix: str, slots: list[int], i: int) -> None:
    cur = slots[i + CUR]
    freed = slots[i + FREED]
    out[prefix + "current"] = cur
    out[prefix + "peak"] = slots[i + PEAK]
    out[prefix + "allocated"] = cur - slots[i + ORIGIN] + freed
    out[prefix + "freed"] = freed


def build_memory_stats(
    stats: list[list[int]], counters: dict[str, int], max_split_size: int
) -> dict[str, int]:
    """The flat ``torch.cuda.memory_stats()`` dict (THCPModule_memoryStats + memory.py).

    Args:
        stats: the per-type stat lists.
        counters: the values of COUNTERS.
        max_split_size: ``stats.max_split_size`` (-1 when unlimited).
    """
    out: dict[str, int] = dict(counters)
    out["max_split_size"] = max_split_size
    for s, name in enumerate(ARRAY_STATS):
        for t, tname in enumerate(STAT_TYPES):
            _put(out, f"{name}.{tname}.", stats[t], s * 4)
    _put(out, "oversize_allocations.", stats[ALL], OVERSIZE_ALLOCATIONS)
    _put(out, "oversize_segments.", stats[ALL], OVERSIZE_SEGMENTS)
    return {k: out[k] for k in STAT_KEYS}


def reset_peaks(stats: list[list[int]]) -> None:
    """resetPeakStats: ``peak = current`` for every array stat and both oversize stats."""
    for slots in stats:
        for i in range(0, TYPE_SLOTS, 4):
            slots[i + PEAK] = slots[i + CUR]


def reset_accumulated(stats: list[list[int]]) -> None:
    """resetAccumulatedStats: ``allocated`` and ``freed`` become 0 for every stat."""
    for slots in stats:
        for i in range(0, TYPE_SLOTS, 4):
            slots[i + FREED] = 0
            slots[i + ORIGIN] = slots[i + CUR]

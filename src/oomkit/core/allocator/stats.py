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

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from oomkit.core.allocator.rules import AllocatorRules

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
    "StatsMixin",
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


class StatsMixin:
    """The stats API of :class:`~oomkit.core.allocator.caching_allocator.CachingAllocator`."""

    # Provided by CachingAllocator.
    _stats: list[list[int]]
    _max_split_stat: int
    _num_alloc_retries: int
    _num_ooms: int
    _num_sync_all_streams: int
    _num_device_alloc: int
    _num_device_free: int
    _num_oom_rejections: int
    rules: AllocatorRules

    def memory_stats(self) -> dict[str, int]:
        """``torch.cuda.memory_stats()`` for this device: the same keys and semantics (§10).

        Versions with throw_on_cudamalloc_oom (2.12+; torch 2.13's ``memory_stats`` docstring
        lists the key) add ``num_oom_rejections``; torch returns the keys sorted.
        """
        stats = self._base_memory_stats()
        if self.rules.oom_rejection:
            stats["num_oom_rejections"] = self._num_oom_rejections
            stats = dict(sorted(stats.items()))
        return stats

    def _base_memory_stats(self) -> dict[str, int]:
        return build_memory_stats(
            self._stats,
            {
                "num_alloc_retries": self._num_alloc_retries,
                "num_ooms": self._num_ooms,
                "num_sync_all_streams": self._num_sync_all_streams,
                "num_device_alloc": self._num_device_alloc,
                "num_device_free": self._num_device_free,
            },
            self._max_split_stat,
        )

    def reset_peak_memory_stats(self) -> None:
        """resetPeakStats: every peak becomes the current value."""
        reset_peaks(self._stats)

    def reset_accumulated_memory_stats(self) -> None:
        """resetAccumulatedStats: zero ``allocated``/``freed`` and the event counters."""
        reset_accumulated(self._stats)
        self._num_alloc_retries = 0
        self._num_ooms = 0
        self._num_sync_all_streams = 0
        self._num_device_alloc = 0
        self._num_device_free = 0
        # MAIN26 resetAccumulatedStats also zeroes num_oom_rejections.
        self._num_oom_rejections = 0

    @property
    def num_oom_rejections(self) -> int:
        """MAIN26 ``num_oom_rejections``: throw_on_cudamalloc_oom rejections (§10.2).

        torch 2.13 documents it as a ``memory_stats()`` key; the simulator keeps the key set of
        STAT_KEYS and reports it here.
        """
        return self._num_oom_rejections

    def memory_allocated(self) -> int:
        """``allocated_bytes.all.current``."""
        return self._stats[ALL][ALLOCATED_BYTES + CUR]

    def memory_reserved(self) -> int:
        """``reserved_bytes.all.current``."""
        return self._stats[ALL][RESERVED_BYTES + CUR]

    def max_memory_allocated(self) -> int:
        """``allocated_bytes.all.peak``."""
        return self._stats[ALL][ALLOCATED_BYTES + PEAK]

    def max_memory_reserved(self) -> int:
        """``reserved_bytes.all.peak``."""
        return self._stats[ALL][RESERVED_BYTES + PEAK]

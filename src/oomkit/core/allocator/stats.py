"""The statistics of ``torch.cuda.memory_stats()`` (ref §10, c10/core/CachingDeviceAllocator.h).

Each ``Stat`` has ``current``, ``peak``, ``allocated`` (sum of increases) and ``freed`` (sum of
decreases). The simulator keeps one :class:`StatSlots` per stat type (``all``, ``small_pool``,
``large_pool``): every field a native integer in a compiled build, so malloc and free update
them without making an int object per update (issue 41: boxed ints in stat lists cost about a
fifth of a compiled verify); the slot constants below index the same fields
(``slots[ALLOCATED_BYTES + PEAK]`` is ``slots.allocated_bytes_peak``) for the paths that are
not hot. ``allocated`` is not stored but
derived as ``current - origin + freed``, where ``origin`` is ``current`` at the last
``reset_accumulated_memory_stats``. Increases move the peak at once (``increase_stat``), as
PyTorch does, so peaks match exactly. The two oversize stats are single ``Stat``s and live in
the ``all`` list only.

PyTorch updates the aggregate with every pool update (``update_stat_array``: AGGREGATE plus one
pool type), so ``all``'s current, freed and origin are always small + large; only its peak is
not. The ``all`` list therefore keeps only the peaks of the array stats (their other slots stay
0) and the rest is summed when read: a free then writes one list, not two (issue 19).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final, final

if TYPE_CHECKING:
    # Native 64-bit integers for mypyc (annotations only: never imported at run time).
    from mypy_extensions import i64

    from oomkit.core.allocator.versions import TorchBehaviour

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
    "StatSlots",
    "new_stat_lists",
    "build_memory_stats",
    "reset_peaks",
    "reset_accumulated",
    "AllocatorStats",
    "StatTally",
    "StatsApi",
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
ALL: Final = 0
SMALL_POOL: Final = 1
LARGE_POOL: Final = 2
# DeviceStats scalar counters.
COUNTERS = (
    "num_alloc_retries",
    "num_ooms",
    "num_sync_all_streams",
    "num_device_alloc",
    "num_device_free",
)

# Offsets inside one Stat's four slots.
CUR: Final = 0
PEAK: Final = 1
FREED: Final = 2
ORIGIN: Final = 3

# First slot of each stat inside a stat-type list.
ALLOCATION: Final = 0
SEGMENT: Final = 4
ACTIVE: Final = 8
INACTIVE_SPLIT: Final = 12
ALLOCATED_BYTES: Final = 16
RESERVED_BYTES: Final = 20
ACTIVE_BYTES: Final = 24
INACTIVE_SPLIT_BYTES: Final = 28
REQUESTED_BYTES: Final = 32
OVERSIZE_ALLOCATIONS: Final = 36  # "all" list only
OVERSIZE_SEGMENTS: Final = 40  # "all" list only
TYPE_SLOTS: Final = 44

# The slots malloc and free touch (a stat's first slot, +PEAK, +FREED), written as literals and
# Final so that a compiled build (scripts/compile_allocator.py) inlines them.
_A: Final = 0
_AP: Final = 1
_AF: Final = 2
_ACT: Final = 8
_ACTP: Final = 9
_ACTF: Final = 10
_IS: Final = 12
_ISP: Final = 13
_ISF: Final = 14
_AB: Final = 16
_ABP: Final = 17
_ABF: Final = 18
_XB: Final = 24
_XBP: Final = 25
_XBF: Final = 26
_ISB: Final = 28
_ISBP: Final = 29
_ISBF: Final = 30
_RQ: Final = 32
_RQP: Final = 33
_RQF: Final = 34

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


_FIELD_SUFFIXES = ("", "_peak", "_freed", "_origin")  # CUR, PEAK, FREED, ORIGIN
# Slot i's field name: the array stats, then the two oversize stats.
SLOT_NAMES: Final = tuple(
    name + suffix
    for name in (*ARRAY_STATS, "oversize_allocations", "oversize_segments")
    for suffix in _FIELD_SUFFIXES
)


@final
class StatSlots:
    """One stat type's stats: ``TYPE_SLOTS`` integers, as named fields and by slot index.

    malloc and free read and write the fields by name (native 64-bit integers, ``i64``, in a
    compiled build: no tag checks on each update, issue 41; every stat is far below 2**63);
    ``slots[i]`` reads and writes the same field by its slot constant (``SLOT_NAMES[i]``).
    """

    __slots__ = SLOT_NAMES

    allocation: i64
    allocation_peak: i64
    allocation_freed: i64
    allocation_origin: i64
    segment: i64
    segment_peak: i64
    segment_freed: i64
    segment_origin: i64
    active: i64
    active_peak: i64
    active_freed: i64
    active_origin: i64
    inactive_split: i64
    inactive_split_peak: i64
    inactive_split_freed: i64
    inactive_split_origin: i64
    allocated_bytes: i64
    allocated_bytes_peak: i64
    allocated_bytes_freed: i64
    allocated_bytes_origin: i64
    reserved_bytes: i64
    reserved_bytes_peak: i64
    reserved_bytes_freed: i64
    reserved_bytes_origin: i64
    active_bytes: i64
    active_bytes_peak: i64
    active_bytes_freed: i64
    active_bytes_origin: i64
    inactive_split_bytes: i64
    inactive_split_bytes_peak: i64
    inactive_split_bytes_freed: i64
    inactive_split_bytes_origin: i64
    requested_bytes: i64
    requested_bytes_peak: i64
    requested_bytes_freed: i64
    requested_bytes_origin: i64
    oversize_allocations: i64
    oversize_allocations_peak: i64
    oversize_allocations_freed: i64
    oversize_allocations_origin: i64
    oversize_segments: i64
    oversize_segments_peak: i64
    oversize_segments_freed: i64
    oversize_segments_origin: i64

    def __init__(self) -> None:
        for name in SLOT_NAMES:
            setattr(self, name, 0)

    def __getitem__(self, i: int) -> int:
        value: int = getattr(self, SLOT_NAMES[i])
        return value

    def __setitem__(self, i: int, value: int) -> None:
        setattr(self, SLOT_NAMES[i], value)

    def __len__(self) -> int:
        return TYPE_SLOTS


def new_stat_lists() -> list[StatSlots]:
    """Zeroed stats: one :class:`StatSlots` per stat type."""
    return [StatSlots() for _ in STAT_TYPES]


# The keys of each stat's four fields, ``prefix + field`` (_STAT_FIELDS order), made once:
# every verify builds memory_stats() (issue 41).
_Keys = tuple[str, str, str, str]


def _field_keys(prefix: str) -> _Keys:
    current, peak, allocated, freed = (prefix + f for f in _STAT_FIELDS)
    return current, peak, allocated, freed


# _ARRAY_KEYS[s][t]: array stat s (ARRAY_STATS) of stat type t (STAT_TYPES).
_ARRAY_KEYS = tuple(
    tuple(_field_keys(f"{name}.{tname}.") for tname in STAT_TYPES) for name in ARRAY_STATS
)
_OVERSIZE_ALLOCATIONS_KEYS = _field_keys("oversize_allocations.")
_OVERSIZE_SEGMENTS_KEYS = _field_keys("oversize_segments.")


def _put(out: dict[str, int], keys: _Keys, slots: StatSlots | list[int], i: int) -> None:
    cur = slots[i + CUR]
    freed = slots[i + FREED]
    out[keys[0]] = cur
    out[keys[1]] = slots[i + PEAK]
    out[keys[2]] = cur - slots[i + ORIGIN] + freed
    out[keys[3]] = freed


def _aggregate(stats: list[StatSlots]) -> list[int]:
    """The ``all`` stat type in full: small + large, with ``all``'s own peaks and oversize stats."""
    small, large, own = stats[SMALL_POOL], stats[LARGE_POOL], stats[ALL]
    out = [small[i] + large[i] for i in range(TYPE_SLOTS)]
    for i in range(PEAK, OVERSIZE_ALLOCATIONS, 4):
        out[i] = own[i]
    for i in range(OVERSIZE_ALLOCATIONS, TYPE_SLOTS):
        out[i] = own[i]
    return out


def build_memory_stats(
    stats: list[StatSlots], counters: dict[str, int], max_split_size: int
) -> dict[str, int]:
    """The flat ``torch.cuda.memory_stats()`` dict (THCPModule_memoryStats + memory.py).

    Args:
        stats: the per-type stats (``all`` holding its peaks only, see above).
        counters: the values of COUNTERS.
        max_split_size: ``stats.max_split_size`` (-1 when unlimited).
    """
    out: dict[str, int] = dict(counters)
    out["max_split_size"] = max_split_size
    full: list[StatSlots | list[int]] = [_aggregate(stats), stats[SMALL_POOL], stats[LARGE_POOL]]
    for s, by_type in enumerate(_ARRAY_KEYS):
        for t, keys in enumerate(by_type):
            _put(out, keys, full[t], s * 4)
    _put(out, _OVERSIZE_ALLOCATIONS_KEYS, stats[ALL], OVERSIZE_ALLOCATIONS)
    _put(out, _OVERSIZE_SEGMENTS_KEYS, stats[ALL], OVERSIZE_SEGMENTS)
    return {k: out[k] for k in STAT_KEYS}


def reset_peaks(stats: list[StatSlots]) -> None:
    """resetPeakStats: ``peak = current`` for every array stat and both oversize stats."""
    aggregate = _aggregate(stats)
    for slots in stats[SMALL_POOL], stats[LARGE_POOL]:
        for i in range(0, TYPE_SLOTS, 4):
            slots[i + PEAK] = slots[i + CUR]
    own = stats[ALL]
    for i in range(0, TYPE_SLOTS, 4):
        own[i + PEAK] = aggregate[i + CUR]


def reset_accumulated(stats: list[StatSlots]) -> None:
    """resetAccumulatedStats: ``allocated`` and ``freed`` become 0 for every stat (``all``'s
    array stats follow from the pools')."""
    for slots in stats:
        for i in range(0, TYPE_SLOTS, 4):
            slots[i + FREED] = 0
            slots[i + ORIGIN] = slots[i + CUR]


class AllocatorStats:
    """``DeviceStats``: the per-type stats and the scalar counters (§10).

    ``lists`` (one :class:`StatSlots` per stat type) is never replaced, so hot paths may bind it
    (or one of its members) to a local.
    """

    __slots__ = (
        "lists",
        "num_alloc_retries",
        "num_ooms",
        "num_sync_all_streams",
        "num_device_alloc",
        "num_device_free",
        "num_oom_rejections",
    )

    def __init__(self) -> None:
        self.lists = new_stat_lists()
        self.num_alloc_retries = 0
        self.num_ooms = 0
        self.num_sync_all_streams = 0
        self.num_device_alloc = 0
        self.num_device_free = 0
        # MAIN26 num_oom_rejections (§10.2).
        self.num_oom_rejections = 0

    def up(self, kind: int, i: int, amount: int) -> None:
        """increase_stat on the pool kind (current and peak) and on ``all`` (its peak)."""
        lists = self.lists
        s = lists[kind]
        name = SLOT_NAMES[i]
        peak = SLOT_NAMES[i + PEAK]
        c: int = getattr(s, name) + amount
        setattr(s, name, c)
        if c > getattr(s, peak):
            setattr(s, peak, c)
        # all's current is the two pools' sum (SMALL_POOL + LARGE_POOL - kind: the other one).
        c += getattr(lists[3 - kind], name)
        s = lists[ALL]
        if c > getattr(s, peak):
            setattr(s, peak, c)

    def down(self, kind: int, i: int, amount: int) -> None:
        """decrease_stat on the pool kind (``all`` is the pools' sum)."""
        s = self.lists[kind]
        name = SLOT_NAMES[i]
        freed = SLOT_NAMES[i + FREED]
        setattr(s, name, getattr(s, name) - amount)
        setattr(s, freed, getattr(s, freed) + amount)

    def up_all(self, i: int, amount: int) -> None:
        """increase_stat on a single Stat (the oversize stats)."""
        s = self.lists[ALL]
        name = SLOT_NAMES[i]
        peak = SLOT_NAMES[i + PEAK]
        c: int = getattr(s, name) + amount
        setattr(s, name, c)
        if c > getattr(s, peak):
            setattr(s, peak, c)

    def down_all(self, i: int, amount: int) -> None:
        """decrease_stat on a single Stat (the oversize stats)."""
        self.down(ALL, i, amount)

    def current(self, i: int) -> int:
        """``<stat>.all.current`` of the stat at slot ``i``."""
        lists = self.lists
        if i >= OVERSIZE_ALLOCATIONS:
            return lists[ALL][i + CUR]
        return lists[SMALL_POOL][i + CUR] + lists[LARGE_POOL][i + CUR]

    def peak(self, i: int) -> int:
        """``<stat>.all.peak`` of the stat at slot ``i``."""
        return self.lists[ALL][i + PEAK]

    def memory_stats(self, rules: TorchBehaviour, max_split_size: int) -> dict[str, int]:
        """``torch.cuda.memory_stats()``: the same keys and semantics (CUDACachingAllocator.cpp DeviceStats, torch/cuda/memory.py memory_stats).

        Versions with throw_on_cudamalloc_oom (2.12+; torch 2.13's ``memory_stats`` docstring
        lists the key) add ``num_oom_rejections``; torch returns the keys sorted.
        """
        stats = build_memory_stats(
            self.lists,
            {
                "num_alloc_retries": self.num_alloc_retries,
                "num_ooms": self.num_ooms,
                "num_sync_all_streams": self.num_sync_all_streams,
                "num_device_alloc": self.num_device_alloc,
                "num_device_free": self.num_device_free,
            },
            max_split_size,
        )
        if rules.oom_rejection:
            stats["num_oom_rejections"] = self.num_oom_rejections
            stats = dict(sorted(stats.items()))
        return stats

    def reset_peaks(self) -> None:
        """resetPeakStats: every peak becomes the current value."""
        reset_peaks(self.lists)

    def reset_accumulated(self) -> None:
        """resetAccumulatedStats: zero ``allocated``/``freed`` and the event counters."""
        reset_accumulated(self.lists)
        self.num_alloc_retries = 0
        self.num_ooms = 0
        self.num_sync_all_streams = 0
        self.num_device_alloc = 0
        self.num_device_free = 0
        # MAIN26 resetAccumulatedStats also zeroes num_oom_rejections.
        self.num_oom_rejections = 0


class StatTally:
    """Stat increases noted now and applied to an :class:`AllocatorStats` later, summed.

    Seeding a start state only increases stats, so one increase per stat of the sum leaves the
    same currents and peaks as one per segment: a pool's peak and ``all``'s peak are then the
    largest of the old peak and the final value (issue 41: seeding a real trace's start state
    made a dozen ``up`` calls per segment). ``deferred``: while set, :func:`seed_segment`
    leaves its increases here for the caller to :meth:`apply`.
    """

    __slots__ = ("amounts", "deferred")

    def __init__(self) -> None:
        # The increase of slot i (a stat's first slot) of stat type t at t * TYPE_SLOTS + i.
        self.amounts = [0] * (len(STAT_TYPES) * TYPE_SLOTS)
        self.deferred = False

    def up(self, kind: int, i: int, amount: int) -> None:
        """Note :meth:`AllocatorStats.up`."""
        self.amounts[kind * TYPE_SLOTS + i] += amount

    def up_all(self, i: int, amount: int) -> None:
        """Note :meth:`AllocatorStats.up_all` (the oversize stats)."""
        self.amounts[ALL * TYPE_SLOTS + i] += amount

    def apply(self, stats: AllocatorStats) -> None:
        """Apply every noted increase to ``stats`` and forget them."""
        amounts = self.amounts
        for kind in (SMALL_POOL, LARGE_POOL):
            for i in range(0, OVERSIZE_ALLOCATIONS, 4):
                amount = amounts[kind * TYPE_SLOTS + i]
                if amount:
                    stats.up(kind, i, amount)
        for i in (OVERSIZE_ALLOCATIONS, OVERSIZE_SEGMENTS):
            amount = amounts[ALL * TYPE_SLOTS + i]
            if amount:
                stats.up_all(i, amount)
        self.amounts = [0] * len(amounts)


class StatsApi:
    """The ``torch.cuda`` memory-stats functions of an allocator (a base of CachingAllocator).

    The subclass sets ``_stats``, ``rules`` and ``_max_split_stat`` (the ``max_split_size``
    captured at creation, -1 when unlimited).
    """

    _stats: AllocatorStats
    rules: TorchBehaviour
    _max_split_stat: int

    def memory_stats(self) -> dict[str, int]:
        """``torch.cuda.memory_stats()``: see :meth:`AllocatorStats.memory_stats` (CUDACachingAllocator.cpp DeviceStats)."""
        return self._stats.memory_stats(self.rules, self._max_split_stat)

    def reset_peak_memory_stats(self) -> None:
        """resetPeakStats: every peak becomes the current value."""
        self._stats.reset_peaks()

    def reset_accumulated_memory_stats(self) -> None:
        """resetAccumulatedStats: zero ``allocated``/``freed`` and the event counters."""
        self._stats.reset_accumulated()

    @property
    def num_oom_rejections(self) -> int:
        """MAIN26 ``num_oom_rejections``: throw_on_cudamalloc_oom rejections (§10.2)."""
        return self._stats.num_oom_rejections

    def memory_allocated(self) -> int:
        """``allocated_bytes.all.current``."""
        return self._stats.current(ALLOCATED_BYTES)

    def memory_reserved(self) -> int:
        """``reserved_bytes.all.current``."""
        return self._stats.current(RESERVED_BYTES)

    def pool_stat_lists(self) -> tuple[StatSlots, StatSlots]:
        """The small and the large pool's stats, live: read them (by slot), never write them.

        For a stat both pools keep (``ALLOCATED_BYTES``, ``RESERVED_BYTES``, ... below
        ``OVERSIZE_ALLOCATIONS``), ``small[i + CUR] + large[i + CUR]`` is always
        ``<stat>.all.current`` (what :meth:`memory_allocated` returns): a replay hook that reads
        the levels after every event reads them so, without two calls per event (issue 19).
        The lists are the same objects for the allocator's whole life.
        """
        lists = self._stats.lists
        return lists[SMALL_POOL], lists[LARGE_POOL]

    def max_memory_allocated(self) -> int:
        """``allocated_bytes.all.peak``."""
        return self._stats.peak(ALLOCATED_BYTES)

    def max_memory_reserved(self) -> int:
        """``reserved_bytes.all.peak``."""
        return self._stats.peak(RESERVED_BYTES)

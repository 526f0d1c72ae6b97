"""memory_stats() keys and Stat semantics (ref §10)."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from oomkit.core.allocator import STAT_KEYS, CachingAllocator
from oomkit.core.allocator.stats import (
    ALL,
    ALLOCATED_BYTES,
    LARGE_POOL,
    OVERSIZE_SEGMENTS,
    SMALL_POOL,
    AllocatorStats,
)
from oomkit.core.allocator.versions import behaviour_for


def _keys_2_4() -> list[str]:
    return list(CachingAllocator(torch_version="2.4").memory_stats())


def test_keys_are_torchs():
    """torch 2.4's memory_stats() keys (THCPModule_memoryStats, flattened by torch/cuda/memory.py),
    sorted: 9 DeviceStats arrays x (all, small_pool, large_pool) x 4 fields, the 4 fields of the
    two oversize stats and 6 counters, 122 in all; the keys named are from torch's docs."""
    keys = _keys_2_4()
    assert keys == sorted(keys) == list(STAT_KEYS)
    assert len(keys) == 122
    assert Counter(key.count(".") for key in keys) == {2: 9 * 3 * 4, 1: 2 * 4, 0: 6}
    assert {key.rpartition(".")[2] for key in keys if "." in key} == {
        "current",
        "peak",
        "allocated",
        "freed",
    }
    for key in (
        "allocation.all.current",
        "inactive_split_bytes.small_pool.peak",
        "requested_bytes.large_pool.freed",
        "oversize_allocations.current",
        "num_alloc_retries",
        "max_split_size",
    ):
        assert key in keys, key


def test_newest_versions_add_num_oom_rejections_in_sorted_place():
    """2.12+ (throw_on_cudamalloc_oom) adds the key torch 2.13 documents, keys still sorted."""
    stats = CachingAllocator().memory_stats()
    assert list(stats) == sorted([*_keys_2_4(), "num_oom_rejections"])
    assert stats["num_oom_rejections"] == 0


def test_fresh_allocator_is_all_zero_but_max_split():
    """A new allocator reports zeros and max_split_size -1."""
    stats = CachingAllocator().memory_stats()
    assert stats.pop("max_split_size") == -1
    assert set(stats.values()) == {0}


def test_allocated_and_freed_accumulate():
    """§10.1: allocated sums increases, freed sums decreases."""
    a = CachingAllocator()
    for _ in range(3):
        a.free(a.malloc(1000))
    s = a.memory_stats()
    assert s["allocation.all.allocated"] == 3
    assert s["allocation.all.freed"] == 3
    assert s["allocated_bytes.small_pool.allocated"] == 3 * 1024
    assert s["requested_bytes.all.freed"] == 3000
    assert s["allocation.all.peak"] == 1


def test_allocator_stats_up_down_keep_peaks_and_reset():
    """increase_stat moves the peak at once; decrease_stat counts freed; resets as PyTorch."""
    stats = AllocatorStats()
    stats.up(SMALL_POOL, ALLOCATED_BYTES, 300)
    stats.down(SMALL_POOL, ALLOCATED_BYTES, 100)
    stats.up(SMALL_POOL, ALLOCATED_BYTES, 50)
    stats.up_all(OVERSIZE_SEGMENTS, 2)
    stats.down_all(OVERSIZE_SEGMENTS, 1)
    stats.num_ooms = 3
    assert (stats.current(ALLOCATED_BYTES), stats.peak(ALLOCATED_BYTES)) == (250, 300)
    out = stats.memory_stats(behaviour_for(None), -1)
    assert out["allocated_bytes.small_pool.allocated"] == 350
    assert out["allocated_bytes.small_pool.freed"] == 100
    assert out["allocated_bytes.large_pool.current"] == 0
    assert (out["oversize_segments.current"], out["oversize_segments.peak"]) == (1, 2)
    assert (out["num_ooms"], out["num_oom_rejections"], out["max_split_size"]) == (3, 0, -1)
    assert "num_oom_rejections" not in stats.memory_stats(behaviour_for("2.4"), -1)
    stats.reset_peaks()
    assert stats.peak(ALLOCATED_BYTES) == 250
    stats.reset_accumulated()
    out = stats.memory_stats(behaviour_for(None), -1)
    assert (out["allocated_bytes.all.allocated"], out["allocated_bytes.all.freed"]) == (0, 0)
    assert (out["allocated_bytes.all.current"], out["num_ooms"]) == (250, 0)
    assert stats.lists[SMALL_POOL][ALLOCATED_BYTES] == 250
    # all keeps only its peaks; its current is the pools' sum (stats.py).
    assert stats.lists[ALL][ALLOCATED_BYTES] == 0


class _PlainStat:
    """PyTorch's Stat as CachingDeviceAllocator.h writes it: all four fields stored."""

    def __init__(self) -> None:
        self.current = self.peak = self.allocated = self.freed = 0

    def increase(self, amount: int) -> None:
        self.current += amount
        self.peak = max(self.peak, self.current)
        self.allocated += amount

    def decrease(self, amount: int) -> None:
        self.current -= amount
        self.freed += amount

    def reset_peak(self) -> None:
        self.peak = self.current

    def reset_accumulated(self) -> None:
        self.allocated = self.freed = 0


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["up", "down", "reset_peaks", "reset_accumulated"]),
            st.sampled_from([SMALL_POOL, LARGE_POOL]),
            st.integers(0, 1_000),
        ),
        max_size=60,
    )
)
def test_all_as_the_pools_sum_equals_updating_all_with_every_pool(ops):
    """Stats whose ``all`` keeps only its peaks (current, freed, origin summed from the pools)
    report every ``allocated_bytes`` key exactly as PyTorch's update_stat_array, which updates
    AGGREGATE with every pool update, across peak and accumulated resets."""
    stats = AllocatorStats()
    plain = {t: _PlainStat() for t in ("all", "small_pool", "large_pool")}
    names = {SMALL_POOL: "small_pool", LARGE_POOL: "large_pool"}
    for op, kind, amount in ops:
        pair = (plain["all"], plain[names[kind]])
        if op == "up":
            stats.up(kind, ALLOCATED_BYTES, amount)
            for s in pair:
                s.increase(amount)
        elif op == "down":
            stats.down(kind, ALLOCATED_BYTES, amount)
            for s in pair:
                s.decrease(amount)
        elif op == "reset_peaks":
            stats.reset_peaks()
            for s in plain.values():
                s.reset_peak()
        else:
            stats.reset_accumulated()
            for s in plain.values():
                s.reset_accumulated()
    out = stats.memory_stats(behaviour_for(None), -1)
    for t, s in plain.items():
        for field in ("current", "peak", "allocated", "freed"):
            assert out[f"allocated_bytes.{t}.{field}"] == getattr(s, field), (t, field)
    assert stats.current(ALLOCATED_BYTES) == plain["all"].current
    assert stats.peak(ALLOCATED_BYTES) == plain["all"].peak


def test_pool_stat_lists_are_live_and_sum_to_the_all_levels():
    """pool_stat_lists(): the same list objects for the allocator's life, whose small + large
    current slots are memory_allocated() and memory_reserved() after every call."""
    from oomkit.core.allocator.stats import CUR, RESERVED_BYTES

    a = CachingAllocator(capacity_bytes=2**30)
    small, large = a.pool_stat_lists()

    def levels():
        return (
            small[ALLOCATED_BYTES + CUR] + large[ALLOCATED_BYTES + CUR],
            small[RESERVED_BYTES + CUR] + large[RESERVED_BYTES + CUR],
        )

    p = a.malloc(1000)  # small pool: a 512-byte multiple in a 2 MiB segment
    q = a.malloc(3 * 2**20)  # large pool: a 20 MiB segment
    assert levels() == (1024 + 3 * 2**20, 2 * 2**20 + 20 * 2**20)
    assert levels() == (a.memory_allocated(), a.memory_reserved())
    a.free(p)
    a.free(q)
    a.empty_cache()
    assert levels() == (0, 0) == (a.memory_allocated(), a.memory_reserved())
    assert a.pool_stat_lists()[0] is small and a.pool_stat_lists()[1] is large


def test_stat_slots_name_every_slot_once_in_slot_order():
    """StatSlots: slot constant i and field SLOT_NAMES[i] are the same integer, both ways."""
    from oomkit.core.allocator.stats import (
        ACTIVE_BYTES,
        FREED,
        PEAK,
        REQUESTED_BYTES,
        SLOT_NAMES,
        TYPE_SLOTS,
        StatSlots,
    )

    assert len(SLOT_NAMES) == len(set(SLOT_NAMES)) == TYPE_SLOTS == 44
    slots = StatSlots()
    assert [slots[i] for i in range(TYPE_SLOTS)] == [0] * TYPE_SLOTS
    slots.active_bytes_peak = 7
    slots[REQUESTED_BYTES + FREED] = 9
    assert slots[ACTIVE_BYTES + PEAK] == 7 and slots.requested_bytes_freed == 9
    assert SLOT_NAMES[ALLOCATED_BYTES] == "allocated_bytes"
    assert SLOT_NAMES[OVERSIZE_SEGMENTS + PEAK] == "oversize_segments_peak"


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 64 * 2**20), max_size=12), st.sampled_from([None, "2.4"]))
def test_serve_is_malloc_for_checked_requests(sizes, version):
    """serve (the replay loop's malloc for positive int requests) makes the same blocks and
    stats as malloc."""
    a = CachingAllocator(torch_version=version)
    b = CachingAllocator(torch_version=version)
    for i, n in enumerate(sizes):
        ptr = a.malloc(n, i % 2)
        assert b.serve(n, i % 2) == ptr
        if i % 3 == 2:
            a.free(ptr)
            b.free(ptr)
    assert a.memory_stats() == b.memory_stats()
    assert a.snapshot() == b.snapshot()

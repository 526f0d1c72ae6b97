"""Hypothesis property tests: invariants of the simulator over random request sequences."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oomkit.core.allocator import AllocatorConfig, CachingAllocator, SimulatedOutOfMemoryError
from oomkit.core.allocator.pools import NATIVE
from oomkit.errors import AllocatorUsageError

MiB = 2**20

CONFIGS = [
    AllocatorConfig(),
    AllocatorConfig(max_split_size_bytes=40 * MiB),
    AllocatorConfig(expandable_segments=True),
    AllocatorConfig(roundup_power2_divisions=(4,) * 16),
    AllocatorConfig(max_split_size_bytes=30 * MiB, garbage_collection_threshold=0.6),
]

sizes = st.one_of(
    st.integers(1, 4096),
    st.integers(1, MiB + 4096),
    st.integers(MiB, 12 * MiB),
    st.integers(10 * MiB, 70 * MiB),
)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("malloc"), sizes, st.integers(0, 2)),
        st.tuples(st.just("free"), st.integers(0, 10**6), st.booleans()),
        st.tuples(st.just("record"), st.integers(0, 10**6), st.integers(0, 2)),
        st.tuples(st.just("sync"), st.just(0), st.just(0)),
        st.tuples(st.just("empty"), st.just(0), st.just(0)),
        st.tuples(st.just("complete"), st.integers(0, 10**6), st.just(0)),
        st.tuples(st.just("bad"), st.integers(-5, -1), st.just(0)),
        # Private pools (§3.5): open a scope on pool x (y = its stream, 3 = every stream),
        # close it, release one use of a pool.
        st.tuples(st.just("begin"), st.integers(0, 2), st.integers(0, 3)),
        st.tuples(st.just("end"), st.integers(0, 2), st.just(0)),
        st.tuples(st.just("release"), st.integers(0, 2), st.just(0)),
    ),
    max_size=60,
)
POOL_IDS = [(0, 1), (0, 2), (7, 0)]

PEAK_KEYS = [
    f"{name}.{t}.peak"
    for name in ("allocated_bytes", "reserved_bytes", "active_bytes", "segment", "allocation")
    for t in ("all", "small_pool", "large_pool")
]


def check_invariants(a: CachingAllocator) -> None:
    # Every active block knows its place in the active list, every other block has none, and
    # the map by address (when made) holds exactly the active blocks.
    active = a.active_blocks.blocks
    assert all(block.active_index == i for i, block in enumerate(active))
    inactive = [b for b in a._held_blocks() if b.active_index >= 0 and b not in active]
    assert not inactive
    assert all((b.allocated or b.event_count > 0 or b.stream_uses) for b in active)
    if a.active_blocks.by_address is not None:
        assert a.active_blocks.by_address == {block.ptr: block for block in active}
    # A stream's free blocks: one head per size, in size order; the pure build keeps their
    # sizes beside them for bisect, the compiled one reads the blocks (pools.first_fit).
    pools = [a._small, a._large]
    for private in a._private.pools.values():
        pools += (private.small, private.large)
    for pool in pools:
        for sf in pool.streams.values():
            head_sizes = [head.size for head in sf.heads]
            assert head_sizes == sorted(set(head_sizes))
            assert sf.sizes == ([] if NATIVE else head_sizes)
    s = a.memory_stats()
    snap = a.snapshot()
    segment_count = {"small": 0, "large": 0}
    totals = {
        k: {"small": 0, "large": 0}
        for k in (
            "reserved",
            "allocated",
            "active",
            "requested",
            "allocs",
            "actives",
            "split",
            "split_bytes",
        )
    }
    last_end = 0
    private_free = 0
    for seg in snap:
        assert seg["segment_pool_id"] == (0, 0) or seg["segment_pool_id"] in a.private_pool_ids
        if seg["segment_pool_id"] != (0, 0):
            private_free += sum(b["size"] for b in seg["blocks"] if b["state"] == "inactive")
        kind = seg["segment_type"]
        assert seg["address"] >= last_end, "segments overlap"
        addr = seg["address"]
        for b in seg["blocks"]:
            assert b["address"] == addr, "blocks do not tile their segment"
            assert b["size"] > 0 and b["size"] % 512 == 0
            addr += b["size"]
        assert addr == seg["address"] + seg["total_size"]
        last_end = addr
        if not seg["is_expandable"]:
            segment_count[kind] += 1
        totals["reserved"][kind] += seg["total_size"]
        totals["allocated"][kind] += seg["allocated_size"]
        totals["active"][kind] += seg["active_size"]
        totals["requested"][kind] += seg["requested_size"]
        states = [b["state"] for b in seg["blocks"]]
        totals["allocs"][kind] += states.count("active_allocated")
        totals["actives"][kind] += len(states) - states.count("inactive")
        for prev, cur in zip(seg["blocks"], seg["blocks"][1:], strict=False):
            assert not (prev["state"] == cur["state"] == "inactive"), "free neighbours unmerged"
        if not seg["is_expandable"] and len(seg["blocks"]) > 1:
            for b in seg["blocks"]:
                if b["state"] == "inactive":
                    totals["split"][kind] += 1
                    totals["split_bytes"][kind] += b["size"]
    for kind in ("small", "large"):
        p = f"{kind}_pool"
        assert s[f"segment.{p}.current"] == segment_count[kind]
        assert s[f"reserved_bytes.{p}.current"] == totals["reserved"][kind]
        assert s[f"allocated_bytes.{p}.current"] == totals["allocated"][kind]
        assert s[f"active_bytes.{p}.current"] == totals["active"][kind]
        assert s[f"requested_bytes.{p}.current"] == totals["requested"][kind]
        assert s[f"allocation.{p}.current"] == totals["allocs"][kind]
        assert s[f"active.{p}.current"] == totals["actives"][kind]
        assert s[f"inactive_split.{p}.current"] == totals["split"][kind]
        assert s[f"inactive_split_bytes.{p}.current"] == totals["split_bytes"][kind]
    for name in (
        "allocated_bytes",
        "reserved_bytes",
        "active_bytes",
        "segment",
        "allocation",
        "active",
        "requested_bytes",
        "inactive_split",
        "inactive_split_bytes",
    ):
        assert s[f"{name}.all.current"] == (
            s[f"{name}.small_pool.current"] + s[f"{name}.large_pool.current"]
        )
        for t in ("all", "small_pool", "large_pool"):
            assert s[f"{name}.{t}.allocated"] - s[f"{name}.{t}.freed"] == s[f"{name}.{t}.current"]
            assert s[f"{name}.{t}.peak"] >= s[f"{name}.{t}.current"]
    assert s["allocated_bytes.all.current"] <= s["active_bytes.all.current"]
    assert s["active_bytes.all.current"] <= s["reserved_bytes.all.current"]
    assert s["reserved_bytes.all.current"] <= a.capacity_bytes
    # The OOM message's P: free cached bytes in private pools (§12.2).
    assert a.private_pool_cached_bytes() == private_free


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(range(len(CONFIGS))), st.booleans(), ops)
def test_random_sequences_keep_invariants(config_index, limit, program):
    """Blocks tile segments, stats equal the snapshot, peaks never fall, bad input is inert."""
    a = CachingAllocator(CONFIGS[config_index], capacity_bytes=300 * MiB)
    if limit:
        a.set_per_process_memory_fraction(0.8)
    live: list[int] = []
    pending: list[int] = []
    peaks = dict.fromkeys(PEAK_KEYS, 0)
    scoped: set[tuple[int, int]] = set()
    for op, x, y in program:
        if op == "malloc":
            try:
                live.append(a.malloc(x, stream=y))
            except SimulatedOutOfMemoryError:
                pass
        elif op == "free" and live:
            p = live.pop(x % len(live))
            a.free(p, deferred=y)
            if y:
                pending.append(p)
        elif op == "record" and live:
            a.record_stream(live[x % len(live)], y)
        elif op == "sync":
            a.synchronize()
            pending.clear()
        elif op == "empty":
            a.empty_cache()
            pending.clear()
        elif op == "begin":
            pid = POOL_IDS[x]
            live_pool = pid in a.private_pool_ids and a.pool_use_count(pid) > 0
            if pid not in scoped and (live_pool or pid not in a.private_pool_ids):
                a.begin_allocate_to_pool(pid, None if y == 3 else (lambda s, y=y: s == y))
                scoped.add(pid)
        elif op == "end" and POOL_IDS[x] in scoped:
            a.end_allocate_to_pool(POOL_IDS[x])
            scoped.discard(POOL_IDS[x])
        elif op == "release":
            pid = POOL_IDS[x]
            if pid not in scoped and pid in a.private_pool_ids and a.pool_use_count(pid) > 0:
                a.release_pool(pid)
        elif op == "complete" and pending:
            a.complete_free(pending.pop(x % len(pending)))
        elif op == "bad":
            before = (a.memory_stats(), a.snapshot())
            try:
                a.malloc(x)
            except AllocatorUsageError:
                pass
            else:
                raise AssertionError("negative size accepted")
            assert (a.memory_stats(), a.snapshot()) == before
        # A pending free may have been reaped by the OOM path (Step 9).
        pending = [
            p
            for p in pending
            if any(
                b["address"] == p and b["state"] == "active_pending_free"
                for seg in a.snapshot()
                for b in seg["blocks"]
            )
        ]
        check_invariants(a)
        s = a.memory_stats()
        for k in PEAK_KEYS:
            assert s[k] >= peaks[k], f"{k} fell"
            peaks[k] = s[k]


@pytest.mark.parametrize("expandable", [False, True])
def test_active_blocks_follow_splits_merges_and_unmaps(expandable):
    """The active blocks (and their map by address, once made) stay exact through a split (the
    remainder moves up), a merge with the block before (the merged block moves down) and an
    unmap."""
    a = CachingAllocator(AllocatorConfig(expandable_segments=expandable))
    x, y, z = (a.malloc(3 * MiB) for _ in range(3))
    a.free(x)
    a.free(y)  # x's block merges into y's: y's ptr moves down
    check_invariants(a)
    w = a.malloc(MiB)  # the merged block splits: the remainder's ptr moves up
    check_invariants(a)
    a.free(z)
    a.free(w)
    a.empty_cache()  # expandable: the pages are unmapped
    check_invariants(a)
    assert len(a.active_blocks) == 0 and a.active_blocks.by_address == {}
    v = a.malloc(3 * MiB)
    assert [block.ptr for block in a.active_blocks.values()] == [v]
    assert a.active_blocks.get(v) is a.active_blocks.blocks[0]
    check_invariants(a)

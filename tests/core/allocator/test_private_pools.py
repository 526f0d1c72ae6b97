"""Private memory pools: CUDA graphs and torch.cuda.MemPool (ref §3.5, §4 steps 7 and 9, §5.3)."""

from __future__ import annotations

import pytest

from oomkit.core.allocator import AllocatorConfig, CachingAllocator, SimulatedOutOfMemoryError
from oomkit.errors import AllocatorUsageError

MiB = 2**20


def segments_by_pool(a: CachingAllocator) -> dict[tuple[int, int], list[int]]:
    out: dict[tuple[int, int], list[int]] = {}
    for seg in a.snapshot():
        out.setdefault(seg["segment_pool_id"], []).append(seg["total_size"])
    return out


def mem_pool_alloc(a: CachingAllocator, pool_id, nbytes: int, stream: int = 0) -> int:
    """One allocation under torch.cuda.use_mem_pool(pool): begin, malloc, end, releasePool."""
    a.begin_allocate_to_pool(pool_id)
    try:
        return a.malloc(nbytes, stream)
    finally:
        a.end_allocate_to_pool(pool_id)
        a.release_pool(pool_id)


def test_scope_routes_allocations_to_the_private_pool():
    """An open scope puts new segments in the pool; snapshot() carries its segment_pool_id."""
    a = CachingAllocator()
    pid = a.create_pool()
    assert pid == (0, 1)
    a.begin_allocate_to_pool(pid)
    a.malloc(1000)
    a.malloc(3 * MiB)
    a.end_allocate_to_pool(pid)
    a.malloc(1000)
    assert segments_by_pool(a) == {(0, 1): [2 * MiB, 20 * MiB], (0, 0): [2 * MiB]}
    s = a.memory_stats()
    assert s["reserved_bytes.small_pool.current"] == 4 * MiB
    assert s["reserved_bytes.large_pool.current"] == 20 * MiB
    assert s["allocated_bytes.all.current"] == 2 * 1024 + 3 * MiB


def test_private_free_blocks_are_not_reused_by_the_default_pool():
    """A free block of a private pool is invisible to default-pool requests (§3.5)."""
    a = CachingAllocator()
    pid = a.create_pool()
    p = mem_pool_alloc(a, pid, 1000)
    a.free(p)
    q = a.malloc(1000)
    assert q != p
    assert a.memory_stats()["num_device_alloc"] == 2
    # Inside the pool the free block is reused at the same address.
    assert mem_pool_alloc(a, pid, 1000) == p
    assert a.memory_stats()["num_device_alloc"] == 2


def test_mem_pool_lifetime_use_count_and_release():
    """use_count: 1 at creation, +1 per scope; segments go only after 0 and a release (§3.5)."""
    a = CachingAllocator()
    pid = a.create_pool()
    a.begin_allocate_to_pool(pid)
    assert a.pool_use_count(pid) == 2
    p = a.malloc(5 * MiB)
    a.end_allocate_to_pool(pid)
    a.release_pool(pid)
    assert a.pool_use_count(pid) == 1
    a.free(p)
    a.empty_cache()  # the pool is still live: nothing released
    assert a.memory_reserved() == 20 * MiB
    a.release_pool(pid)  # ~MemPool
    assert a.pool_use_count(pid) == 0
    assert a.memory_reserved() == 20 * MiB  # freeable, not freed yet
    a.empty_cache()
    assert a.memory_reserved() == 0
    assert a.private_pool_ids == ()
    assert [entry[0] for entry in a.segment_log] == ["segment_alloc", "segment_free"]


def test_freeable_pool_keeps_segments_with_live_blocks():
    """A released pool's segment with a live block survives empty_cache until freed."""
    a = CachingAllocator()
    pid = a.create_pool()
    p = mem_pool_alloc(a, pid, 1000)
    a.release_pool(pid)
    a.empty_cache()
    assert segments_by_pool(a) == {pid: [2 * MiB]}
    assert a.private_pool_ids == (pid,)
    a.free(p)
    a.empty_cache()
    assert segments_by_pool(a) == {}
    assert a.private_pool_ids == ()


def test_cuda_graph_flow_creates_pool_at_begin():
    """torch.cuda.graph: beginAllocateToPool creates the pool (use_count 1), reset releases it."""
    a = CachingAllocator()
    gid = (1, 0)
    a.begin_allocate_to_pool(gid, lambda s: s == 7, capture=True)
    assert a.pool_use_count(gid) == 1
    a.malloc(1000, stream=7)
    a.malloc(1000, stream=0)  # other streams stay in the default pool
    a.end_allocate_to_pool(gid)
    a.release_pool(gid)
    assert sorted(segments_by_pool(a)) == [(0, 0), (1, 0)]


@pytest.mark.parametrize(("version", "winner"), [(None, (0, 2)), ("2.4", (0, 1))])
def test_scope_search_order_by_version(version, winner):
    """MAIN26 searches open scopes newest first; V24 oldest first (§3.5)."""
    a = CachingAllocator(torch_version=version)
    first, second = a.create_pool(), a.create_pool()
    a.begin_allocate_to_pool(first)
    a.begin_allocate_to_pool(second)
    a.malloc(1000)
    assert segments_by_pool(a) == {winner: [2 * MiB]}


def test_scope_misuse_raises():
    """Double begin, end without begin, over-release and the default id are errors."""
    a = CachingAllocator()
    pid = a.create_pool()
    a.begin_allocate_to_pool(pid)
    with pytest.raises(AllocatorUsageError, match="already recording"):
        a.begin_allocate_to_pool(pid)
    a.end_allocate_to_pool(pid)
    with pytest.raises(AllocatorUsageError, match="not currently recording"):
        a.end_allocate_to_pool(pid)
    a.release_pool(pid)
    a.release_pool(pid)
    with pytest.raises(AllocatorUsageError, match="not live"):
        a.release_pool(pid)
    with pytest.raises(AllocatorUsageError, match="default pools"):
        a.begin_allocate_to_pool((0, 0))
    with pytest.raises(AllocatorUsageError, match="tuple of two ints"):
        a.create_pool([0, 5])  # type: ignore[arg-type]


def test_oom_path_releases_freeable_private_pool():
    """Step 9 cudaFrees a freeable pool's cached segment, then the retry succeeds."""
    a = CachingAllocator(capacity_bytes=24 * MiB)
    pid = a.create_pool()
    a.free(mem_pool_alloc(a, pid, 5 * MiB))
    a.release_pool(pid)
    a.malloc(5 * MiB)
    assert [e[0] for e in a.segment_log] == ["segment_alloc", "segment_free", "segment_alloc"]
    assert a.memory_stats()["num_alloc_retries"] == 1
    assert a.private_pool_ids == ()
    assert segments_by_pool(a) == {(0, 0): [20 * MiB]}


def test_live_private_pool_counts_in_oom_message():
    """A live pool's free cache is not released; the message shows it as P (§12.2, §12.3)."""
    a = CachingAllocator(capacity_bytes=24 * MiB)
    pid = a.create_pool()
    a.free(mem_pool_alloc(a, pid, 5 * MiB))
    with pytest.raises(SimulatedOutOfMemoryError) as info:
        a.malloc(5 * MiB)
    assert str(info.value) == (
        "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 24.00 "
        "MiB of which 4.00 MiB is free. Of the allocated memory 20.00 MiB is allocated by "
        "PyTorch, with 20.00 MiB allocated in private pools (e.g., CUDA Graphs), and 0 bytes "
        "is reserved by PyTorch but unallocated. If reserved but unallocated memory is large "
        "try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  "
        "See documentation for Memory Management  (https://docs.pytorch.org/docs/stable/notes/"
        "cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)"
    )
    assert a.private_pool_cached_bytes() == 20 * MiB
    assert a.memory_stats()["num_alloc_retries"] == 1


def _cached_default_segment(a: CachingAllocator) -> None:
    a.free(a.malloc(5 * MiB, stream=1))  # a 20 MiB default segment, cached on stream 1


@pytest.mark.parametrize(
    ("version", "capture", "succeeds"),
    [(None, True, False), (None, False, True), ("2.4", False, False), ("2.4", True, False)],
)
def test_step9_skipped_while_capturing(version, capture, succeeds):
    """MAIN26 skips Step 9 only in a real capture; V24 whenever any scope is open (§4 step 9)."""
    a = CachingAllocator(capacity_bytes=24 * MiB, torch_version=version)
    _cached_default_segment(a)
    a.begin_allocate_to_pool((1, 0), lambda s: s == 5, capture=capture)
    if succeeds:
        a.malloc(5 * MiB, stream=5)
        assert segments_by_pool(a) == {(1, 0): [20 * MiB]}
        assert a.memory_stats()["num_alloc_retries"] == 1
    else:
        with pytest.raises(SimulatedOutOfMemoryError):
            a.malloc(5 * MiB, stream=5)
        assert segments_by_pool(a) == {(0, 0): [20 * MiB]}
        assert a.memory_stats()["num_alloc_retries"] == 0


def test_empty_cache_with_open_scope_by_version():
    """V24 empty_cache asserts no scope is open; MAIN26 skips only the default pools in capture."""
    old = CachingAllocator(torch_version="2.4")
    old.begin_allocate_to_pool(old.create_pool())
    with pytest.raises(AllocatorUsageError, match="captures_underway"):
        old.empty_cache()
    new = CachingAllocator()
    _cached_default_segment(new)
    new.begin_allocate_to_pool((1, 0), capture=True)
    new.empty_cache()
    assert new.memory_reserved() == 20 * MiB
    new.end_allocate_to_pool((1, 0))
    new.begin_allocate_to_pool(new.create_pool())  # use_mem_pool: not a capture
    new.empty_cache()
    assert new.memory_reserved() == 0


def test_use_on_oom_pool_serves_a_failed_default_request():
    """MAIN26 Step 7: a use_on_oom pool's free block, split by the classic rule, no retry."""
    a = CachingAllocator(capacity_bytes=24 * MiB)
    pid = a.create_pool(use_on_oom=True)
    base = mem_pool_alloc(a, pid, 5 * MiB)
    a.free(base)
    p = a.malloc(4 * MiB)
    assert p == base
    assert a.memory_stats()["num_alloc_retries"] == 0
    assert a.memory_stats()["inactive_split_bytes.large_pool.current"] == 16 * MiB
    [seg] = a.snapshot()
    assert seg["segment_pool_id"] == pid
    assert [b["size"] for b in seg["blocks"]] == [4 * MiB, 16 * MiB]
    a.free(p)  # goes back to the private pool, not the default one
    assert a.private_pool_cached_bytes() == 20 * MiB


def test_use_on_oom_needs_a_new_enough_version():
    """MemPool(use_on_oom) does not exist in the 2.4 model."""
    with pytest.raises(AllocatorUsageError, match="use_on_oom"):
        CachingAllocator(torch_version="2.4").create_pool(use_on_oom=True)


def test_no_split_pool_hands_out_whole_blocks():
    """MAIN26 no_split: a 1000-byte request takes the whole 2 MiB block; released pools split."""
    a = CachingAllocator()
    pid = a.create_pool(no_split=True)
    mem_pool_alloc(a, pid, 1000)
    assert a.memory_allocated() == 2 * MiB
    with pytest.raises(AllocatorUsageError, match="no_split"):
        CachingAllocator(torch_version="2.4").create_pool(no_split=True)


def test_empty_cache_of_one_pool():
    """MAIN26 emptyCache(id) releases only that freeable pool."""
    a = CachingAllocator()
    first, second = a.create_pool(), a.create_pool()
    a.free(mem_pool_alloc(a, first, 1000))
    a.free(mem_pool_alloc(a, second, 1000))
    a.release_pool(first)
    a.release_pool(second)
    a.empty_cache(first)
    assert segments_by_pool(a) == {second: [2 * MiB]}
    assert a.private_pool_ids == (second,)
    assert a.memory_stats()["num_sync_all_streams"] == 1


def test_expandable_private_pool_is_unmapped_and_deleted():
    """Expandable segments work in a private pool; release unmaps them and deletes the pool."""
    a = CachingAllocator(AllocatorConfig(expandable_segments=True), capacity_bytes=8 * 2**30)
    pid = a.create_pool()
    p = mem_pool_alloc(a, pid, 1000)
    [seg] = a.snapshot()
    assert (seg["segment_pool_id"], seg["is_expandable"], seg["total_size"]) == (
        pid,
        True,
        2 * MiB,
    )
    a.free(p)
    a.release_pool(pid)
    a.empty_cache()
    assert a.memory_reserved() == 0
    assert a.private_pool_ids == ()
    assert [e[0] for e in a.segment_log] == ["segment_map", "segment_unmap"]

"""Scenario tests of CachingAllocator: each rule of ref §4-§7, §10 with exact bytes."""

from __future__ import annotations

import pytest

from oomkit.core.allocator import AllocatorConfig, CachingAllocator, SimulatedOutOfMemoryError
from oomkit.errors import AllocatorUsageError, OomkitError

MiB = 2**20
GiB = 2**30
OLD = "2.4"  # address tie-break, fixed 20 MiB oversize slack
NEW = "2.12"  # newest behaviour of the contract's versions table may differ; see tests below


def st(a: CachingAllocator) -> dict[str, int]:
    return a.memory_stats()


def row(a: CachingAllocator) -> tuple[int, int, int, int, int]:
    s = st(a)
    return (
        s["segment.all.current"],
        s["reserved_bytes.all.current"],
        s["allocated_bytes.all.current"],
        s["inactive_split.all.current"],
        s["inactive_split_bytes.all.current"],
    )


def test_appendix_c_worked_example():
    """Appendix C of the ref, every column, step by step."""
    a = CachingAllocator()
    b1 = a.malloc(1000)
    assert row(a) == (1, 2_097_152, 1_024, 1, 2_096_128)
    b2 = a.malloc(5_000_000)
    assert row(a) == (2, 23_068_672, 5_001_216, 2, 18_067_456)
    a.free(b2)
    assert row(a) == (2, 23_068_672, 1_024, 1, 2_096_128)
    b3 = a.malloc(26_214_400)
    assert row(a) == (3, 50_331_648, 27_264_000, 1, 2_096_128)
    b5 = a.malloc(3_145_728)
    assert b5 == b2  # the front of the cached 20 MiB block in S2
    assert row(a) == (3, 50_331_648, 30_409_728, 2, 19_921_920)
    a.empty_cache()
    assert st(a)["num_sync_all_streams"] == 1
    assert row(a) == (3, 50_331_648, 30_409_728, 2, 19_921_920)
    a.free(b3)
    assert row(a) == (3, 50_331_648, 3_146_752, 2, 19_921_920)
    a.empty_cache()
    assert row(a) == (2, 23_068_672, 3_146_752, 2, 19_921_920)
    s = st(a)
    assert s["num_device_free"] == 1
    assert s["num_device_alloc"] == 3
    assert s["reserved_bytes.all.peak"] == 50_331_648
    assert s["allocated_bytes.all.peak"] == 30_409_728
    assert s["reserved_bytes.small_pool.current"] == 2_097_152
    assert s["reserved_bytes.small_pool.peak"] == 2_097_152
    assert s["requested_bytes.all.current"] == 1000 + 3_145_728
    s1, s2, s3 = (entry[1] for entry in a.segment_log[:3])
    assert a.segment_log == [
        ("segment_alloc", s1, 2_097_152),
        ("segment_alloc", s2, 20_971_520),
        ("segment_alloc", s3, 27_262_976),
        ("segment_free", s3, 27_262_976),
    ]
    assert b1 == s1 and b3 == s3


def test_merge_counts_inactive_split_decrease():
    """Step 3 of Appendix C: the merge is one decrease of 1 block and 15,971,328 bytes."""
    a = CachingAllocator()
    a.malloc(1000)
    b2 = a.malloc(5_000_000)
    before = st(a)
    a.free(b2)
    after = st(a)
    assert after["inactive_split.all.freed"] - before["inactive_split.all.freed"] == 1
    assert (
        after["inactive_split_bytes.all.freed"] - before["inactive_split_bytes.all.freed"]
        == 15_971_328
    )
    assert after["active_bytes.all.current"] == 1024


@pytest.mark.parametrize(
    ("request_bytes", "segment_bytes", "pool"),
    [
        (1, 2 * MiB, "small"),
        (MiB, 2 * MiB, "small"),
        (MiB + 1, 20 * MiB, "large"),
        (10 * MiB - 512, 20 * MiB, "large"),
        (10 * MiB, 10 * MiB, "large"),
        (11 * MiB + 1, 12 * MiB, "large"),
    ],
)
def test_segment_size_and_pool(request_bytes, segment_bytes, pool):
    """§2.3-§2.4: small <= 1 MiB -> 2 MiB; < 10 MiB -> 20 MiB; else 2 MiB multiple."""
    a = CachingAllocator()
    a.malloc(request_bytes)
    assert a.segment_log[0][2] == segment_bytes
    assert st(a)[f"reserved_bytes.{pool}_pool.current"] == segment_bytes


def test_large_leftover_of_exactly_1mib_is_not_split():
    """§13.5: an 11 MiB request in a 12 MiB segment keeps the whole 12 MiB."""
    a = CachingAllocator()
    a.malloc(11 * MiB)
    s = st(a)
    assert s["allocated_bytes.all.current"] == 12 * MiB
    assert s["inactive_split.all.current"] == 0
    assert a.snapshot()[0]["blocks"][0]["size"] == 12 * MiB


def test_large_leftover_above_1mib_is_split():
    """§4 step 11: a leftover > 1 MiB is split off the back."""
    a = CachingAllocator()
    a.malloc(10 * MiB + 1)  # rounds to 10 MiB + 512, segment 12 MiB
    assert st(a)["allocated_bytes.all.current"] == 10 * MiB + 512
    blocks = a.snapshot()[0]["blocks"]
    assert [b["size"] for b in blocks] == [10 * MiB + 512, 2 * MiB - 512]


def test_small_pool_splits_any_leftover():
    """Small pool: split iff leftover >= 512."""
    a = CachingAllocator()
    a.malloc(2 * MiB - 512)  # rounds to 2 MiB - 512 > 1 MiB: large pool, 20 MiB segment
    a.malloc(MiB)  # small pool, leftover 1 MiB
    small = [seg for seg in a.snapshot() if seg["segment_type"] == "small"][0]
    assert [b["size"] for b in small["blocks"]] == [MiB, MiB]


def test_best_fit_is_per_stream():
    """§3.4: a free block on stream 1 is invisible to stream 2."""
    a = CachingAllocator()
    p = a.malloc(4 * MiB, stream=1)
    a.free(p)
    q = a.malloc(4 * MiB, stream=2)
    assert q != p
    assert st(a)["segment.all.current"] == 2
    r = a.malloc(4 * MiB, stream=1)
    assert r == p


def _two_equal_free_blocks(version: str) -> tuple[CachingAllocator, int, int]:
    # Segment addresses decrease, so the newer segment has the lower address.
    addresses = iter([0x9000_0000_0000, 0x8000_0000_0000])
    a = CachingAllocator(
        torch_version=version, segment_address=lambda size, expandable: next(addresses)
    )
    older = a.malloc(12 * MiB)
    newer = a.malloc(12 * MiB)
    a.free(older)
    a.free(newer)
    return a, older, newer


def test_tie_break_lowest_address_in_old_versions():
    """§3.6: before 2026 the lowest address wins among equal-size blocks."""
    a, older, newer = _two_equal_free_blocks(OLD)
    assert a.malloc(12 * MiB) == newer


def test_tie_break_creation_order_in_2026_versions():
    """§3.6: in MAIN26 the earliest-created segment wins."""
    a, older, newer = _two_equal_free_blocks(NEW)
    if not a.rules.tie_break_by_creation_order:
        pytest.skip("the newest version models the address tie-break")
    assert a.malloc(12 * MiB) == older


def test_oversize_rule_1_small_request_never_takes_oversize_block():
    """§4 step 3.4: size < max_split and block >= max_split -> new segment."""
    a = CachingAllocator(AllocatorConfig(max_split_size_bytes=100 * MiB))
    p = a.malloc(200 * MiB)
    a.free(p)
    q = a.malloc(50 * MiB)
    assert q != p
    s = st(a)
    assert s["segment.all.current"] == 2
    assert s["oversize_segments.current"] == 1
    assert s["oversize_allocations.current"] == 0
    assert s["max_split_size"] == 100 * MiB


@pytest.mark.parametrize("version", [OLD, NEW])
def test_oversize_rule_2_slack(version):
    """§6: a 150 MiB request skips a free 200 MiB block, but takes 160 MiB whole."""
    a = CachingAllocator(AllocatorConfig(max_split_size_bytes=100 * MiB), torch_version=version)
    big = a.malloc(200 * MiB)
    a.free(big)
    p = a.malloc(150 * MiB)
    assert p != big
    a.free(p)
    a.empty_cache()
    q = a.malloc(160 * MiB)
    a.free(q)
    r = a.malloc(150 * MiB)
    assert r == q
    s = st(a)
    assert s["allocated_bytes.all.current"] == 160 * MiB  # never split: the whole block
    assert s["oversize_allocations.current"] == 1


def test_oversize_slack_is_configurable_only_in_new_versions():
    """§6 / PR #136174: max_non_split_rounding_mb is ignored by old versions (fixed 20 MiB)."""
    cfg = AllocatorConfig(max_split_size_bytes=100 * MiB, max_non_split_rounding_bytes=60 * MiB)
    for version, reused in ((OLD, False), (NEW, True)):
        a = CachingAllocator(cfg, torch_version=version)
        if a.rules.configurable_non_split_rounding != reused:
            continue
        p = a.malloc(200 * MiB)
        a.free(p)
        assert (a.malloc(150 * MiB) == p) is reused


def test_max_split_size_stat_is_minus_one_when_unlimited():
    """§10.2: max_split_size shows -1 when unlimited and is fixed at creation."""
    a = CachingAllocator()
    assert st(a)["max_split_size"] == -1
    a.set_allocator_settings("max_split_size_mb:200")
    assert st(a)["max_split_size"] == -1


def test_step8_frees_one_large_enough_oversize_block():
    """§4 step 8: one cached block >= max(size, max_split) is freed, then cudaMalloc."""
    a = CachingAllocator(AllocatorConfig(max_split_size_bytes=100 * MiB), capacity_bytes=1 * GiB)
    small = a.malloc(300 * MiB)
    big = a.malloc(600 * MiB)
    a.free(small)
    a.free(big)
    # 400 MiB: rule 2 rejects the 600 MiB block (400 + 20 <= 600); cudaMalloc fails (900 + 400
    # > 1024); Step 8 frees the one block >= 400 MiB (the 600 MiB block) and retries.
    a.malloc(400 * MiB)
    log = a.segment_log[2:]
    assert log == [("segment_free", big, 600 * MiB), ("segment_alloc", log[1][1], 400 * MiB)]
    s = st(a)
    assert s["num_alloc_retries"] == 0
    assert s["num_sync_all_streams"] == 0
    assert s["reserved_bytes.all.current"] == 700 * MiB


def test_step8_frees_largest_blocks_until_enough():
    """§4 step 8.4: no single block is large enough, so the largest are freed in turn."""
    a = CachingAllocator(AllocatorConfig(max_split_size_bytes=100 * MiB), capacity_bytes=1 * GiB)
    ptrs = [a.malloc(n * MiB) for n in (150, 200, 250, 300)]
    for p in ptrs:
        a.free(p)
    # 330 MiB: no cached block >= 330 MiB. cudaMalloc: 900 + 330 > 1024 fails. Step 8 frees
    # 300 then 250 (550 >= 330), and the retry fits (350 + 330 <= 1024).
    a.malloc(330 * MiB)
    assert a.segment_log[4:6] == [
        ("segment_free", ptrs[3], 300 * MiB),
        ("segment_free", ptrs[2], 250 * MiB),
    ]
    assert a.segment_log[6][0] == "segment_alloc"
    assert st(a)["num_alloc_retries"] == 0


def test_step8_never_frees_a_split_oversize_block():
    """§4 step 8 releases whole segments only: a split free block >= max_split stays (§15.11)."""
    a = CachingAllocator(capacity_bytes=130 * MiB)
    p = a.malloc(100 * MiB)
    a.free(p)
    a.malloc(30 * MiB)  # [30 MiB live | 70 MiB free] in the 100 MiB segment
    a.set_allocator_settings("max_split_size_mb:50")
    # 40 MiB: rule 1 refuses the 70 MiB oversize block; cudaMalloc fails (100 + 40 > 130);
    # Step 8 must not cudaFree the split 70 MiB block (it would free the live 30 MiB too).
    with pytest.raises(SimulatedOutOfMemoryError):
        a.malloc(40 * MiB)
    assert a.segment_log == [("segment_alloc", p, 100 * MiB)]
    assert st(a)["reserved_bytes.all.current"] == 100 * MiB
    assert st(a)["allocated_bytes.all.current"] == 30 * MiB


def test_step9_releases_everything_and_counts_a_retry():
    """§4 step 9: synchronize, free every unsplit cached block, retry (num_alloc_retries)."""
    a = CachingAllocator(capacity_bytes=100 * MiB)
    p1 = a.malloc(40 * MiB)
    p2 = a.malloc(40 * MiB)
    a.free(p1)
    a.free(p2)
    q = a.malloc(50 * MiB)
    s = st(a)
    assert s["num_alloc_retries"] == 1
    assert s["num_sync_all_streams"] == 1
    assert s["num_ooms"] == 0
    assert a.segment_log[2:] == [
        ("segment_free", p1, 40 * MiB),
        ("segment_free", p2, 40 * MiB),
        ("segment_alloc", q, 50 * MiB),
    ]
    # Peaks: the releases come before the new segment is counted (§13.20).
    assert s["reserved_bytes.all.peak"] == 80 * MiB
    assert s["reserved_bytes.all.current"] == 50 * MiB


def test_oom_raises_and_counts():
    """§4 step 10: OOM after Step 9; num_ooms and num_alloc_retries both move."""
    a = CachingAllocator(capacity_bytes=100 * MiB)
    a.malloc(60 * MiB)
    with pytest.raises(SimulatedOutOfMemoryError) as info:
        a.malloc(50 * MiB)
    err = info.value
    assert isinstance(err, OomkitError) and isinstance(err, MemoryError)
    assert err.alloc_size == 50 * MiB and err.requested == 50 * MiB
    assert err.allocated == 60 * MiB and err.reserved == 60 * MiB
    assert err.capacity == 100 * MiB and err.free == 40 * MiB
    s = st(a)
    assert s["num_ooms"] == 1
    assert s["num_alloc_retries"] == 1


def test_oom_message_v2_2_text():
    """§12.3: the >= 2.2 message, with alloc_size and the two double spaces."""
    a = CachingAllocator(capacity_bytes=70 * MiB, torch_version=OLD)
    a.malloc(60 * MiB)
    with pytest.raises(SimulatedOutOfMemoryError) as info:
        a.malloc(5 * MiB + 3)
    assert str(info.value) == (
        "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of "
        "70.00 MiB of which 10.00 MiB is free. Of the allocated memory 60.00 MiB is allocated "
        "by PyTorch, and 0 bytes is reserved by PyTorch but unallocated. If reserved but "
        "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
        " to avoid fragmentation.  See documentation for Memory Management  "
        "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
    )


def test_oom_message_fraction_limit():
    """§4 step 6.2 and §12.3: the fraction limit fails first and adds 'X allowed; '."""
    a = CachingAllocator(capacity_bytes=1 * GiB, torch_version=OLD)
    a.set_per_process_memory_fraction(0.5)
    a.malloc(400 * MiB)
    with pytest.raises(SimulatedOutOfMemoryError) as info:
        a.malloc(200 * MiB)
    text = str(info.value)
    assert "of which 624.00 MiB is free. 512.00 MiB allowed; Of the allocated memory" in text
    assert info.value.allowed_bytes == 512 * MiB
    assert a.segment_log == [("segment_alloc", a.segment_log[0][1], 400 * MiB)]


def test_oom_message_classic_and_2_1():
    """§12.3: the <= 2.0 parenthesised text and the 2.1 'capacty' text."""
    a = CachingAllocator(capacity_bytes=100 * MiB, torch_version="2.0")
    a.malloc(60 * MiB)
    with pytest.raises(SimulatedOutOfMemoryError) as info:
        a.malloc(50 * MiB)
    assert str(info.value) == (
        "CUDA out of memory. Tried to allocate 50.00 MiB (GPU 0; 100.00 MiB total capacity; "
        "60.00 MiB already allocated; 40.00 MiB free; 60.00 MiB reserved in total by PyTorch) "
        "If reserved memory is >> allocated memory try setting max_split_size_mb to avoid "
        "fragmentation.  See documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF"
    )
    b = CachingAllocator(capacity_bytes=100 * MiB, torch_version="2.1")
    b.malloc(60 * MiB)
    with pytest.raises(SimulatedOutOfMemoryError) as info:
        b.malloc(50 * MiB)
    assert str(info.value) == (
        "CUDA out of memory. Tried to allocate 50.00 MiB. GPU 0 has a total capacty of "
        "100.00 MiB of which 40.00 MiB is free. Of the allocated memory 60.00 MiB is allocated "
        "by PyTorch, and 0 bytes is reserved by PyTorch but unallocated. If reserved but "
        "unallocated memory is large try setting max_split_size_mb to avoid fragmentation.  "
        "See documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF"
    )


def test_oom_message_small_request_reports_2mib():
    """§12.2: a 4-byte request that OOMs reports the 2 MiB segment."""
    a = CachingAllocator(capacity_bytes=MiB)
    with pytest.raises(SimulatedOutOfMemoryError, match="Tried to allocate 2.00 MiB"):
        a.malloc(4)


def test_one_exabyte_request():
    """§12.4: requests >= 2^60 fail at once with the 1EB message; no stats change."""
    a = CachingAllocator()
    with pytest.raises(SimulatedOutOfMemoryError) as info:
        a.malloc(2**60)
    assert str(info.value) == "CUDA out of memory. Tried to allocate more than 1EB memory."
    assert st(a)["num_ooms"] == 0
    assert a.segment_log == []


def test_zero_byte_request_is_null():
    """§4: size 0 returns 0 with no allocator call."""
    a = CachingAllocator()
    assert a.malloc(0) == 0
    assert st(a)["allocation.all.allocated"] == 0
    a.free(0)


def test_retry_path_records_oom_state_unchanged():
    """§4 step 10: releases made before the OOM stay made."""
    a = CachingAllocator(capacity_bytes=100 * MiB)
    p = a.malloc(30 * MiB)
    a.malloc(40 * MiB)
    a.free(p)
    with pytest.raises(SimulatedOutOfMemoryError):
        a.malloc(70 * MiB)
    assert st(a)["reserved_bytes.all.current"] == 40 * MiB
    assert a.segment_log[-1] == ("segment_free", p, 30 * MiB)


def test_empty_cache_keeps_split_segments():
    """§5.3: only unsplit free classic segments are released; small pool after large."""
    a = CachingAllocator()
    s1 = a.malloc(100)
    l1 = a.malloc(4 * MiB)
    l2 = a.malloc(4 * MiB)
    a.free(l1)
    a.free(s1)
    a.empty_cache()
    # The large segment still holds l2; the small one is free and released.
    assert [e[0] for e in a.segment_log] == ["segment_alloc", "segment_alloc", "segment_free"]
    a.free(l2)
    a.empty_cache()
    assert a.segment_log[-1] == ("segment_free", l1, 20 * MiB)
    assert st(a)["reserved_bytes.all.current"] == 0


def test_record_stream_defers_free_until_synchronize():
    """§5.1: with record_stream the free waits; allocated drops now, active later."""
    a = CachingAllocator()
    p = a.malloc(4 * MiB, stream=0)
    a.record_stream(p, 7)
    a.record_stream(p, 0)  # own stream: ignored
    a.free(p)
    s = st(a)
    assert s["allocated_bytes.all.current"] == 0
    assert s["active_bytes.all.current"] == 4 * MiB
    assert s["requested_bytes.all.current"] == 4 * MiB
    assert [b["state"] for b in a.snapshot()[0]["blocks"]] == ["active_pending_free", "inactive"]
    q = a.malloc(4 * MiB, stream=0)  # not reusable yet; the next malloc does not reap it
    assert q != p
    a.free(q)
    a.synchronize()
    s = st(a)
    assert s["active_bytes.all.current"] == 0
    assert s["num_sync_all_streams"] == 0
    assert a.malloc(4 * MiB) == p


def test_pending_free_completes_on_oom_path():
    """§4 step 9.1: the retry path synchronizes and reaps pending frees first."""
    a = CachingAllocator(capacity_bytes=40 * MiB)
    p = a.malloc(30 * MiB)
    a.record_stream(p, 3)
    a.free(p)
    q = a.malloc(30 * MiB)
    s = st(a)
    assert s["num_sync_all_streams"] == 1
    assert s["num_alloc_retries"] == 1
    # The reaped block's segment is unsplit, so Step 9 releases it before the retry.
    assert a.segment_log == [
        ("segment_alloc", p, 30 * MiB),
        ("segment_free", p, 30 * MiB),
        ("segment_alloc", q, 30 * MiB),
    ]


def test_deferred_free_and_complete_free():
    """Replay hook: free(deferred=True) stays pending until complete_free."""
    a = CachingAllocator()
    p = a.malloc(3 * MiB)
    a.free(p, deferred=True)
    assert st(a)["active.all.current"] == 1
    assert a.malloc(3 * MiB) != p
    a.complete_free(p)
    assert st(a)["active.all.current"] == 1
    with pytest.raises(AllocatorUsageError, match="no pending free"):
        a.complete_free(p)


def test_free_merges_only_event_free_neighbours():
    """§5.2: a pending neighbour does not merge; it merges once its free completes."""
    a = CachingAllocator()
    p1 = a.malloc(2 * MiB)
    p2 = a.malloc(2 * MiB)
    a.free(p1, deferred=True)
    a.free(p2)
    seg = a.snapshot()[0]
    assert [b["state"] for b in seg["blocks"]] == ["active_pending_free", "inactive"]
    a.complete_free(p1)
    seg = a.snapshot()[0]
    assert [(b["size"], b["state"]) for b in seg["blocks"]] == [(20 * MiB, "inactive")]
    assert st(a)["inactive_split.all.current"] == 0


@pytest.mark.parametrize(
    "call",
    [
        lambda a: a.malloc(-1),
        lambda a: a.malloc(1.5),
        lambda a: a.free(12345),
        lambda a: a.record_stream(12345, 1),
        lambda a: a.complete_free(12345),
        lambda a: a.set_per_process_memory_fraction(1.5),
    ],
)
def test_bad_calls_raise_usage_error_and_change_nothing(call):
    """Bad input raises AllocatorUsageError and leaves the stats unchanged."""
    a = CachingAllocator()
    p = a.malloc(5 * MiB)
    a.free(a.malloc(100))
    before = (st(a), a.snapshot(), list(a.segment_log))
    with pytest.raises(AllocatorUsageError):
        call(a)
    assert (st(a), a.snapshot(), list(a.segment_log)) == before
    a.free(p)


def test_double_free_raises():
    """Freeing twice is a usage error with a clear message."""
    a = CachingAllocator()
    p = a.malloc(100)
    a.free(p)
    with pytest.raises(AllocatorUsageError, match="not an address this allocator handed out"):
        a.free(p)


def test_peaks_and_reset():
    """§10.1: peaks move at each increase; reset_peak_memory_stats sets peak = current."""
    a = CachingAllocator()
    p = a.malloc(30 * MiB)
    a.free(p)
    assert st(a)["allocated_bytes.all.peak"] == 30 * MiB
    a.reset_peak_memory_stats()
    s = st(a)
    assert s["allocated_bytes.all.peak"] == 0
    assert s["reserved_bytes.all.peak"] == 30 * MiB
    a.reset_accumulated_memory_stats()
    s = st(a)
    assert s["allocated_bytes.all.allocated"] == 0
    assert s["reserved_bytes.all.allocated"] == 0
    assert s["num_device_alloc"] == 0
    a.malloc(MiB + 1)
    assert st(a)["allocated_bytes.all.allocated"] == MiB + 512


def test_hooks_device_malloc_and_segment_address():
    """Replay hooks: device_malloc decides success; segment_address places the segment."""
    calls = []

    def device_malloc(n: int) -> bool:
        calls.append(n)
        return len(calls) != 1

    a = CachingAllocator(device_malloc=device_malloc, segment_address=lambda size, exp: 0x1000_0000)
    assert a.malloc(5 * MiB) == 0x1000_0000
    # First try refused, Step 9 retry accepted.
    assert calls == [20 * MiB, 20 * MiB]
    assert st(a)["num_alloc_retries"] == 1


def test_synthetic_addresses_are_aligned_and_increasing():
    """Default segment addresses: 2 MiB aligned, increasing, never reused."""
    a = CachingAllocator()
    p = a.malloc(3 * MiB)
    a.free(p)
    a.empty_cache()
    q = a.malloc(3 * MiB)
    assert q > p and q % (2 * MiB) == 0 and p % (2 * MiB) == 0


def test_release_cached_blocks_without_sync():
    """release_cached_blocks is empty_cache without the synchronize."""
    a = CachingAllocator()
    p = a.malloc(3 * MiB)
    a.free(p)
    a.release_cached_blocks()
    s = st(a)
    assert s["num_sync_all_streams"] == 0
    assert s["reserved_bytes.all.current"] == 0


def test_fraction_limit_v24_applies_even_at_one():
    """§9.5 V24: set_per_process_memory_fraction(1.0) still sets a limit (allowed text)."""
    a = CachingAllocator(capacity_bytes=100 * MiB, torch_version=OLD)
    a.set_per_process_memory_fraction(1.0)
    assert a.allowed_memory_maximum == 100 * MiB
    with pytest.raises(SimulatedOutOfMemoryError, match="100.00 MiB allowed; "):
        a.malloc(200 * MiB)


def test_garbage_collection_frees_aged_blocks():
    """§7: with a limit and threshold, GC frees unsplit large blocks aged >= average."""
    a = CachingAllocator(
        AllocatorConfig(garbage_collection_threshold=0.5),
        capacity_bytes=1000 * MiB,
        torch_version=OLD,
    )
    a.set_per_process_memory_fraction(1.0)
    old = a.malloc(200 * MiB)
    young = a.malloc(200 * MiB)
    a.free(old)
    for _ in range(3):
        a.free(a.malloc(300 * MiB))  # each lookup ticks the large clock
    a.free(young)
    # total 700 MiB > 500 MiB limit: GC runs on the next large miss (clock 6). Freeable: old
    # (freed at clock 2: age 4), the 300 MiB block and young (freed at clock 5: age 1);
    # avg 2: only `old` is >= avg and freeing it reaches the 200 MiB target.
    a.malloc(400 * MiB)
    frees = [e for e in a.segment_log if e[0] == "segment_free"]
    assert frees == [("segment_free", old, 200 * MiB)]


def test_gc_needs_a_limit():
    """§7: without a fraction limit GC never runs."""
    a = CachingAllocator(AllocatorConfig(garbage_collection_threshold=0.1))
    p = a.malloc(100 * MiB)
    a.free(p)
    a.malloc(200 * MiB)
    assert [e[0] for e in a.segment_log] == ["segment_alloc", "segment_alloc"]
    assert not a.gc_enabled


def test_runtime_settings_reset_max_split():
    """§9.1: _set_allocator_settings resets unmentioned max_split_size to unlimited."""
    a = CachingAllocator(AllocatorConfig(max_split_size_bytes=100 * MiB))
    a.set_allocator_settings("garbage_collection_threshold:0.5")
    assert a.config.max_split_size_bytes is None
    p = a.malloc(200 * MiB)
    a.free(p)
    assert a.malloc(50 * MiB) == p  # oversize rules are off again


def test_reserved_outside_counts_against_capacity():
    """Our convention: reserved + reserved_outside + alloc_size <= capacity."""
    a = CachingAllocator(capacity_bytes=100 * MiB, reserved_outside_bytes=70 * MiB)
    with pytest.raises(SimulatedOutOfMemoryError, match="of which 30.00 MiB is free"):
        a.malloc(40 * MiB)


def test_stream_must_be_int():
    """Streams compare by value; a non-int stream is a usage error."""
    with pytest.raises(AllocatorUsageError, match="stream must be an int"):
        CachingAllocator().malloc(10, stream="s")  # type: ignore[arg-type]

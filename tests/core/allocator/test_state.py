"""seed_segment and snapshot (ref §11.2, §15.1)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oomkit.core.allocator import AllocatorConfig, CachingAllocator
from oomkit.core.allocator.state import check_seed_segments
from oomkit.errors import AllocatorUsageError

MiB = 2**20
BASE = 0x7000_0000_0000


def test_seed_classic_segment_counts_in_stats_and_is_reused():
    """Seeded blocks count in current stats and peaks; free seeded blocks serve requests."""
    a = CachingAllocator()
    a.seed_segment(
        BASE,
        20 * MiB,
        0,
        is_small=False,
        blocks=[(BASE, 4 * MiB, 4_000_000, True), (BASE + 4 * MiB, 16 * MiB, 0, False)],
    )
    s = a.memory_stats()
    assert s["reserved_bytes.large_pool.current"] == 20 * MiB
    assert s["reserved_bytes.all.peak"] == 20 * MiB
    assert s["allocated_bytes.all.current"] == 4 * MiB
    assert s["requested_bytes.all.current"] == 4_000_000
    assert s["segment.all.current"] == 1
    assert s["inactive_split.all.current"] == 1
    assert s["inactive_split_bytes.all.current"] == 16 * MiB
    assert a.malloc(3 * MiB) == BASE + 4 * MiB
    assert a.segment_log == []
    a.free(BASE)
    snap = a.snapshot()
    assert [b["state"] for b in snap[0]["blocks"]] == ["inactive", "active_allocated", "inactive"]


def test_synthetic_addresses_stay_above_seeded_segments():
    """New synthetic segments never overlap seeded ones."""
    a = CachingAllocator()
    high = 0x7F10_0000_0000
    a.seed_segment(high, 2 * MiB, 0, is_small=True, blocks=[(high, 2 * MiB, 0, False)])
    p = a.malloc(5 * MiB)
    assert p >= high + 2 * MiB


@pytest.mark.parametrize(
    "blocks",
    [
        [],
        [(BASE, 2 * MiB, 0, True)],  # does not cover the segment
        [(BASE + 512, 20 * MiB, 0, True)],  # does not start at the segment
        [(BASE, 10 * MiB, 0, False), (BASE + 10 * MiB, 10 * MiB, 0, False)],  # unmerged
    ],
)
def test_bad_seed_is_rejected(blocks):
    """Blocks must tile the segment with free neighbours merged."""
    a = CachingAllocator()
    with pytest.raises(AllocatorUsageError, match="seed_segment"):
        a.seed_segment(BASE, 20 * MiB, 0, is_small=False, blocks=blocks)
    assert a.memory_stats()["reserved_bytes.all.current"] == 0


def test_seed_overlap_is_rejected():
    """A seeded range may not overlap memory the allocator holds."""
    a = CachingAllocator()
    a.seed_segment(BASE, 2 * MiB, 0, is_small=True, blocks=[(BASE, 2 * MiB, 0, False)])
    with pytest.raises(AllocatorUsageError, match="overlaps"):
        a.seed_segment(BASE, 2 * MiB, 0, is_small=True, blocks=[(BASE, 2 * MiB, 0, False)])


def test_snapshot_shape():
    """Segment and block dicts carry torch's _snapshot() keys."""
    a = CachingAllocator()
    a.malloc(1000, stream=5)
    (seg,) = a.snapshot()
    assert {
        "device",
        "address",
        "total_size",
        "stream",
        "segment_type",
        "allocated_size",
        "active_size",
        "requested_size",
        "is_expandable",
        "blocks",
    } <= set(seg)
    assert seg["segment_type"] == "small" and seg["stream"] == 5
    assert seg["requested_size"] == 1000 and seg["allocated_size"] == 1024
    assert set(seg["blocks"][0]) >= {"address", "size", "requested_size", "state"}


def test_public_names_import():
    """Every name in oomkit.core.allocator.__all__ imports."""
    import oomkit.core.allocator as mod

    for name in mod.__all__:
        assert getattr(mod, name) is not None


@pytest.mark.parametrize(
    ("address", "total_size", "stream", "message"),
    [
        ("0x7000", 2 * MiB, 0, "address must be a positive int; got '0x7000'"),
        (BASE, 2.0 * MiB, 0, "total_size must be a positive int; got 2097152.0"),
        (BASE, 2 * MiB, "0", "stream must be an int; got '0'"),
    ],
)
def test_seed_segment_of_the_wrong_type_is_a_usage_error(address, total_size, stream, message):
    """Arguments of the wrong type get seed_segment's own AllocatorUsageError, on the compiled
    build too (scripts/compile_allocator.py gives the compiled copy Any arguments there)."""
    a = CachingAllocator()
    with pytest.raises(AllocatorUsageError, match=message.replace(".", r"\.")):
        a.seed_segment(
            address, total_size, stream, is_small=True, blocks=[(BASE, 2 * MiB, 0, False)]
        )
    assert a.memory_stats()["segment.all.current"] == 0


def _blocks_left_to_the_collector(build) -> list[str]:
    """Type names of the allocator objects a garbage collection finds after ``build()``'s
    allocator is dropped (the collector paused meanwhile)."""
    import gc

    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        build()
        gc.collect()
        found = [type(o).__name__ for o in gc.garbage]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if was_enabled:
            gc.enable()
    return [name for name in found if name in ("Block", "Segment")]


def test_close_frees_every_block_and_segment_without_a_garbage_collection():
    """Blocks link both ways, so a dropped allocator's blocks wait for a collection; after
    close() reference counting frees them (a replay closes its allocator, issue 41)."""
    from oomkit.core.allocator import CachingAllocator

    def used(close: bool) -> None:
        a = CachingAllocator(capacity_bytes=2**30)
        ptrs = [a.malloc(n) for n in (1000, 3 * 2**20, 5000, 30 * 2**20, 700)]
        a.free(ptrs[0])
        a.free(ptrs[3], deferred=True)
        assert len(a.snapshot()) == 3  # a small, a large and an oversize-for-20-MiB segment
        if close:
            a.close()

    assert _blocks_left_to_the_collector(lambda: used(close=False)).count("Block") >= 5
    assert _blocks_left_to_the_collector(lambda: used(close=True)) == []


# ------------------------------------------------------------------ seed_segments (batched stats)


def _segment_specs(draw_sizes: list[tuple[int, bool, int]]) -> list[tuple]:
    """Segments one after another from BASE: (total MiB, small, live blocks), each tiled by
    live 1 MiB blocks (every other one allocated) and one free tail."""
    specs = []
    address = BASE
    for total_mib, small, live in draw_sizes:
        total = 2 * MiB if small else total_mib * MiB
        blocks = []
        cursor = address
        for k in range(min(live, total // MiB - 1)):
            blocks.append((cursor, MiB, MiB - 512 * k, True))
            cursor += MiB
        blocks.append((cursor, address + total - cursor, 0, False))
        specs.append((address, total, 0, small, blocks, False))
        address += total + 2 * MiB
    return specs


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(4, 40), st.booleans(), st.integers(0, 5)), min_size=1, max_size=12
    ),
    st.sampled_from(["", "max_split_size_mb:20"]),
)
def test_seed_segments_equals_one_seed_segment_call_each(sizes, config):
    """seed_segments applies its stat increases once at the end: the same stats (currents and
    peaks), blocks and later decisions as one seed_segment call per segment."""
    specs = _segment_specs(sizes)

    def after(batch: bool) -> tuple:
        a = CachingAllocator(AllocatorConfig.parse(config))
        a.malloc(3 * MiB)  # a peak from before the seeding
        a.free(a.malloc(30 * MiB))
        if batch:
            assert a.seed_segments(specs) == [None] * len(specs)
        else:
            for address, total, stream, small, blocks, expandable in specs:
                a.seed_segment(
                    address, total, stream, is_small=small, blocks=blocks, expandable=expandable
                )
        stats = a.memory_stats()
        a.malloc(MiB)
        return stats, a.snapshot(), a.memory_stats()

    assert after(True) == after(False)


def test_seed_segments_reports_the_refused_one_and_seeds_the_rest():
    """A segment seed_segment refuses is reported by seed_segments, in place, and left out of
    the stats; the others are seeded."""
    a = CachingAllocator()
    good = (BASE, 20 * MiB, 0, False, [(BASE, 20 * MiB, 0, False)], False)
    overlapping = (BASE + 2 * MiB, 2 * MiB, 0, True, [(BASE + 2 * MiB, 2 * MiB, 0, False)], False)
    refused = a.seed_segments([good, overlapping])
    assert refused[0] is None
    assert isinstance(refused[1], AllocatorUsageError)
    assert "overlaps" in str(refused[1])
    stats = a.memory_stats()
    assert stats["reserved_bytes.all.current"] == 20 * MiB
    assert stats["reserved_bytes.all.peak"] == 20 * MiB
    assert stats["segment.all.current"] == 1


def test_seed_segments_with_checks_computed_once_seeds_the_same():
    """check_seed_segments once, then seed_segments(..., checks) per allocator (a replayed start
    state): the same refusals, in place (a malformed segment's own error, an overlap found at
    seeding), the same stats and blocks as checking at each seeding."""
    tiles = [(BASE, 4 * MiB, 4 * MiB, True), (BASE + 4 * MiB, 16 * MiB, 0, False)]
    good = (BASE, 20 * MiB, 0, False, tiles, False)
    gap = (BASE + 40 * MiB, 4 * MiB, 0, False, [(BASE + 40 * MiB, 2 * MiB, 0, False)], False)
    overlapping = (BASE + 2 * MiB, 2 * MiB, 0, True, [(BASE + 2 * MiB, 2 * MiB, 0, False)], False)
    small = (BASE + 60 * MiB, 2 * MiB, 0, True, [(BASE + 60 * MiB, 2 * MiB, 512, True)], False)
    specs = [good, gap, overlapping, small]
    checks = check_seed_segments(specs)
    assert checks[0] is None and checks[2] is None and checks[3] is None
    assert isinstance(checks[1], AllocatorUsageError)
    assert "cover 2097152 bytes but total_size is 4194304" in str(checks[1])

    def seeded(with_checks: bool) -> tuple:
        a = CachingAllocator()
        refused = a.seed_segments(specs, checks if with_checks else None)
        return [None if e is None else str(e) for e in refused], a.memory_stats(), a.snapshot()

    again = seeded(True)
    assert again == seeded(False)
    assert again[0][0] is None and again[0][3] is None
    assert "overlaps" in again[0][2]
    assert again[1]["reserved_bytes.all.current"] == 22 * MiB
    assert again[1]["allocated_bytes.all.current"] == 4 * MiB + 2 * MiB

"""Rebuilding the allocator state at a trace's first event (ref §15.1, §15.2)."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from oomkit.core.allocator import round_size
from oomkit.core.replay.reconstruct import (
    SeedBlock,
    SeedSegment,
    layout_segment,
    reconstruct_start_state,
)
from oomkit.core.trace import TraceEvent

MiB = 2**20
BASE = 0x7F00_0000_0000


def seg(address, size, blocks=(), *, small=False, expandable=False, stream=0):
    return SeedSegment(address, size, stream, small, expandable, tuple(blocks))


def live(address, size, requested=None, state="active_allocated"):
    return SeedBlock(address, size, size if requested is None else requested, state)


def ev(action, address, size, stream=0):
    return TraceEvent(action=action, address=address, size=size, stream=stream)


def tiles(segment):
    return [(b.address - segment.address, b.size, b.state) for b in segment.blocks]


def test_no_trace_keeps_the_final_state_and_fills_gaps():
    """Without events the start is the final state; gaps between live blocks become free blocks."""
    final = [seg(BASE, 20 * MiB, [live(BASE + 2 * MiB, 4 * MiB)])]
    start = reconstruct_start_state(final, (), round_size)
    assert [tiles(s) for s in start.segments] == [
        [(0, 2 * MiB, "inactive"), (2 * MiB, 4 * MiB, "active_allocated"),
         (6 * MiB, 14 * MiB, "inactive")]
    ]
    assert start.hidden_blocks == 0 and start.warnings == ()


def test_allocs_in_the_trace_are_removed_and_segment_events_undone():
    """Walking back, an alloc removes its block, segment_alloc removes and segment_free re-adds."""
    s1, s2, s3 = BASE, BASE + 20 * MiB, BASE + 40 * MiB
    final = [seg(s1, 20 * MiB, [live(s1, 4 * MiB), live(s1 + 4 * MiB, 4 * MiB)]),
             seg(s2, 20 * MiB, [live(s2, 6 * MiB)])]
    events = [
        ev("segment_free", s3, 2 * MiB),  # released before: existed at the start, small
        ev("alloc", s1 + 4 * MiB, 4 * MiB),
        ev("segment_alloc", s2, 20 * MiB),
        ev("alloc", s2, 6 * MiB),
    ]
    start = reconstruct_start_state(final, events, round_size)
    assert [(s.address, s.total_size, s.is_small) for s in start.segments] == [
        (s1, 20 * MiB, False), (s3, 2 * MiB, True)
    ]
    assert tiles(start.segments[0]) == [(0, 4 * MiB, "active_allocated"),
                                        (4 * MiB, 16 * MiB, "inactive")]
    assert tiles(start.segments[1]) == [(0, 2 * MiB, "inactive")]


def test_block_freed_during_the_trace_is_live_at_the_start_with_its_rounded_size():
    """A free of a block the trace never allocated puts it back, sized round_size(request)."""
    final = [seg(BASE, 20 * MiB)]
    events = [ev("free_requested", BASE, 3 * MiB - 100), ev("free_completed", BASE, 3 * MiB - 100)]
    start = reconstruct_start_state(final, events, round_size)
    assert tiles(start.segments[0]) == [(0, 3 * MiB, "active_allocated"),
                                        (3 * MiB, 17 * MiB, "inactive")]
    assert start.segments[0].blocks[0].requested_size == 3 * MiB - 100
    assert start.hidden_blocks == 1


def test_lone_free_completed_means_pending_at_the_start():
    """A free_completed whose free_requested came before recording leaves the block pending."""
    final = [seg(BASE, 2 * MiB, small=True)]
    start = reconstruct_start_state(final, [ev("free_completed", BASE, 1000)], round_size)
    assert tiles(start.segments[0]) == [(0, 1024, "active_pending_free"),
                                        (1024, 2 * MiB - 1024, "inactive")]


def test_hidden_block_takes_a_gap_of_at_most_one_mib_after_it():
    """A large-pool gap <= 1 MiB cannot be a free block, so it is the hidden block's leftover."""
    # A 19.5 MiB request in a 20 MiB segment: 512 KiB leftover, not split (§4 Step 11).
    final = [seg(BASE, 20 * MiB)]
    req = 19 * MiB + 512 * 1024
    events = [ev("free_requested", BASE, req), ev("free_completed", BASE, req)]
    start = reconstruct_start_state(final, events, round_size)
    assert tiles(start.segments[0]) == [(0, 20 * MiB, "active_allocated")]


def test_hidden_block_gap_before_a_live_block_is_also_taken():
    """The <= 1 MiB rule applies before the next live block, not only at the segment end."""
    final = [seg(BASE, 40 * MiB, [live(BASE + 10 * MiB, 30 * MiB)])]
    req = 9 * MiB + 1
    events = [ev("free_requested", BASE, req), ev("free_completed", BASE, req)]
    start = reconstruct_start_state(final, events, round_size)
    assert tiles(start.segments[0])[0] == (0, 10 * MiB, "active_allocated")


def test_small_pool_hidden_block_is_exactly_its_rounded_size():
    """Small-pool blocks always split off leftovers, so the rounded size is exact."""
    final = [seg(BASE, 2 * MiB, small=True, blocks=[live(BASE + 4096, 512)])]
    events = [ev("free_requested", BASE, 3000), ev("free_completed", BASE, 3000)]
    start = reconstruct_start_state(final, events, round_size)
    assert tiles(start.segments[0])[:2] == [(0, 3072, "active_allocated"), (3072, 1024, "inactive")]


def test_later_alloc_inside_the_gap_reveals_the_hidden_boundary():
    """An alloc inside the assumed free gap, while the hidden block lives, marks its true end."""
    final = [seg(BASE, 40 * MiB, [live(BASE + 5 * MiB, 5 * MiB)])]
    events = [
        # The hidden block's request rounds to 4 MiB, but it took a cached 5 MiB block whole
        # (a 1 MiB leftover is not split): the next block starts at +5 MiB.
        ev("alloc", BASE + 5 * MiB, 5 * MiB),
        ev("free_requested", BASE, 4 * MiB),
        ev("free_completed", BASE, 4 * MiB),
    ]
    start = reconstruct_start_state(final, events, round_size)
    assert tiles(start.segments[0]) == [(0, 5 * MiB, "active_allocated"),
                                        (5 * MiB, 35 * MiB, "inactive")]


def test_allocs_after_the_hidden_block_is_freed_reveal_nothing():
    """Once the hidden block is free, allocations inside its old range say nothing about it."""
    final = [seg(BASE, 40 * MiB, [live(BASE + 6 * MiB, 3 * MiB)])]
    events = [
        ev("free_requested", BASE, 4 * MiB),
        ev("free_completed", BASE, 4 * MiB),
        ev("alloc", BASE + 6 * MiB, 3 * MiB),
    ]
    start = reconstruct_start_state(final, events, round_size)
    assert tiles(start.segments[0])[0] == (0, 4 * MiB, "active_allocated")


def test_released_expandable_range_is_mapped_again_at_the_start():
    """Walking back over segment_unmap re-maps the range; segment_map unmaps it."""
    final = [seg(BASE, 20 * MiB, [live(BASE, 5 * MiB)], expandable=True)]
    events = [
        ev("segment_unmap", BASE + 20 * MiB, 40 * MiB),
        ev("segment_map", BASE + 20 * MiB, 20 * MiB),
        ev("segment_unmap", BASE + 20 * MiB, 20 * MiB),
    ]
    start = reconstruct_start_state(final, events, round_size)
    assert [(s.address, s.total_size, s.expandable, s.is_small) for s in start.segments] == [
        (BASE, 60 * MiB, True, False)
    ]
    assert tiles(start.segments[0]) == [(0, 5 * MiB, "active_allocated"),
                                        (5 * MiB, 55 * MiB, "inactive")]


def test_layout_segment_merges_free_gaps_into_one_block():
    """Free blocks given explicitly are replaced by one block per gap."""
    s = seg(BASE, 8 * MiB, [SeedBlock(BASE, MiB, 0, "inactive"), SeedBlock(BASE + MiB, MiB, 0,
            "inactive"), live(BASE + 4 * MiB, 2 * MiB)])
    assert tiles(layout_segment(s)) == [(0, 4 * MiB, "inactive"), (4 * MiB, 2 * MiB,
                                        "active_allocated"), (6 * MiB, 2 * MiB, "inactive")]


def test_inconsistent_trace_warns_instead_of_failing():
    """An alloc whose block is absent later is reported, not raised."""
    start = reconstruct_start_state([seg(BASE, 20 * MiB)], [ev("alloc", BASE, 4 * MiB)],
                                    round_size)
    assert len(start.warnings) == 1 and "no matching live block" in start.warnings[0]


_SEGMENT_OFFSETS = (0, 20 * MiB, 40 * MiB)


@settings(max_examples=200, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(["classic", "small", "expandable"]), min_size=1, max_size=3),
    states=st.lists(st.sampled_from(["active_allocated", "active_pending_free", "inactive"]),
                    min_size=12, max_size=12),
    entries=st.lists(
        st.tuples(
            st.sampled_from(["alloc", "free_requested", "free_completed", "segment_alloc",
                             "segment_free", "segment_map", "segment_unmap", "oom"]),
            st.integers(0, 2),
            st.integers(0, 3),
        ),
        max_size=20,
    ),
)
def test_final_segments_give_their_place_not_their_blocks(kinds, states, entries):
    """The start state is the same whether the final segments list their free blocks or only
    their live ones: a final segment reaches it through its place and size and its live blocks'
    facts, never through its own block list (the walk keeps the final records themselves,
    issue 41)."""
    final = []
    for k, kind in enumerate(kinds):
        address = BASE + _SEGMENT_OFFSETS[k]
        size = 2 * MiB if kind == "small" else 20 * MiB
        step = size // 4
        blocks = [SeedBlock(address + j * step, step, step - 1, states[4 * k + j]) for j in range(4)]
        final.append(seg(address, size, blocks, small=kind == "small",
                         expandable=kind == "expandable"))
    events = [
        ev(action, BASE + _SEGMENT_OFFSETS[s] + (j * MiB // 2 if action.startswith(("alloc", "free")) else 0),
           MiB // 2 if action.startswith(("alloc", "free")) else 20 * MiB)
        for action, s, j in entries
    ]
    live_only = [replace(s, blocks=tuple(b for b in s.blocks if b.state != "inactive")) for s in final]
    full = reconstruct_start_state(final, events, round_size)
    assert full == reconstruct_start_state(live_only, events, round_size)
    for s in full.segments:
        assert sum(b.size for b in s.blocks) == s.total_size
        assert [b.address for b in s.blocks] == sorted(b.address for b in s.blocks)

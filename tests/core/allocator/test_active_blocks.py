"""The allocator's active blocks (active_blocks.py): a list with each block's place, and a map by
address made only when something asks by address (issue 41)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from oomkit.core.allocator import CachingAllocator
from oomkit.core.allocator.active_blocks import ActiveBlocks
from oomkit.core.allocator.block import Block, Segment
from oomkit.core.allocator.pools import BlockPool
from oomkit.core.replay.engine import ReplayEngine
from oomkit.core.trace import TraceEvent

MiB = 2**20


def _blocks(count: int) -> list[Block]:
    segment = Segment(0x1000000, count * 512, 0, True, 0, pool=BlockPool(True, False))
    return [Block(0x1000000 + 512 * i, 512, 0, segment) for i in range(count)]


def _check(active: ActiveBlocks, expected: set[int]) -> None:
    """``active`` holds exactly the blocks whose ids are ``expected``, each at its index."""
    assert {id(b) for b in active.blocks} == expected
    assert len(active) == len(expected)
    assert all(b.active_index == i for i, b in enumerate(active.blocks))
    if active.by_address is not None:
        assert active.by_address == {b.ptr: b for b in active.blocks}


def test_removing_moves_the_last_block_into_the_hole():
    a, b, c, d = _blocks(4)
    active = ActiveBlocks()
    for block in (a, b, c, d):
        active.add(block)
    active.remove(b)
    assert active.blocks == [a, d, c]
    assert (b.active_index, d.active_index) == (-1, 1)
    active.remove(c)  # the last one: nothing moves
    assert active.blocks == [a, d]
    assert c.active_index == -1
    assert active.by_address is None


def test_the_map_is_made_by_the_first_lookup_and_kept_after():
    a, b, c = _blocks(3)
    active = ActiveBlocks()
    active.add(a)
    active.add(b)
    assert active.by_address is None
    assert active.get(b.ptr) is b
    assert active.by_address == {a.ptr: a, b.ptr: b}
    active.add(c)
    active.remove(a)
    assert active.by_address == {b.ptr: b, c.ptr: c}
    assert a.ptr not in active and c.ptr in active
    assert active.get("not an address") is None
    active.clear()
    assert (len(active), active.by_address, b.active_index) == (0, None, -1)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.booleans(), st.integers(1, 12 * MiB), st.integers(0, 10**6)), max_size=80),
    st.integers(0, 80),
)
def test_served_blocks_keep_the_list_exact_and_the_map_unmade_until_asked(program, ask_at):
    """serve_block / free_served (the replay's calls) never make the map; a free(ptr) makes it,
    and from then on it follows every malloc and free."""
    allocator = CachingAllocator()
    active = allocator.active_blocks
    live: list[Block] = []
    asked = False
    for step, (alloc, size, pick) in enumerate(program):
        if step >= ask_at and not asked and live:
            allocator.free(live.pop(pick % len(live)).ptr)
            asked = True
        elif alloc or not live:
            live.append(allocator.serve_block(size, 0))
        else:
            allocator.free_served(live.pop(pick % len(live)))
        assert (active.by_address is not None) == asked
        _check(active, {id(b) for b in live})
    assert allocator.memory_stats()["active.all.current"] == len(live)


def test_a_replay_never_makes_the_map():
    """The replay loop hands blocks back itself: no map by address, and the seeded blocks it
    holds are found without one."""
    allocator = CachingAllocator()
    allocator.seed_segment(
        0x200000, 2 * MiB, 0, is_small=True, blocks=[(0x200000, 4096, 4096, True),
                                                    (0x201000, 2 * MiB - 4096, 0, False)]
    )
    engine = ReplayEngine(allocator, deferred_frees=True)
    engine.hold_seeded([(0x200000, False)])
    events = [
        TraceEvent("alloc", 0x201000, 8192),
        TraceEvent("free_requested", 0x200000, 4096),
        TraceEvent("free_completed", 0x200000, 4096),
        TraceEvent("alloc", 0x200000, 512),
    ]
    engine.run(events)
    assert allocator.active_blocks.by_address is None
    # The 512 B request takes the best fit, the freed seeded block of 4096 B at 0x200000.
    assert sorted(engine.live.values()) == [0x200000, 0x201000]
    assert sorted(b.ptr for b in allocator.active_blocks.values()) == [0x200000, 0x201000]

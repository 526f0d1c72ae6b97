"""PendingFrees: event queues of frees that wait (ref §5.1, §4 step 9.1)."""

from __future__ import annotations

import pytest

from oomkit.core.allocator.block import Block, Segment
from oomkit.core.allocator.pending_frees import PendingFrees
from oomkit.core.allocator.pools import BlockPool
from oomkit.core.allocator.private_pools import PrivatePool
from oomkit.core.allocator.stats import AllocatorStats
from oomkit.errors import AllocatorUsageError

MiB = 2**20


def _setup():
    freed: list[int] = []
    active: dict[int, Block] = {}
    stats = AllocatorStats()
    events = PendingFrees(active, lambda block: freed.append(block.ptr), stats)
    pool = BlockPool(False, by_counter=False)
    segment = Segment(0x1000, 8 * MiB, 0, False, 0, pool=pool)

    def block(ptr: int, allocated: bool = True) -> Block:
        b = Block(ptr, MiB, 0, segment)
        b.allocated = allocated
        active[ptr] = b
        return b

    return events, stats, freed, block


def test_record_stream_then_insert_waits_on_each_stream():
    """insert_events: one event per used stream (not the allocation stream) and one if deferred."""
    events, _, freed, block = _setup()
    b = block(0x1000)
    events.record_stream(0x1000, 0)  # the allocation stream: ignored
    events.record_stream(0x1000, 5)
    events.record_stream(0x1000, 2)
    assert b.stream_uses == {2, 5}
    b.allocated = False
    events.insert(b, deferred=True)
    assert (b.event_count, b.stream_uses) == (3, None)
    events.complete_free(0x1000)
    assert (b.event_count, freed) == (0, [0x1000])


def test_complete_all_frees_in_stream_then_event_order():
    """synchronize: queues in creation order, blocks in event order; freed once all events end."""
    events, stats, freed, block = _setup()
    a, b, c = block(0x1000), block(0x2000), block(0x3000)
    b.stream_uses = {4}
    c.stream_uses = {4, 7}
    for blk in (b, a, c):
        blk.allocated = False
        events.insert(blk, deferred=blk is a)
    events.complete_all()
    # Queues: stream 4 (b, c), deferred (a), stream 7 (c): c's last event is on stream 7.
    assert freed == [0x2000, 0x1000, 0x3000]
    assert stats.num_sync_all_streams == 0
    events.synchronize_and_free()
    assert stats.num_sync_all_streams == 1


def test_synchronize_pool_frees_only_that_pools_blocks():
    """synchronize_and_free_events(context, pool): other blocks keep waiting."""
    events, stats, freed, block = _setup()
    private = PrivatePool((0, 1), by_counter=False)
    default_block = block(0x1000)
    private_block = Block(0x9000, MiB, 0, Segment(0x9000, MiB, 0, False, 1, pool=private.large))
    for blk in (default_block, private_block):
        blk.allocated = False
        events.insert(blk, deferred=True)
    events.synchronize_pool(private)
    assert freed == [0x9000]
    assert stats.num_sync_all_streams == 1
    assert default_block.event_count == 1


def test_usage_errors_say_what_to_do():
    """record_stream on a freed pointer and complete_free without a pending free are refused."""
    events, _, _, block = _setup()
    block(0x1000, allocated=False)
    with pytest.raises(AllocatorUsageError, match="already freed"):
        events.record_stream(0x1000, 1)
    with pytest.raises(AllocatorUsageError, match="not an address this allocator handed out"):
        events.record_stream(0x7777, 1)
    with pytest.raises(AllocatorUsageError, match="has no pending free"):
        events.complete_free(0x1000)

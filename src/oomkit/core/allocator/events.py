"""Pending frees: the per-stream event queues of blocks whose free waits (ref §5.1, §4 step 9.1).

Mirrors ``cuda_events``, ``insert_events`` and the event completion of ``process_events`` /
``synchronize_and_free_events`` in CUDACachingAllocator.cpp. Completion returns the blocks whose
last event finished; the allocator then frees them (free_block) in that order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from oomkit.core.allocator.block import Block

if TYPE_CHECKING:
    from oomkit.core.allocator.private_pools import PrivatePool

__all__ = ["PendingFrees"]

# Key of the event queue that holds deferred frees (free(ptr, deferred=True)).
_DEFERRED = object()


class PendingFrees:
    """Per stream (and one queue for deferred frees), the blocks waiting on an event there (FIFO)."""

    __slots__ = ("_queues",)

    def __init__(self) -> None:
        self._queues: dict[object, dict[int, Block]] = {}

    def insert(self, block: Block, deferred: bool) -> None:
        """insert_events: one event per stream in stream_uses, plus one for a deferred free."""
        uses = block.stream_uses
        block.stream_uses = None
        queues = self._queues
        ptr = block.ptr
        if uses:
            for st in sorted(uses):
                queues.setdefault(st, {})[ptr] = block
                block.event_count += 1
        if deferred:
            queues.setdefault(_DEFERRED, {})[ptr] = block
            block.event_count += 1

    def complete(self, block: Block) -> None:
        """Every event of ``block`` completed (the trace's ``free_completed``)."""
        queues = self._queues
        ptr = block.ptr
        for key in list(queues):
            queue = queues[key]
            if queue.pop(ptr, None) is not None and not queue:
                del queues[key]
        block.event_count = 0

    def complete_all(self) -> list[Block]:
        """Every outstanding event completes, stream by stream in event order.

        Returns:
            The blocks whose last event completed, in the order their frees finish.
        """
        queues = self._queues
        self._queues = {}
        done: list[Block] = []
        for queue in queues.values():
            for block in queue.values():
                block.event_count -= 1
                if block.event_count == 0:
                    done.append(block)
        return done

    def complete_pool(self, pool: PrivatePool) -> list[Block]:
        """synchronize_and_free_events(context, pool): only the events of this pool's blocks.

        Returns:
            The blocks whose last event completed, in the order their frees finish.
        """
        queues = self._queues
        done: list[Block] = []
        for key in list(queues):
            queue = queues[key]
            for ptr, block in list(queue.items()):
                if block.segment.pool.owner is not pool:
                    continue
                del queue[ptr]
                block.event_count -= 1
                if block.event_count == 0:
                    done.append(block)
            if not queue:
                del queues[key]
        return done

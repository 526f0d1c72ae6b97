"""Pending frees: the per-stream event queues of blocks whose free waits (ref §5.1, §4 step 9.1).

Mirrors ``cuda_events``, ``insert_events`` and the event completion of ``process_events`` /
``synchronize_and_free_events`` in CUDACachingAllocator.cpp. A block whose last event completes
is handed to the allocator's free_block.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from oomkit.core.allocator.active_blocks import ActiveBlocks
from oomkit.core.allocator.block import Block
from oomkit.core.allocator.stats import AllocatorStats
from oomkit.errors import AllocatorUsageError

if TYPE_CHECKING:
    from oomkit.core.allocator.private_pools import PrivatePool

__all__ = ["PendingFrees", "not_live_message"]

# Key of the event queue that holds deferred frees (free(ptr, deferred=True)).
_DEFERRED = object()


def not_live_message(active: ActiveBlocks, ptr: object, what: str) -> str:
    """The error message for a ``ptr`` that is not a live allocation."""
    if isinstance(ptr, int) and ptr in active:
        return (
            f"{what}: address {ptr:#x} was already freed (its free is still pending). "
            "Each allocation may be freed once."
        )
    shown = f"{ptr:#x}" if isinstance(ptr, int) else repr(ptr)
    return (
        f"{what}: {shown} is not an address this allocator handed out, or it was already "
        "freed (PyTorch: 'invalid device pointer'). Pass the value malloc() returned."
    )


class PendingFrees:
    """Per stream (and one queue for deferred frees), the blocks waiting on an event there (FIFO).

    Args:
        active: the allocator's active blocks.
        free_block: the allocator's free_block (§5.2), called when a block's last event completes.
        stats: the allocator's stats (``num_sync_all_streams``).
    """

    __slots__ = ("_queues", "_active", "_free_block", "_stats")

    def __init__(
        self, active: ActiveBlocks, free_block: Callable[[Block], None], stats: AllocatorStats
    ) -> None:
        self._queues: dict[object, dict[int, Block]] = {}
        self._active = active
        self._free_block = free_block
        self._stats = stats

    def forget(self) -> None:
        """Drop every queue (the allocator's ``close``: nothing completes after it)."""
        self._queues.clear()

    def record_stream(self, ptr: int, stream: int) -> None:
        """recordStream: the block was used on ``stream``; its free will wait for it (§5.1).

        Raises:
            AllocatorUsageError: ``ptr`` is not a live allocation, or ``stream`` is not an int.
        """
        block = self._active.get(ptr)
        if block is None or not block.allocated:
            raise AllocatorUsageError(not_live_message(self._active, ptr, "record_stream"))
        if type(stream) is not int:
            raise AllocatorUsageError(f"stream must be an int; got {stream!r}.")
        if stream == block.stream:
            # Uses on the allocation stream need no synchronization.
            return
        if block.stream_uses is None:
            block.stream_uses = {stream}
        else:
            block.stream_uses.add(stream)

    def complete_free(self, ptr: int) -> None:
        """All events of a pending free completed (the trace's ``free_completed``); free it.

        Raises:
            AllocatorUsageError: ``ptr`` has no pending free.
        """
        self.complete_block(self._active.get(ptr), ptr)

    def complete_block(self, block: Block | None, ptr: object) -> None:
        """:meth:`complete_free` of the block found at ``ptr`` (None: none there).

        Raises:
            AllocatorUsageError: the block has no pending free.
        """
        if block is None or block.allocated or not block.event_count:
            shown = f"{ptr:#x}" if isinstance(ptr, int) else repr(ptr)
            raise AllocatorUsageError(
                f"complete_free: {shown} has no pending free. Call free(ptr, deferred=True) "
                "or record_stream() before free() first."
            )
        self._complete(block)

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

    def _complete(self, block: Block) -> None:
        queues = self._queues
        ptr = block.ptr
        for key in list(queues):
            queue = queues[key]
            if queue.pop(ptr, None) is not None and not queue:
                del queues[key]
        block.event_count = 0
        self._free_block(block)

    def complete_all(self) -> None:
        """Every outstanding event completes, stream by stream in event order."""
        queues = self._queues
        self._queues = {}
        free_block = self._free_block
        for queue in queues.values():
            for block in queue.values():
                block.event_count -= 1
                if block.event_count == 0:
                    free_block(block)

    def synchronize_and_free(self) -> None:
        """synchronize_and_free_events (§4 step 9.1): counted in ``num_sync_all_streams``."""
        self._stats.num_sync_all_streams += 1
        self.complete_all()

    def synchronize_pool(self, pool: PrivatePool) -> None:
        """synchronize_and_free_events(context, pool): only the events of this pool's blocks."""
        self._stats.num_sync_all_streams += 1
        queues = self._queues
        for key in list(queues):
            queue = queues[key]
            for ptr, block in list(queue.items()):
                if block.segment.pool.owner is not pool:
                    continue
                del queue[ptr]
                block.event_count -= 1
                if block.event_count == 0:
                    self._free_block(block)
            if not queue:
                del queues[key]

"""Blocks and segments (ref §3.1-§3.2, CUDACachingAllocator.cpp ``Block``, ``ExpandableSegment``).

Plain ``__slots__`` classes: the simulator creates and touches them on every malloc and free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from oomkit.core.allocator.pools import BlockPool

__all__ = ["Block", "Segment"]


class Segment:
    """One backing allocation: a cudaMalloc'd range, or an expandable VA reservation (§3.1, §8.1).

    For an expandable segment ``size`` is the whole reservation and ``mapped_pages`` records
    which pages of ``page_size`` bytes are backed by physical memory. ``pool`` is the owning
    ``BlockPool`` (``Block::pool`` in PyTorch, the same for every block of a segment).
    """

    __slots__ = (
        "address",
        "size",
        "stream",
        "is_small",
        "expandable",
        "counter",
        "page_size",
        "mapped_pages",
        "pool",
    )

    def __init__(
        self,
        address: int,
        size: int,
        stream: int,
        is_small: bool,
        counter: int,
        expandable: bool = False,
        page_size: int = 0,
        *,
        pool: BlockPool,
    ) -> None:
        self.address = address
        self.size = size
        self.stream = stream
        self.is_small = is_small
        self.expandable = expandable
        # MAIN26 registration_counter: creation ordinal used by the 2026 tie-break (§3.6).
        self.counter = counter
        self.page_size = page_size
        # One flag per page, grown as pages are mapped (pages past its end are unmapped): a
        # reservation of 1.125 x the device's memory (§1) may be huge on an "unlimited" device.
        self.mapped_pages: bytearray | None = bytearray() if expandable else None
        # Block::pool: the BlockPool (default or private, §3.5) every block of the segment uses.
        self.pool = pool


class Block:
    """A contiguous sub-range of a segment; blocks of a segment form a list in address order."""

    __slots__ = (
        "ptr",
        "size",
        "requested_size",
        "stream",
        "allocated",
        "prev",
        "next",
        "segment",
        "event_count",
        "stream_uses",
        "gc_count_base",
        "mapped",
        "tie",
        "same",
        "key",
        "active_index",
    )

    def __init__(self, ptr: int, size: int, stream: int, segment: Segment) -> None:
        self.ptr = ptr
        self.size = size
        self.requested_size = 0
        self.stream = stream
        self.allocated = False
        self.prev: Block | None = None
        self.next: Block | None = None
        self.segment = segment
        # Outstanding events (record_stream uses, or a deferred free) before the free completes.
        self.event_count = 0
        self.stream_uses: set[int] | None = None
        self.gc_count_base = 0
        self.mapped = True
        # Its place among the free blocks of its stream and size while it is in a pool's set
        # (pools.py), else -1.
        self.tie = -1
        # The next free block of its stream and size in set order, while in a pool's set.
        self.same: Block | None = None
        # Its entry in a pool's unmapped set, or None when not there.
        self.key: tuple[Any, ...] | None = None
        # Its place in the allocator's active blocks while it is active, else -1
        # (active_blocks.py).
        self.active_index = -1

    def is_split(self) -> bool:
        """Block::is_split: the segment holds more than this one block."""
        return self.prev is not None or self.next is not None

    def __repr__(self) -> str:
        state = "allocated" if self.allocated else ("pending" if self.event_count else "free")
        if not self.mapped:
            state = "unmapped"
        return f"Block({self.ptr:#x}, {self.size}, stream={self.stream}, {state})"

"""The active blocks: allocated blocks and blocks whose free waits on events (ref §5.1).

PyTorch keeps two structures for them (CUDACachingAllocator.cpp): ``DeviceCachingAllocator::
active_blocks``, a set that ``get_all_blocks`` (the snapshot) reads, and
``NativeCachingAllocator::allocated_blocks``, the map from an address to its block that
``free(ptr)`` looks up (``add_allocated_block`` / ``get_allocated_block``). Here:

* the set is a list with each block's place in it (``Block.active_index``, -1 while the block is
  not active): adding appends, removing moves the last block into the hole, a few field writes
  and no hashing;
* the address map is made the first time something asks by address (a user's ``free(ptr)``,
  ``record_stream``, ``complete_free``, an error message) and kept up to date from then on.

A replay hands its blocks back to the allocator itself (``serve_block`` / ``free_served``) and
never asks by address, so it never makes the map: a dict insert and delete per malloc and free,
in a dict whose thousands of deletes keep rebuilding its table, were a tenth of a compiled
verify (issue 41).
"""

from __future__ import annotations

from typing import Any

from oomkit.core.allocator.block import Block

__all__ = ["ActiveBlocks"]


class ActiveBlocks:
    """The allocator's active blocks, in no particular order, and (once asked for) by address."""

    __slots__ = ("blocks", "by_address")

    def __init__(self) -> None:
        # blocks[block.active_index] is block, for every active block.
        self.blocks: list[Block] = []
        # Address -> block, made by the first look-up by address (None until then). An active
        # block's address does not change (only free blocks split, merge and unmap).
        self.by_address: dict[Any, Block] | None = None

    def __len__(self) -> int:
        return len(self.blocks)

    def add(self, block: Block) -> None:
        """The block became active (malloc's ``active_blocks.insert``, or seeding)."""
        blocks = self.blocks
        block.active_index = len(blocks)
        blocks.append(block)
        if self.by_address is not None:
            self.by_address[block.ptr] = block

    def remove(self, block: Block) -> None:
        """The block is no longer active (free_block's ``active_blocks.erase``)."""
        blocks = self.blocks
        index = block.active_index
        last = blocks.pop()
        if last is not block:
            blocks[index] = last
            last.active_index = index
        block.active_index = -1
        if self.by_address is not None:
            del self.by_address[block.ptr]

    def get(self, ptr: object) -> Block | None:
        """The active block at address ``ptr``, or None (any other value: None)."""
        if self.by_address is None:
            self.by_address = {block.ptr: block for block in self.blocks}
        return self.by_address.get(ptr)

    def __contains__(self, ptr: object) -> bool:
        return self.get(ptr) is not None

    def values(self) -> list[Block]:
        """The active blocks (a new list)."""
        return list(self.blocks)

    def clear(self) -> None:
        """Forget every block (the allocator's close)."""
        for block in self.blocks:
            block.active_index = -1
        self.blocks.clear()
        self.by_address = None

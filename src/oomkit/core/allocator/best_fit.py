"""get_free_block (ref §4 step 3): the best-fit free block of a pool, with its special rules.

``find_free_block`` is the one lookup: malloc's Step 3 and the slow paths (Step 7's
``use_on_oom`` pools) call it; ``checked_free_block`` adds the rules of expandable blocks (§8.3
step 3.3) and the oversize rules of ``max_split_size`` (§4 steps 3.4-3.5).
"""

from __future__ import annotations

from oomkit.core.allocator.block import Block
from oomkit.core.allocator.pools import BlockPool, StreamFreeBlocks, first_fit
from oomkit.core.allocator.settings import AllocatorSettings

__all__ = ["checked_free_block", "find_free_block"]


def _expandable_size(b: Block) -> int:
    # expandable_size: a block plus the unmapped space right after it.
    nxt = b.next
    return b.size + (nxt.size if nxt is not None and not nxt.mapped else 0)


def checked_free_block(
    settings: AllocatorSettings,
    pool: BlockPool,
    sf: StreamFreeBlocks,
    block: Block,
    size: int,
    expandable_active: bool | None = None,
    index: int = -1,
) -> Block | None:
    """get_free_block (§4 step 3.3-3.6) for expandable blocks and oversize rules.

    Args:
        settings: the allocator's settings.
        pool: the pool searched; ``sf`` its free blocks of the request's stream.
        block: the best fit by size (the first block of ``sf`` with ``size >= size``).
        size: the rounded request.
        expandable_active: None means the config's setting (Step 7 passes False).
        index: ``block``'s index in ``sf.heads`` (the lookup's), else -1.

    Returns:
        The block, taken out of the pool, or None.
    """
    if expandable_active is None:
        expandable_active = settings.expandable
    best = block
    if block.segment.expandable:
        if expandable_active:
            # Step 3.3: prefer a slightly larger interior block over the growable tail.
            candidates = sf.iter_from(size)
            next(candidates)
            for nxt_block in candidates:
                if not block.segment.expandable:
                    break
                if _expandable_size(nxt_block) >= _expandable_size(block):
                    break
                block = nxt_block
        else:
            # Expandable segments turned off: skip every expandable block of this stream.
            found = None
            for candidate in sf.iter_from(size):
                if not candidate.segment.expandable:
                    found = candidate
                    break
            if found is None:
                return None
            block = found
    if settings.split_limited:
        max_split = settings.max_split
        # Step 3.4, oversize rule 1: a small request never takes an oversize block.
        if size < max_split and block.size >= max_split:
            return None
        # Step 3.5, oversize rule 2: a large request takes a block only within the slack.
        if size >= max_split and block.size >= size + settings.non_split_rounding:
            return None
    pool.remove(block, index if block is best else -1)
    return block


def find_free_block(
    settings: AllocatorSettings,
    pool: BlockPool,
    size: int,
    stream: int,
    *,
    expandable_active: bool,
) -> Block | None:
    """get_free_block (§4 step 3) on any pool: malloc's Step 3, and the slow paths'."""
    if settings.gc_enabled:
        # Step 3.1: the GC clock ticks on every lookup while GC is enabled.
        pool.gc_clock += 1
    sf = pool.last_free if stream == pool.last_stream else pool.stream_free(stream)
    heads = sf.heads
    i = first_fit(sf, size)
    if i == len(heads):
        return None
    block = heads[i]
    if block.segment.expandable or settings.split_limited:
        return checked_free_block(settings, pool, sf, block, size, expandable_active, i)
    # A classic block without max_split_size: no rule of Step 3.3-3.5 applies, the best fit is
    # taken (most requests; one call less per malloc, issue 41).
    pool.remove(block, i)
    return block

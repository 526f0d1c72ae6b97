"""Private memory pools: CUDA graphs and ``torch.cuda.MemPool`` (ref §3.5, §4 steps 7 and 9, §5.3).

A private pool is a pair of ``BlockPool`` s (small and large) with an id ``(a, b)``
(``MempoolId_t``). While an allocation scope is open (``beginAllocateToPool``), requests whose
stream passes the scope's filter are served from that pool; its free blocks are never handed to
the default pools, and its segments go back to the driver only after its ``use_count`` reached 0
(``releasePool``) and a ``release_cached_blocks`` runs (``empty_cache`` or the OOM path).

Mirrors ``PrivatePool``, ``create_or_incref_pool``, ``beginAllocateToPool``,
``endAllocateToPool``, ``releasePool``, ``get_pool``, ``try_mempool_fallback`` and the private
part of ``release_cached_blocks`` in c10/cuda/CUDACachingAllocator.cpp (V24 and MAIN26).

How PyTorch drives this API (torch/cuda/graphs.py, torch/cuda/memory.py):

* ``torch.cuda.graph(g)``: ``begin_allocate_to_pool(id, lambda s: s == capture_stream,
  capture=True)`` ... ``end_allocate_to_pool(id)``; destroying the graph: ``release_pool(id)``.
* ``pool = torch.cuda.MemPool()``: ``create_pool()``; ``with torch.cuda.use_mem_pool(pool)``:
  ``begin_allocate_to_pool(pool.id)`` ... ``end_allocate_to_pool(pool.id)`` then
  ``release_pool(pool.id)``; dropping the MemPool: ``release_pool(pool.id)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from oomkit.core.allocator.constants import SMALL_SIZE
from oomkit.core.allocator.pools import BlockPool
from oomkit.errors import AllocatorUsageError

if TYPE_CHECKING:
    from oomkit.core.allocator.active_blocks import ActiveBlocks
    from oomkit.core.allocator.versions import TorchBehaviour

__all__ = ["MempoolId", "PrivatePool", "PrivatePools"]

# MempoolId_t: (graph pool uid, 0) for CUDA graphs, (0, user uid) for torch.cuda.MemPool.
MempoolId = tuple[int, int]
StreamFilter = Callable[[int], bool]


class PrivatePool:
    """One private pool (``PrivatePool`` in CUDACachingAllocator.cpp).

    Attributes:
        id: the ``MempoolId_t``.
        small: its small ``BlockPool``; ``large``: its large one.
        use_count: live users (graphs, MemPool objects, open scopes); created at 1.
        segment_count: ``cudaMalloc_count``: cudaMallocs (and expandable allocations) not yet
            given back; the pool is deleted when it is freeable and this reaches 0.
        use_on_oom: tried before releasing cache when a default-pool request fails (Step 7).
        no_split: blocks of this pool are never split (``no_split_pools``).
    """

    __slots__ = ("id", "small", "large", "use_count", "segment_count", "use_on_oom", "no_split")

    def __init__(self, pool_id: MempoolId, by_counter: bool) -> None:
        self.id = pool_id
        self.small = BlockPool(True, by_counter, self)
        self.large = BlockPool(False, by_counter, self)
        self.use_count = 1
        self.segment_count = 0
        self.use_on_oom = False
        self.no_split = False

    def cached_free_bytes(self) -> int:
        """Sum of the free (mapped) block sizes in both halves (the OOM message's P, §12.2)."""
        return sum(b.size for pool in (self.small, self.large) for b in pool.ordered())


def _check_id(pool_id: object) -> MempoolId:
    if (
        not isinstance(pool_id, tuple)
        or len(pool_id) != 2
        or not all(type(x) is int for x in pool_id)
    ):
        raise AllocatorUsageError(
            f"a memory pool id is a tuple of two ints, like torch.cuda.MemPool().id; got "
            f"{pool_id!r}. Example: pool_id = allocator.create_pool()"
        )
    if pool_id == (0, 0):
        raise AllocatorUsageError(
            "(0, 0) is the id of the default pools, not of a private pool. Use "
            "allocator.create_pool() for a fresh id."
        )
    return pool_id


class PrivatePools:
    """The private pools of one allocator: lifetimes, allocation scopes and their releases.

    Args:
        rules: the modelled torch version's rules.
    """

    __slots__ = ("rules", "pools", "freeable", "scopes", "_next_user_pool")

    def __init__(self, rules: TorchBehaviour) -> None:
        self.rules = rules
        # graph_pools, in creation order.
        self.pools: dict[MempoolId, PrivatePool] = {}
        # graph_pools_freeable, in the order releasePool made them freeable.
        self.freeable: dict[MempoolId, PrivatePool] = {}
        # allocation_scopes_ (MAIN26) / captures_underway (V24): (id, filter, capture, pool).
        # Changed in place only: the allocator's malloc binds this list.
        self.scopes: list[tuple[MempoolId, StreamFilter | None, bool, PrivatePool]] = []
        self._next_user_pool = 1

    # ------------------------------------------------------------------ lifetime

    def create_pool(
        self,
        pool_id: MempoolId | None = None,
        *,
        use_on_oom: bool = False,
        no_split: bool = False,
    ) -> MempoolId:
        """``torch.cuda.MemPool(...)``: createOrIncrefPool (plus setUseOnOOM / setNoSplit).

        A new pool starts with ``use_count`` 1; naming an existing live pool adds one use.

        Args:
            pool_id: the id; None picks the next user-pool id ``(0, 1)``, ``(0, 2)``, ...
            use_on_oom: MemPool(use_on_oom=True): a default-pool request that cannot get a new
                segment first tries this pool's free blocks (§4 step 7).
            no_split: MemPool(no_split=True): blocks of this pool are never split (MAIN26).

        Returns:
            The pool's id.

        Raises:
            AllocatorUsageError: a malformed id, a pool whose use_count is 0, or an option the
                modelled torch version does not have.
        """
        if use_on_oom and not self.rules.mempool_use_on_oom:
            raise AllocatorUsageError(
                f"torch {self.rules.version[0]}.{self.rules.version[1]} has no "
                "MemPool(use_on_oom=...); it appeared in ≈2.8 (ref Appendix A). Pass a newer "
                "torch_version or drop use_on_oom."
            )
        if no_split and not self.rules.mempool_no_split:
            raise AllocatorUsageError(
                f"torch {self.rules.version[0]}.{self.rules.version[1]} has no "
                "MemPool(no_split=...); it is modelled from 2026 main (torch >= 2.12). Pass a "
                "newer torch_version or drop no_split."
            )
        if pool_id is None:
            while (0, self._next_user_pool) in self.pools:
                self._next_user_pool += 1
            pool_id = (0, self._next_user_pool)
            self._next_user_pool += 1
        pool = self._create_or_incref(_check_id(pool_id))
        if use_on_oom:
            pool.use_on_oom = True
        if no_split:
            pool.no_split = True
        return pool_id

    def _create_or_incref(self, pool_id: MempoolId) -> PrivatePool:
        # create_or_incref_pool: a new pool has use_count 1; an existing one must be live.
        pool = self.pools.get(pool_id)
        if pool is None:
            pool = PrivatePool(pool_id, self.rules.tie_break_by_creation_order)
            self.pools[pool_id] = pool
            return pool
        if pool.use_count <= 0:
            raise AllocatorUsageError(
                f"private pool {pool_id} has use_count 0 (it was released); PyTorch fails an "
                "internal assert here. Create a new pool instead of reusing a released id."
            )
        pool.use_count += 1
        return pool

    def release_pool(self, pool_id: MempoolId) -> None:
        """releasePool: drop one use; at 0 the pool becomes freeable (graph or MemPool gone).

        Its cached segments are cudaFree'd by the next :meth:`empty_cache` or OOM-path release;
        the pool disappears once none are left.

        Raises:
            AllocatorUsageError: no such pool, or its use_count is already 0.
        """
        pool = self.pools.get(_check_id(pool_id))
        if pool is None or pool.use_count <= 0:
            raise AllocatorUsageError(
                f"release_pool: private pool {pool_id} is not live (never created, or already "
                "released to use_count 0). Each create_pool/begin_allocate_to_pool use is "
                "released once."
            )
        pool.use_count -= 1
        if pool.use_count == 0:
            self.freeable[pool_id] = pool
            # MAIN26 releasePool: the pool leaves no_split_pools.
            pool.no_split = False

    def pool_use_count(self, pool_id: MempoolId) -> int:
        """getPoolUseCount (``MemPool.use_count()``).

        Raises:
            AllocatorUsageError: no such pool.
        """
        pool = self.pools.get(_check_id(pool_id))
        if pool is None:
            raise AllocatorUsageError(
                f"pool_use_count: no private pool {pool_id}; it was never created or has been "
                "deleted after its segments were released."
            )
        return pool.use_count

    @property
    def private_pool_ids(self) -> tuple[MempoolId, ...]:
        """Ids of the private pools that exist (graph_pools), in creation order."""
        return tuple(self.pools)

    # ------------------------------------------------------------------ scopes

    def begin_allocate_to_pool(
        self,
        pool_id: MempoolId,
        stream_filter: StreamFilter | None = None,
        *,
        capture: bool = False,
    ) -> None:
        """beginAllocateToPool: route matching requests into the private pool.

        Creates the pool (use_count 1) or adds a use to it, like PyTorch.

        Args:
            pool_id: the pool.
            stream_filter: which streams the scope takes (``filter(stream) -> bool``); None =
                every stream (use_mem_pool's "this thread" filter, single-threaded).
            capture: the scope is a real CUDA-graph capture (``torch.cuda.graph``), not a
                ``use_mem_pool`` diversion: the OOM path skips ``release_cached_blocks`` for it
                and ``empty_cache`` leaves the default pools alone (MAIN26 is_capture_context).

        Raises:
            AllocatorUsageError: a scope for this pool is already open, or the pool was released.
        """
        pool_id = _check_id(pool_id)
        if stream_filter is not None and not callable(stream_filter):
            raise AllocatorUsageError(
                f"stream_filter must be callable (stream -> bool) or None; got {stream_filter!r}."
            )
        if any(scope[0] == pool_id for scope in self.scopes):
            # beginAllocateToPool: TORCH_CHECK "already recording to mempool_id".
            raise AllocatorUsageError(
                f"beginAllocateToPool: already recording to mempool_id {pool_id}. Call "
                "end_allocate_to_pool first."
            )
        pool = self._create_or_incref(pool_id)
        self.scopes.append((pool_id, stream_filter, bool(capture), pool))

    def end_allocate_to_pool(self, pool_id: MempoolId) -> None:
        """endAllocateToPool: close the scope (the pool's use_count is unchanged).

        Raises:
            AllocatorUsageError: no scope is open for this pool.
        """
        for i, scope in enumerate(self.scopes):
            if scope[0] == pool_id:
                del self.scopes[i]
                return
        raise AllocatorUsageError(
            f"endAllocatePool: not currently recording to mempool_id {pool_id!r}. Open it with "
            "begin_allocate_to_pool first."
        )

    def scoped_pool(self, size: int, stream: int, default: BlockPool) -> BlockPool:
        """get_pool with open scopes: the matching scope's small or large pool, else ``default``."""
        scopes = self.scopes
        # MAIN26 get_pool walks allocation_scopes_ newest first; V24 walks captures_underway
        # oldest first.
        order = reversed(scopes) if self.rules.pool_scopes_newest_first else iter(scopes)
        for _pool_id, stream_filter, _capture, pool in order:
            if stream_filter is None or stream_filter(stream):
                return pool.small if size <= SMALL_SIZE else pool.large
        return default

    def capture_blocks_release(self, stream: int | None) -> bool:
        """Whether a capture in progress forbids release_cached_blocks for the default pools.

        V24: any open scope (``captures_underway`` non-empty). MAIN26 ``is_capture_context``:
        a real capture (``capture=True``) on the caller's stream; ``stream`` None (empty_cache)
        means any open capture.
        """
        if not self.scopes:
            return False
        if not self.rules.release_skips_only_real_capture:
            return True
        for _pool_id, stream_filter, capture, _pool in self.scopes:
            if capture and (stream is None or stream_filter is None or stream_filter(stream)):
                return True
        return False

    # ------------------------------------------------------------------ OOM-path helpers

    def use_on_oom_pools(self, size: int) -> list[BlockPool]:
        """try_mempool_fallback's candidates (§4 step 7): the ``size``'s half of each live pool
        with ``use_on_oom``, in creation order (PyTorch keeps an unordered set)."""
        return [
            pool.small if size <= SMALL_SIZE else pool.large
            for pool in self.pools.values()
            if pool.use_on_oom and pool.use_count > 0
        ]

    def cached_free_bytes(self) -> int:
        """Free cached bytes in every private pool: the OOM message's "allocated in private pools".

        malloc's OOM branch sums ``pool.blocks`` of every entry of graph_pools (§12.2).
        """
        return sum(pool.cached_free_bytes() for pool in self.pools.values())

    # ------------------------------------------------------------------ releasing

    def release_freeable(
        self,
        pool_id: MempoolId | None,
        release_blocks: Callable[[BlockPool], None],
        synchronize_pool_events: Callable[[PrivatePool], None],
        active: ActiveBlocks,
    ) -> None:
        """The private part of release_cached_blocks: freeable pools (or just ``pool_id``).

        PyTorch walks graph_pools_freeable (an unordered map); this walks them in the order
        they became freeable. A pool with no segments left is deleted.
        """
        if not self.freeable:
            return
        for pid, pool in list(self.freeable.items()):
            if pool_id is not None:
                if pid != pool_id:
                    continue
                synchronize_pool_events(pool)
            # Private pools release small before large (release_cached_blocks).
            release_blocks(pool.small)
            release_blocks(pool.large)
            if pool.segment_count <= 0 and _holds_nothing(pool, active):
                del self.pools[pid]
                del self.freeable[pid]


def _holds_nothing(pool: PrivatePool, active: ActiveBlocks) -> bool:
    """No block of any kind is left in the pool (guards the deletion of a freeable pool).

    PyTorch deletes at ``cudaMalloc_count == 0``; with expandable segments that count moves
    by one per allocation and per unmap, so the simulator also checks for leftover blocks.
    """
    if pool.small.count or pool.large.count or pool.small.unmapped or pool.large.unmapped:
        return False
    halves = (pool.small, pool.large)
    return not any(b.segment.pool in halves for b in active.values())

"""malloc's cache miss (ref §4 steps 5-10): what happens when no cached block fits.

Garbage collection (Step 5), alloc_block (Step 6: the fraction limit, the
throw_on_cudamalloc_oom rejection, a new segment or expandable pages), the ``use_on_oom``
private pools (Step 7), release_available_cached_blocks (Step 8), release_cached_blocks and
the retry (Step 9), and the OOM error (Step 10, §12) of DeviceCachingAllocator::malloc.
"""

from __future__ import annotations

from collections.abc import Callable

from oomkit.core.allocator.best_fit import find_free_block
from oomkit.core.allocator.block import Block
from oomkit.core.allocator.device_memory import DeviceMemory
from oomkit.core.allocator.expandable import ExpandableSegments
from oomkit.core.allocator.oom_message import (
    SimulatedOutOfMemoryError,
    oom_message,
    rejection_message,
)
from oomkit.core.allocator.pools import BlockPool
from oomkit.core.allocator.private_pools import PrivatePools
from oomkit.core.allocator.release import CacheRelease
from oomkit.core.allocator.rounding import allocation_size
from oomkit.core.allocator.settings import AllocatorSettings
from oomkit.core.allocator.stats import ALLOCATED_BYTES, RESERVED_BYTES, AllocatorStats
from oomkit.core.allocator.versions import TorchBehaviour

__all__ = ["CacheMiss"]


class CacheMiss:
    """The slow half of malloc, over the allocator's parts.

    Args:
        rules: the modelled torch version's rules.
        device_index: the device printed in OOM messages.
        parts: settings, stats, device memory, expandable segments, release paths and private
            pools of the allocator.
        process_info: the OOM message's per-process sentences.
    """

    __slots__ = (
        "_rules",
        "_device_index",
        "_settings",
        "_stats",
        "_device",
        "_expandable",
        "_release",
        "_private",
        "_process_info",
        "_rejected",
    )

    def __init__(
        self,
        rules: TorchBehaviour,
        device_index: int,
        parts: tuple[
            AllocatorSettings,
            AllocatorStats,
            DeviceMemory,
            ExpandableSegments,
            CacheRelease,
            PrivatePools,
        ],
        process_info: Callable[[], str],
    ) -> None:
        self._rules = rules
        self._device_index = device_index
        (
            self._settings,
            self._stats,
            self._device,
            self._expandable,
            self._release,
            self._private,
        ) = parts
        self._process_info = process_info
        # Whether this malloc was rejected by throw_on_cudamalloc_oom (§4 step 6.3).
        self._rejected = False

    def new_block(self, pool: BlockPool, size: int, nbytes: int, stream: int) -> Block:
        """Steps 5-10: GC, new segment, Step 7 (use_on_oom), Step 8, Step 9 (retry), or OOM.

        Args:
            pool: the pool get_pool chose; ``size`` the rounded request, ``nbytes`` the
                unrounded one, on ``stream``.

        Returns:
            A block of at least ``size`` bytes, out of every free set; it may belong to a
            ``use_on_oom`` private pool (Step 7).

        Raises:
            SimulatedOutOfMemoryError: nothing could serve the request (§4 step 10).
        """
        settings = self._settings
        alloc_size = allocation_size(size, settings.large_segment_size)
        self._rejected = False
        if settings.gc_enabled:
            # Step 5: garbage_collect_cached_blocks.
            self._release.garbage_collect()
        block = self._alloc_block(pool, size, alloc_size, stream, False)
        # A throw_on_cudamalloc_oom rejection skips the retry chain (MAIN26 malloc).
        if block is None and not self._rejected:
            if self._rules.mempool_use_on_oom and pool.owner is None:
                # Step 7: try_mempool_fallback (only for default-pool requests).
                for half in self._private.use_on_oom_pools(size):
                    block = find_free_block(settings, half, size, stream, expandable_active=False)
                    if block is not None:
                        break
            if block is None and self._release.release_available(pool, size, stream):
                # Step 8: release_available_cached_blocks, then alloc_block(isRetry=false).
                block = self._alloc_block(pool, size, alloc_size, stream, False)
            if block is None and not self._private.capture_blocks_release(stream):
                # Step 9: release_cached_blocks, then alloc_block(isRetry=true); skipped
                # while a capture is underway.
                self._release.release_cached_blocks(None, stream)
                block = self._alloc_block(pool, size, alloc_size, stream, True)
        if block is None:
            if self._rejected:
                # NativeCachingAllocator::malloc: a rejected request raises its own message
                # (§12.4); no num_ooms increment.
                self._rejected = False
                error = self.oom_error(rejection_message(nbytes), nbytes, size, alloc_size, stream)
                error.rejected = True
                raise error
            # Step 10: OOM; nothing freed above is rolled back.
            self._stats.num_ooms += 1
            message = oom_message(
                self._rules,
                alloc_size=alloc_size,
                device=self._device_index,
                total=self._device.capacity_bytes,
                free=self._device.free_bytes,
                allocated=self._stats.current(ALLOCATED_BYTES),
                reserved=self._stats.current(RESERVED_BYTES),
                allowed=settings.limit,
                private_pool_cached=self._private.cached_free_bytes(),
                process_info=self._process_info(),
            )
            raise self.oom_error(message, nbytes, size, alloc_size, stream)
        return block

    def oom_error(
        self, message: str, nbytes: int, size: int, alloc_size: int, stream: int
    ) -> SimulatedOutOfMemoryError:
        """The error malloc raises, with the figures of this moment."""
        return SimulatedOutOfMemoryError(
            message,
            requested_bytes=nbytes,
            rounded_bytes=size,
            alloc_size_bytes=alloc_size,
            allocated_bytes=self._stats.current(ALLOCATED_BYTES),
            reserved_bytes=self._stats.current(RESERVED_BYTES),
            capacity_bytes=self._device.capacity_bytes,
            free_bytes=self._device.free_bytes,
            allowed_bytes=self._settings.limit,
            stream=stream,
        )

    def _alloc_block(
        self, pool: BlockPool, size: int, alloc_size: int, stream: int, is_retry: bool
    ) -> Block | None:
        """alloc_block (§4 step 6): a new segment (or expandable pages), or None."""
        settings = self._settings
        total = self._device.total_bytes
        if is_retry:
            # Step 6.1: counted at call time, whatever the outcome.
            self._stats.num_alloc_retries += 1
        if settings.limit is not None and total + alloc_size > settings.limit:
            # Step 6.2: the fraction limit is tested against alloc_size; no cudaMalloc.
            return None
        if settings.reject_limit is not None and total + alloc_size > settings.reject_limit:
            # Step 6.3 (MAIN26 throw_on_cudamalloc_oom): reject instead of trying cudaMalloc.
            self._stats.num_oom_rejections += 1
            self._rejected = True
            return None
        if settings.expandable:
            # Step 6.4: the expandable path gets the rounded size, not alloc_size.
            block = self._expandable.try_allocate(pool, size, stream)
            if block is not None and pool.owner is not None:
                # alloc_block: one cudaMalloc_count per expandable allocation that succeeded.
                pool.owner.segment_count += 1
            return block
        return self._device.malloc_segment(pool, alloc_size, stream)

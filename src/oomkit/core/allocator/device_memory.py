"""The simulated driver side: cudaMalloc / cudaFree of classic segments (ref §4 step 6, §4.1).

:class:`DeviceMemory` owns what the device has handed to the allocator: ``total_allocated_memory``
(§3.7), the classic segments by address, the segment log, and the two hooks that decide whether
a cudaMalloc succeeds and where a new segment lies. Expandable reservations (``expandable.py``)
map and unmap their pages through it too.
"""

from __future__ import annotations

from collections.abc import Callable

from oomkit.core.allocator.block import Block, Segment
from oomkit.core.allocator.constants import SMALL_BUFFER
from oomkit.core.allocator.pools import BlockPool
from oomkit.core.allocator.settings import AllocatorSettings
from oomkit.core.allocator.stats import (
    LARGE_POOL,
    OVERSIZE_SEGMENTS,
    RESERVED_BYTES,
    SEGMENT,
    SMALL_POOL,
    AllocatorStats,
)
from oomkit.errors import AllocatorUsageError

__all__ = ["DeviceMemory", "SYNTHETIC_ADDRESS_BASE", "check_capacity"]

# First synthetic segment address: a typical CUDA VA region, 2 MiB aligned.
SYNTHETIC_ADDRESS_BASE = 0x7F00_0000_0000
_ADDRESS_ALIGN = SMALL_BUFFER


def check_capacity(capacity_bytes: object, reserved_outside_bytes: object) -> None:
    """Validate the device sizes a :class:`DeviceMemory` is made with.

    Raises:
        AllocatorUsageError: a negative or non-integer capacity or outside reservation.
    """
    if not isinstance(capacity_bytes, int) or capacity_bytes < 0:
        raise AllocatorUsageError(
            f"capacity_bytes must be a non-negative int of bytes; got {capacity_bytes!r}. "
            "Example: capacity_bytes=80 * 2**30 for an 80 GiB device."
        )
    if not isinstance(reserved_outside_bytes, int) or reserved_outside_bytes < 0:
        raise AllocatorUsageError(
            "reserved_outside_bytes must be a non-negative int of bytes; got "
            f"{reserved_outside_bytes!r}."
        )


class DeviceMemory:
    """Device memory held by the allocator, and the driver calls that change it.

    Args:
        capacity_bytes: device total memory.
        reserved_outside_bytes: device memory used outside this allocator.
        stats: the allocator's stats (segment, reserved_bytes, the device counters).
        settings: the allocator's settings (``max_split`` for the oversize stats).
        device_malloc: may N new bytes be obtained now? None: the capacity rule.
        segment_address: address of a new segment ``(size, expandable)``; None: synthetic.
    """

    __slots__ = (
        "capacity_bytes",
        "reserved_outside_bytes",
        "total_bytes",
        "pending_map_bytes",
        "segments",
        "segment_log",
        "next_address",
        "next_counter",
        "device_malloc",
        "segment_address",
        "_stats",
        "_settings",
    )

    def __init__(
        self,
        capacity_bytes: int,
        reserved_outside_bytes: int,
        stats: AllocatorStats,
        settings: AllocatorSettings,
        device_malloc: Callable[[int], bool] | None,
        segment_address: Callable[[int, bool], int] | None,
    ) -> None:
        self.capacity_bytes = capacity_bytes
        self.reserved_outside_bytes = reserved_outside_bytes
        # total_allocated_memory (§3.7): always equal to reserved_bytes.all.current.
        self.total_bytes = 0
        # Bytes of expandable pages created by an unfinished map call (default device_malloc).
        self.pending_map_bytes = 0
        # Classic segments by base address.
        self.segments: dict[int, Segment] = {}
        self.segment_log: list[tuple[str, int, int]] = []
        self.next_address = SYNTHETIC_ADDRESS_BASE
        # MAIN26 registration_counter: next segment creation ordinal (§3.6).
        self.next_counter = 0
        self.device_malloc = device_malloc if device_malloc is not None else self.fits
        self.segment_address = (
            segment_address if segment_address is not None else self.synthetic_address
        )
        self._stats = stats
        self._settings = settings

    def fits(self, nbytes: int) -> bool:
        """Our convention: cudaMalloc succeeds iff everything reserved on the device fits."""
        return (
            self.total_bytes + self.pending_map_bytes + self.reserved_outside_bytes + nbytes
            <= self.capacity_bytes
        )

    def synthetic_address(self, size: int, expandable: bool) -> int:
        """Increasing, 2 MiB aligned addresses that are never reused."""
        address = self.next_address
        self.next_address = address + (size + _ADDRESS_ALIGN - 1) // _ADDRESS_ALIGN * _ADDRESS_ALIGN
        return address

    def new_counter(self) -> int:
        """The next segment creation ordinal (MAIN26 registration_counter, §3.6)."""
        counter = self.next_counter
        self.next_counter = counter + 1
        return counter

    @property
    def free_bytes(self) -> int:
        """What cudaMemGetInfo would report as free: capacity minus everything reserved."""
        return max(0, self.capacity_bytes - self.reserved_outside_bytes - self.total_bytes)

    def add_reserved(self, pool: BlockPool, nbytes: int) -> None:
        """Account ``nbytes`` newly reserved in ``pool`` (total and reserved_bytes)."""
        self.total_bytes += nbytes
        self._stats.up(SMALL_POOL if pool.is_small else LARGE_POOL, RESERVED_BYTES, nbytes)

    def remove_reserved(self, pool: BlockPool, nbytes: int) -> None:
        """Account ``nbytes`` given back from ``pool``."""
        self.total_bytes -= nbytes
        self._stats.down(SMALL_POOL if pool.is_small else LARGE_POOL, RESERVED_BYTES, nbytes)

    def malloc_segment(self, pool: BlockPool, alloc_size: int, stream: int) -> Block | None:
        """alloc_block's cudaMalloc (§4 step 6.4): a new classic segment as one block, or None."""
        if not self.device_malloc(alloc_size):
            return None
        owner = pool.owner
        if owner is not None:
            owner.segment_count += 1
        ptr = self.segment_address(alloc_size, False)
        segment = Segment(ptr, alloc_size, stream, pool.is_small, self.new_counter(), pool=pool)
        self.segments[ptr] = segment
        self.add_reserved(pool, alloc_size)
        stats = self._stats
        stats.up(SMALL_POOL if pool.is_small else LARGE_POOL, SEGMENT, 1)
        if alloc_size >= self._settings.max_split:
            stats.up_all(OVERSIZE_SEGMENTS, 1)
        stats.num_device_alloc += 1
        self.segment_log.append(("segment_alloc", ptr, alloc_size))
        return Block(ptr, alloc_size, stream, segment)

    def release_block(self, block: Block, pool: BlockPool) -> None:
        """release_block (§4.1): cudaFree a whole free classic segment."""
        size = block.size
        stats = self._stats
        stats.num_device_free += 1
        self.segment_log.append(("segment_free", block.ptr, size))
        if pool.owner is not None:
            # release_block: a private pool counts its live cudaMallocs (cudaMalloc_count).
            pool.owner.segment_count -= 1
        stats.down(SMALL_POOL if pool.is_small else LARGE_POOL, SEGMENT, 1)
        self.remove_reserved(pool, size)
        if size >= self._settings.max_split:
            stats.down_all(OVERSIZE_SEGMENTS, 1)
        pool.remove(block)
        del self.segments[block.segment.address]

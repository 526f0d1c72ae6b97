"""``torch.cuda.memory_allocated()`` while a step is recorded: the bytes recorded so far.

A script that logs its memory (``print(torch.cuda.max_memory_allocated())``) reads, under the
recorder, the device allocations recorded up to that line: each live request rounded as
``CUDACachingAllocator``'s ``round_size`` rounds it (a multiple of 512 bytes, at least 512; a
request of 0 bytes allocates nothing), under the default settings (no
``roundup_power2_divisions``), and their highest total since the start or the last
``torch.cuda.reset_peak_memory_stats()``. On the GPU ``allocated_bytes`` counts each block's
size, which is larger than the request where the allocator handed a cached block out whole:
``should_split`` keeps a large-pool remainder of at most 1 MiB with the block (the small pool
splits off any remainder; ../shared/ref/cuda-caching-allocator.md step 11). Those bytes are
known only once the recording is replayed. ``memory_reserved()`` depends on that replay as a whole; it
answers 0 while recording. The reads of each are counted, so that the prediction can say how
they were answered.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from oomkit.core.allocator.rounding import round_size

__all__ = ["AllocatedCounter"]


class AllocatedCounter:
    """The live recorded device bytes of one recording's log, read as the log grows.

    Args:
        log: the recorder's event log (``("alloc", Allocation)``, ``("free", Allocation,
            frames)``, ``("step",)``), appended to while the step runs; read from where the
            last query stopped.
    """

    def __init__(self, log: Sequence[Any]) -> None:
        self._log = log
        self._read = 0
        self._allocated_bytes = 0
        self._peak_allocated_bytes = 0
        self.allocated_reads = 0
        self.reserved_reads = 0

    def _catch_up(self) -> None:
        log, total, peak = self._log, self._allocated_bytes, self._peak_allocated_bytes
        for index in range(self._read, len(log)):
            entry = log[index]
            kind = entry[0]
            if kind == "step":
                continue
            size = entry[1].size_bytes
            if size <= 0:
                continue  # malloc(0) returns no block (CUDACachingAllocator::malloc)
            if kind == "alloc":
                total += round_size(size)
                peak = max(peak, total)
            else:
                total -= round_size(size)
        self._read = len(log)
        self._allocated_bytes, self._peak_allocated_bytes = total, peak

    def allocated_bytes(self) -> int:
        """``memory_allocated()``: the live recorded requests, rounded (module docstring)."""
        self.allocated_reads += 1
        self._catch_up()
        return self._allocated_bytes

    def peak_allocated_bytes(self) -> int:
        """``max_memory_allocated()``: the highest ``allocated_bytes`` since the last reset."""
        self.allocated_reads += 1
        self._catch_up()
        return self._peak_allocated_bytes

    def reset_peak(self) -> None:
        """``reset_peak_memory_stats()``: the peak starts again from what is allocated now."""
        self._catch_up()
        self._peak_allocated_bytes = self._allocated_bytes

    def reserved_read(self) -> int:
        """``memory_reserved()`` / ``max_memory_reserved()``: 0, the read counted."""
        self.reserved_reads += 1
        return 0

    def assumptions(self) -> dict[str, str]:
        """How the step's reads of ``memory_allocated()`` were answered, if it read it."""
        if not self.allocated_reads:
            return {}
        return {
            "torch.cuda.memory_allocated()": (
                f"read {self.allocated_reads} time(s) by the step (with max_memory_allocated()), "
                "answered with the requests recorded so far, each rounded as "
                "CUDACachingAllocator's round_size; the replayed peak allocated may be higher "
                "by blocks handed out whole (at most 1 MiB over their request each under the "
                "default settings)"
            )
        }

    def warnings(self) -> list[str]:
        """That ``memory_reserved()`` read 0, if the step read it."""
        if not self.reserved_reads:
            return []
        return [
            f"torch.cuda.memory_reserved() was read {self.reserved_reads} time(s) while the "
            "step was recorded and answered 0: reserved memory is known only once the "
            "recording is replayed (the peak reserved above); memory_allocated() read the "
            "bytes recorded so far"
        ]

"""The simulated OOM error and the exact text PyTorch prints for it (ref §12)."""

from __future__ import annotations

from collections.abc import Iterable

from oomkit.core.allocator.versions import TorchBehaviour
from oomkit.errors import OomkitError

__all__ = [
    "ONE_EXA_MESSAGE",
    "REJECTION_MESSAGE_PREFIX",
    "SimulatedOutOfMemoryError",
    "format_size",
    "oom_message",
    "process_memory_info",
    "rejection_message",
]

# NativeCachingAllocator::allocate: requests of 2^60 bytes or more (§12.4).
ONE_EXA_MESSAGE = "CUDA out of memory. Tried to allocate more than 1EB memory."
# NativeCachingAllocator::malloc (MAIN26): a throw_on_cudamalloc_oom rejection (§12.4).
REJECTION_MESSAGE_PREFIX = (
    "CUDA out of memory. Allocation was preemptively rejected because it would exceed "
    "per_process_memory_fraction limit. Requested size: "
)


def format_size(size_bytes: int) -> str:
    """CUDACachingAllocator.cpp format_size: two decimals, bytes / KiB / MiB / GiB (§12.1)."""
    if size_bytes <= 1024:
        return f"{size_bytes} bytes"
    if size_bytes <= 1048576:
        return f"{size_bytes / 1024.0:.2f} KiB"
    if size_bytes <= 1073741824:
        return f"{size_bytes / 1048576.0:.2f} MiB"
    return f"{size_bytes / 1073741824.0:.2f} GiB"


def rejection_message(requested_bytes: int) -> str:
    """The MAIN26 preemptive-rejection text; the size is the unrounded request (§12.4)."""
    return REJECTION_MESSAGE_PREFIX + format_size(requested_bytes)


def process_memory_info(processes: Iterable[tuple[int, int]], self_pid: int) -> str:
    """reportProcessMemoryInfo: one sentence per process NVML lists on the GPU (§12.2 PROC).

    Args:
        processes: ``(pid, used_bytes)`` in NVML's order (nvmlDeviceGetComputeRunningProcesses).
        self_pid: this process's pid; its entry reads "Including non-PyTorch memory, this
            process has ...".

    Returns:
        The sentences, each ending with ". " (the OOM message puts them before "Of the
        allocated memory"); empty for no processes.
    """
    parts = []
    for pid, used_bytes in processes:
        who = "Including non-PyTorch memory, this process" if pid == self_pid else f"Process {pid}"
        parts.append(f"{who} has {format_size(used_bytes)} memory in use. ")
    return "".join(parts)


def oom_message(
    rules: TorchBehaviour,
    *,
    alloc_size: int,
    device: int,
    total: int,
    free: int,
    allocated: int,
    reserved: int,
    allowed: int | None,
    private_pool_cached: int = 0,
    process_info: str = "",
) -> str:
    """The ``torch.OutOfMemoryError`` text of DeviceCachingAllocator::malloc (§12.3).

    Args:
        rules: the modelled version's rules (message variant and docs link).
        alloc_size: the segment size that could not be obtained (§2.4), not the request.
        device: the device index.
        total: cudaMemGetInfo total.
        free: cudaMemGetInfo free.
        allocated: ``allocated_bytes.all.current``.
        reserved: ``reserved_bytes.all.current``.
        allowed: ``allowed_memory_maximum`` when a fraction limit is set, else None.
        private_pool_cached: free cached bytes in private pools ("allocated in private pools").
        process_info: the NVML per-process sentences, empty without NVML.
    """
    allowed_info = f"{format_size(allowed)} allowed; " if allowed is not None else ""
    variant = rules.oom_message_variant
    if variant == "classic":
        # <= 2.0 text (pre-2.1 CUDACachingAllocator.cpp malloc).
        return (
            f"CUDA out of memory. Tried to allocate {format_size(alloc_size)} (GPU {device}; "
            f"{format_size(total)} total capacity; {format_size(allocated)} already allocated; "
            f"{format_size(free)} free; {allowed_info}{format_size(reserved)} reserved in total "
            "by PyTorch) If reserved memory is >> allocated memory try setting "
            "max_split_size_mb to avoid fragmentation.  See documentation for Memory "
            "Management and PYTORCH_CUDA_ALLOC_CONF"
        )
    private_msg = (
        f"with {format_size(private_pool_cached)} allocated in private pools (e.g., CUDA Graphs), "
        if private_pool_cached > 0
        else ""
    )
    # 2.1 misspells "capacity" (§12.3).
    capacity_word = "capacty" if variant == "v2_1" else "capacity"
    head = (
        f"CUDA out of memory. Tried to allocate {format_size(alloc_size)}. GPU {device} has a "
        f"total {capacity_word} of {format_size(total)} of which {format_size(free)} is free. "
        f"{process_info}{allowed_info}Of the allocated memory "
        f"{format_size(allocated + private_pool_cached)} is allocated by PyTorch, {private_msg}"
        f"and {format_size(reserved - allocated - private_pool_cached)} is reserved by PyTorch "
        "but unallocated."
    )
    if variant == "v2_1":
        return head + (
            " If reserved but unallocated memory is large try setting max_split_size_mb to avoid"
            " fragmentation.  See documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF"
        )
    return head + (
        " If reserved but unallocated memory is large try setting"
        " PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See"
        f" documentation for Memory Management  ({rules.oom_docs_url})"
    )


class SimulatedOutOfMemoryError(OomkitError, MemoryError):
    """The simulated allocator could not serve a request; ``str()`` is PyTorch's message.

    Attributes:
        requested_bytes: the user's request (unrounded).
        rounded_bytes: the rounded block size (what the ``oom`` trace entry records).
        alloc_size_bytes: the segment size that could not be obtained ("Tried to allocate").
        allocated_bytes: ``allocated_bytes.all.current`` after the release attempts.
        reserved_bytes: ``reserved_bytes.all.current`` after the release attempts.
        capacity_bytes: the device total.
        free_bytes: device free memory as cudaMemGetInfo would report it.
        allowed_bytes: the per-process limit, or None.
        stream: the request's stream.
        rejected: a MAIN26 throw_on_cudamalloc_oom preemptive rejection (§12.4), not a
            failed cudaMalloc; ``num_ooms`` did not count it.
    """

    def __init__(
        self,
        message: str,
        *,
        requested_bytes: int,
        rounded_bytes: int,
        alloc_size_bytes: int,
        allocated_bytes: int,
        reserved_bytes: int,
        capacity_bytes: int,
        free_bytes: int,
        allowed_bytes: int | None,
        stream: int,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.requested_bytes = requested_bytes
        self.rounded_bytes = rounded_bytes
        self.alloc_size_bytes = alloc_size_bytes
        self.allocated_bytes = allocated_bytes
        self.reserved_bytes = reserved_bytes
        self.capacity_bytes = capacity_bytes
        self.free_bytes = free_bytes
        self.allowed_bytes = allowed_bytes
        self.stream = stream
        self.rejected = False

    def __str__(self) -> str:
        return self.message

    # Short aliases (the names the public API documents).
    @property
    def requested(self) -> int:
        """The user's request in bytes."""
        return self.requested_bytes

    @property
    def alloc_size(self) -> int:
        """The segment size in bytes that could not be obtained."""
        return self.alloc_size_bytes

    @property
    def allocated(self) -> int:
        """Allocated bytes at the time of the OOM."""
        return self.allocated_bytes

    @property
    def reserved(self) -> int:
        """Reserved bytes at the time of the OOM."""
        return self.reserved_bytes

    @property
    def capacity(self) -> int:
        """Device total in bytes."""
        return self.capacity_bytes

    @property
    def free(self) -> int:
        """Device free bytes at the time of the OOM."""
        return self.free_bytes

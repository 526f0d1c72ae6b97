"""Labelled OOM messages: one per message variant PyTorch has printed, made by the simulator.

Each case runs a small program through the simulated caching allocator of the PyTorch version
whose message it wants (``torch_version``) and keeps the ``torch.OutOfMemoryError`` text it
raises. Variants the simulator does not print (``<= 1.4`` "cached", ``backend:cudaMallocAsync``,
a bare driver error) are written from the simulator's figures with ``format_size``, in the
wording of that version's source (ref §12). ``expected`` is the cause and ``top_remedy`` the
title of the first remedy ``diagnose_oom_text`` must give.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from oomkit.core.allocator import AllocatorConfig, CachingAllocator, SimulatedOutOfMemoryError
from oomkit.core.allocator.oom_message import format_size

MiB = 2**20
GiB = 2**30
PID = 4000  # the process that raises


def _raise(allocator: CachingAllocator, nbytes: int) -> SimulatedOutOfMemoryError:
    try:
        allocator.malloc(nbytes)
    except SimulatedOutOfMemoryError as error:
        return error
    raise AssertionError(f"{nbytes} bytes did not run out of memory")


def _fragmented(torch_version: str | None) -> SimulatedOutOfMemoryError:
    """Seven 1 GiB segments each keep 600 MiB: 2.8 GiB cached in gaps, 2 GiB cannot be found."""
    a = CachingAllocator(
        capacity_bytes=8 * GiB, reserved_outside_bytes=400 * MiB, torch_version=torch_version
    )
    blocks = [a.malloc(GiB) for _ in range(7)]
    for block in blocks:
        a.free(block)
    for _ in blocks:
        a.malloc(600 * MiB)
    return _raise(a, 2 * GiB)


def _short(torch_version: str | None) -> SimulatedOutOfMemoryError:
    """7 GiB of tensors on an 8 GiB GPU with a 400 MiB context, then 1 GiB more."""
    a = CachingAllocator(
        capacity_bytes=8 * GiB, reserved_outside_bytes=400 * MiB, torch_version=torch_version
    )
    for _ in range(7):
        a.malloc(GiB)
    return _raise(a, GiB)


def native_nvml() -> str:
    """2.2+ with NVML's process sentences: another process holds 5 GiB of a 16 GiB GPU."""
    a = CachingAllocator(
        capacity_bytes=16 * GiB,
        reserved_outside_bytes=5 * GiB + 500 * MiB,
        process_memory=lambda: [(PID, 6 * GiB + 500 * MiB), (4242, 5 * GiB)],
        pid=PID,
    )
    for _ in range(6):
        a.malloc(GiB)
    return f"torch.OutOfMemoryError: {_raise(a, 6 * GiB)}"


def native_v2_1_capacty() -> str:
    """2.1 ("total capacty"): the cache is fragmented."""
    return f"torch.cuda.OutOfMemoryError: {_fragmented('2.1')}"


def native_shortage() -> str:
    """2.2+ without NVML sentences: a plain shortage."""
    return f"torch.OutOfMemoryError: {_short('2.4')}"


def classic_v2_0() -> str:
    """<= 2.0 "(GPU 0; ... reserved in total by PyTorch)": a plain shortage."""
    return f"torch.cuda.OutOfMemoryError: {_short('2.0')}"


def classic_v1_4_cached() -> str:
    """<= 1.4 said "N cached", reserved minus allocated (PR #13751): the same fragmented state."""
    e = _fragmented("2.0")
    return (
        f"RuntimeError: CUDA out of memory. Tried to allocate {format_size(e.alloc_size_bytes)} "
        f"(GPU 0; {format_size(e.capacity_bytes)} total capacity; "
        f"{format_size(e.allocated_bytes)} already allocated; {format_size(e.free_bytes)} free; "
        f"{format_size(e.reserved_bytes - e.allocated_bytes)} cached)"
    )


def fraction_allowed() -> str:
    """2.2+ with "N allowed;": a 0.5 fraction refuses 2 GiB on top of 3 GiB on an 8 GiB GPU."""
    a = CachingAllocator(capacity_bytes=8 * GiB, reserved_outside_bytes=400 * MiB)
    a.set_per_process_memory_fraction(0.5)
    for _ in range(3):
        a.malloc(GiB)
    return f"torch.OutOfMemoryError: {_raise(a, 2 * GiB)}"


def fraction_allowed_classic() -> str:
    """<= 2.0 with "N allowed;": the same limit in the classic wording."""
    a = CachingAllocator(
        capacity_bytes=8 * GiB, reserved_outside_bytes=400 * MiB, torch_version="2.0"
    )
    a.set_per_process_memory_fraction(0.5)
    for _ in range(3):
        a.malloc(GiB)
    return f"torch.cuda.OutOfMemoryError: {_raise(a, 2 * GiB)}"


def fraction_rejected() -> str:
    """Newer PyTorch's throw_on_cudamalloc_oom: 7 GiB + 2 GiB over the 8 GiB limit, rejected."""
    conf = AllocatorConfig.parse("throw_on_cudamalloc_oom:True", "main")
    a = CachingAllocator(conf, capacity_bytes=8 * GiB, torch_version="main")
    for _ in range(7):
        a.malloc(GiB)
    return f"torch.OutOfMemoryError: {_raise(a, 2 * GiB)}"


def exceeds_device() -> str:
    """One 16 GiB request on an 8 GiB GPU (2.2+ text)."""
    a = CachingAllocator(capacity_bytes=8 * GiB, reserved_outside_bytes=400 * MiB)
    a.malloc(GiB)
    return f"torch.OutOfMemoryError: {_raise(a, 16 * GiB)}"


def exceeds_one_exa() -> str:
    """A request of 2^60 bytes or more: "more than 1EB" (a negative or overflowed shape)."""
    a = CachingAllocator(capacity_bytes=8 * GiB)
    return f"torch.OutOfMemoryError: {_raise(a, 2**61)}"


def cuda_malloc_async() -> str:
    """backend:cudaMallocAsync (CUDAMallocAsyncAllocator.cpp mallocAsync): 7 GiB used of 8."""
    total, free, allocated = 8 * GiB, 600 * MiB, 7 * GiB
    return (
        "torch.OutOfMemoryError: Allocation on device 0 would exceed allowed memory. "
        f"(out of memory)\nCurrently allocated     : {format_size(allocated)}\n"
        f"Requested               : {format_size(GiB)}\n"
        f"Device limit            : {format_size(total)}\n"
        f"Free (according to CUDA): {format_size(free)}\n"
        "PyTorch limit (set by user-supplied memory fraction)\n"
        f"                        : {format_size(total)}"
    )


def driver_error() -> str:
    """A bare CUDA error from a call outside the caching allocator (cuBLAS handle creation)."""
    return (
        "RuntimeError: CUDA error: out of memory\nCUDA kernel errors might be asynchronously "
        "reported at some other API call, so the stacktrace below might be incorrect."
    )


@dataclass(frozen=True)
class MessageCase:
    name: str
    text: Callable[[], str]
    variant: str
    expected: str
    top_remedy: str


CASES: tuple[MessageCase, ...] = (
    MessageCase(
        "2.2+ NVML",
        native_nvml,
        "native",
        "outside_pytorch",
        "free the memory held outside PyTorch",
    ),
    MessageCase(
        "2.1 capacty", native_v2_1_capacty, "native", "fragmentation", "expandable segments"
    ),
    MessageCase(
        "2.2+ shortage",
        native_shortage,
        "native",
        "shortage",
        "reduce memory per step by at least the shortfall",
    ),
    MessageCase(
        "<=2.0",
        classic_v2_0,
        "classic",
        "shortage",
        "reduce memory per step by at least the shortfall",
    ),
    MessageCase(
        "<=1.4 cached", classic_v1_4_cached, "classic", "fragmentation", "expandable segments"
    ),
    MessageCase(
        "2.2+ allowed",
        fraction_allowed,
        "native",
        "fraction_limit",
        "raise the per-process memory fraction",
    ),
    MessageCase(
        "<=2.0 allowed",
        fraction_allowed_classic,
        "classic",
        "fraction_limit",
        "raise the per-process memory fraction",
    ),
    MessageCase(
        "preemptive rejection",
        fraction_rejected,
        "fraction_rejected",
        "fraction_limit",
        "raise the per-process memory fraction",
    ),
    MessageCase(
        "larger than the device",
        exceeds_device,
        "native",
        "request_exceeds_device",
        "check the shape of the tensor being created",
    ),
    MessageCase(
        "more than 1EB",
        exceeds_one_exa,
        "exa",
        "request_exceeds_device",
        "check the shape of the tensor being created",
    ),
    MessageCase(
        "cudaMallocAsync",
        cuda_malloc_async,
        "cuda_malloc_async",
        "shortage",
        "reduce memory per step by at least the shortfall",
    ),
    MessageCase(
        "driver error",
        driver_error,
        "driver",
        "outside_pytorch",
        "leave room outside the caching allocator",
    ),
)

"""What an OOM message says of memory outside the allocator and of the GPU it came from.

The CUDA context's likely range (issue 14 item 5), the GPU matched by its total memory, whose
NVML process lines are whose, and figures that cannot be true together.

Memory outside the caching allocator (``total - free - reserved``) holds this process's CUDA
context and the libraries it loaded (cuBLAS, cuDNN, NCCL) before anything else; only what lies
clearly above the context's upper bound is someone else's (another process). The range comes
from ``oomkit.core.gpus.overhead.cuda_context`` for the GPU's compute capability and the loading
mode the message's PyTorch release implies: 2.1+ builds all use CUDA >= 11.8 (lazy loading);
1.13 and 2.0 shipped CUDA 11.6-11.8 builds, older releases CUDA <= 11.6 (eager).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from oomkit.core.gpus.overhead import cuda_context
from oomkit.diagnose.oom_text import OomText
from oomkit.units import format_bytes

if TYPE_CHECKING:
    from oomkit.core.gpus import GpuSpec

__all__ = [
    "ContextRange",
    "context_range",
    "figure_warnings",
    "matched_gpu",
    "inconsistency",
    "memory_paragraph",
    "own_and_others",
]


@dataclass(frozen=True)
class ContextRange:
    """The expected CUDA context (and library) share of the memory outside the allocator.

    Attributes:
        low_bytes: a bare context.
        expected_bytes: the usual figure.
        high_bytes: with cuBLAS, cuDNN and NCCL loaded: more than this outside the allocator
            is not this process's context.
        device: which device the figure is for (``"A100 80GB SXM"``, ``"a typical GPU"``).
        loading: ``"lazy"``, ``"eager"`` or ``"lazy or eager"``.
    """

    low_bytes: int
    expected_bytes: int
    high_bytes: int
    device: str
    loading: str

    def describe(self) -> str:
        """``~400 MiB (256 MiB-1.17 GiB) on A100 80GB SXM, lazy module loading``."""
        return (
            f"~{format_bytes(self.expected_bytes)} ({format_bytes(self.low_bytes)}-"
            f"{format_bytes(self.high_bytes)}) on {self.device}, {self.loading} module loading"
        )


# How far a message's total may sit from the catalog's figure and still be that GPU: the total
# a driver reports moves with its version (core/gpus/catalog.py T4 note: 14918-15110 MiB across
# drivers, a 192 MiB spread; Colab's T4 prints "14.75 GiB" against the catalog's 14.76 GiB).
_TOTAL_MATCH_BYTES = 200 * 2**20


def matched_gpu(parsed: OomText, gpu: GpuSpec | None = None) -> GpuSpec | None:
    """``gpu`` if given, else the catalog GPU whose total memory is nearest the message's.

    Only a GPU within 200 MiB (plus the message's rounding) matches; None otherwise.
    """
    if gpu is not None:
        return gpu
    total = parsed.total_bytes
    if total is None:
        return None
    # The catalog only here: a snapshot's diagnosis names its GPU or none (issue 41 item 4).
    from oomkit.core.gpus.catalog import CATALOG

    tolerance = parsed.tolerance_bytes.get("total_bytes", 0) + _TOTAL_MATCH_BYTES
    nearest = min(CATALOG, key=lambda spec: abs(spec.total_memory_bytes - total))
    return nearest if abs(nearest.total_memory_bytes - total) <= tolerance else None


def context_range(parsed: OomText, gpu: GpuSpec | None = None) -> ContextRange:
    """The context range for the message's device (given, else matched by total memory)."""
    spec = matched_gpu(parsed, gpu)
    capability = None if spec is None else spec.compute_capability
    lazy = cuda_context(capability, module_loading="lazy")
    eager = cuda_context(capability, module_loading="eager")
    versions = parsed.torch_versions
    if versions == "<=1.4":
        low, expected, high, loading = (
            eager.low_bytes,
            eager.expected_bytes,
            eager.high_bytes,
            "eager",
        )
    elif versions == "1.5-2.0" or parsed.variant == "cuda_malloc_async":
        # 1.5-1.12: CUDA <= 11.6 (eager); 1.13/2.0 with CUDA 11.7+ builds: lazy.
        low, expected, high = lazy.low_bytes, lazy.expected_bytes, eager.high_bytes
        loading = "lazy or eager"
    else:
        low, expected, high, loading = lazy.low_bytes, lazy.expected_bytes, lazy.high_bytes, "lazy"
    if spec is not None and spec.compute_capability is None:
        name = "a GPU of that size"
    else:
        name = "a typical GPU" if spec is None else spec.name
    return ContextRange(low, expected, high, name, loading)


def own_and_others(parsed: OomText, r: int) -> tuple[int | None, int]:
    """(this process's NVML figure, None where not printed; what other processes used).

    CUDACachingAllocator.cpp reportProcessMemoryInfo prints "Including non-PyTorch memory, this
    process has ..." for the NVML process whose pid is getpid(), "Process N has ..." for the
    others. In a container NVML reports the host's pid, so this process gets a "Process N" line
    too. When no line is this process's own and the lines plus its reserved memory exceed what
    the device has in use (total - free), one of them is this process: the smallest that holds
    at least its reserved memory.
    """
    own = next((pm.used_bytes for pm in parsed.processes if pm.pid is None), None)
    lines = [pm.used_bytes for pm in parsed.processes if pm.pid is not None]
    if own is None and lines and parsed.total_bytes is not None and parsed.free_bytes is not None:
        slack = parsed.tolerance_bytes.get("total_bytes", 0) + parsed.tolerance_bytes.get(
            "free_bytes", 0
        )
        tolerance = parsed.tolerance_bytes.get("reserved_bytes", 0)
        if r + sum(lines) > parsed.total_bytes - parsed.free_bytes + slack:
            holding = [used for used in lines if used + tolerance >= r]
            if holding:
                own = min(holding)
                lines.remove(own)
    return own, sum(lines)


def memory_paragraph(
    parsed: OomText, *, a: int, r: int, u: int, o: int, t: int, f: int, context: ContextRange
) -> str:
    if parsed.reserved_bytes is None:
        return (
            f"PyTorch's cudaMallocAsync backend had {format_bytes(a)} in live allocations "
            f"(torch.cuda.memory_allocated). nvidia-smi would show about {format_bytes(t - f)} "
            "used on the device, the driver's memory pool and every other process included."
        )
    return (
        f"Allocated ({format_bytes(a)}, torch.cuda.memory_allocated) is what live tensors use. "
        f"Reserved ({format_bytes(r)}, torch.cuda.memory_reserved) is what PyTorch's caching "
        f"allocator holds from the driver: the allocated memory plus {format_bytes(u)} cached "
        f"for reuse. nvidia-smi shows about {format_bytes(t - f)} used: the reserved memory plus "
        f"{format_bytes(o)} outside the allocator (the CUDA context and libraries such as cuBLAS "
        f"and NCCL, {context.describe()}, and any other process)."
    )


# Boards that run only in TCC mode or on Linux, where cudaMalloc never pages device memory out to
# system memory: PyTorch's reserved memory cannot exceed their total. (Windows' WDDM mode, which
# consumer and some workstation boards run, lets allocations spill into "shared GPU memory";
# real messages show 13.98 GiB allocated on an 8.00 GiB card.)
_NO_SHARED_MEMORY = ("A100", "H100", "H200", "B200", "GH200", "V100", "P100")
# WDDM's shared GPU memory is half the system RAM; Windows 10/11 Pro address at most 2 TiB.
_MAX_SHARED_BYTES = 2**40


def inconsistency(parsed: OomText, gpu: GpuSpec | None = None) -> str | None:
    """What makes the message's figures impossible together; None where they can be true."""
    total, free = parsed.total_bytes, parsed.free_bytes
    tol = parsed.tolerance_bytes
    if total is None:
        return None
    if free is not None and free > total + tol.get("total_bytes", 0) + tol.get("free_bytes", 0):
        return (
            f"it says {format_bytes(free)} is free on a GPU with {format_bytes(total)} in total"
        )
    reserved = parsed.reserved_bytes
    allocated = parsed.allocated_bytes
    if (
        parsed.variant == "classic"
        and parsed.torch_versions == "1.5-2.0"
        and allocated is not None
        and reserved is not None
        and allocated > reserved + tol.get("allocated_bytes", 0) + tol.get("reserved_bytes", 0)
    ):
        return (
            f"it says {format_bytes(allocated)} is allocated but only {format_bytes(reserved)} "
            "reserved, and PyTorch allocates only from what it reserves"
        )
    # NVML's per-process figures are device memory too (this process's includes its context).
    held = max([reserved or 0, allocated or 0, *(pm.used_bytes for pm in parsed.processes)])
    slack = tol.get("total_bytes", 0) + tol.get("reserved_bytes", 0)
    spec = matched_gpu(parsed, gpu)
    if spec is not None and spec.name.startswith(_NO_SHARED_MEMORY) and held > total + slack:
        return (
            f"it says {format_bytes(held)} is in use on a GPU with {format_bytes(total)} in "
            f"total (matched to the {spec.name}, a board that cannot page device memory out to "
            "system memory)"
        )
    if held > total + _MAX_SHARED_BYTES:
        return (
            f"it says {format_bytes(held)} is in use on a GPU with {format_bytes(total)} in "
            "total, more than even Windows' shared GPU memory could add"
        )
    return None


def figure_warnings(
    parsed: OomText, *, held_bytes: int, cached_bytes: int, expandable_segments: bool | None
) -> list[str]:
    """What the figures say beside the causes: WDDM's shared memory, expandable segments on."""
    warnings: list[str] = []
    t = parsed.total_bytes or 0
    if t and held_bytes > t + parsed.tolerance_bytes.get("total_bytes", 0):
        warnings.append(
            f"PyTorch holds {format_bytes(held_bytes)}, more than the device's "
            f"{format_bytes(t)}: only Windows' WDDM driver allows that, by spilling into "
            "'shared GPU memory' (system RAM over PCIe, many times slower); the device itself "
            "is full"
        )
    if expandable_segments and parsed.variant != "cuda_malloc_async":
        # The message's "try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" is
        # printed whatever the setting (CUDACachingAllocator.cpp malloc's OOM text).
        warnings.append(
            "PyTorch's message suggests PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, but "
            "this run already had it on"
            + (
                f": the {format_bytes(cached_bytes)} cached but unallocated is held in partly "
                "used pages of expandable segments, which only empty_cache() or the OOM path "
                "unmaps"
                if cached_bytes > 0
                else ""
            )
            + " (`oomkit doctor` shows the settings in effect)"
        )
    return warnings

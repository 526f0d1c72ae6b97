"""The CUDA context an OOM message's process likely had: a range, not a point (issue 14 item 5).

Memory outside the caching allocator (``total - free - reserved``) holds this process's CUDA
context and the libraries it loaded (cuBLAS, cuDNN, NCCL) before anything else; only what lies
clearly above the context's upper bound is someone else's (another process). The range comes
from ``oomkit.core.gpus.overhead.cuda_context`` for the GPU's compute capability and the loading
mode the message's PyTorch release implies: 2.1+ builds all use CUDA >= 11.8 (lazy loading);
1.13 and 2.0 shipped CUDA 11.6-11.8 builds, older releases CUDA <= 11.6 (eager).
"""

from __future__ import annotations

from dataclasses import dataclass

from oomkit.core.gpus import CATALOG, GpuSpec
from oomkit.core.gpus.overhead import cuda_context
from oomkit.diagnose.oom_text import OomText
from oomkit.units import format_bytes

__all__ = ["ContextRange", "context_range"]


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


def _device(parsed: OomText, gpu: GpuSpec | None) -> GpuSpec | None:
    if gpu is not None:
        return gpu
    total = parsed.total_bytes
    if total is None:
        return None
    # A catalog GPU whose total memory the message's figure matches (to format_size precision).
    tolerance = parsed.tolerance_bytes.get("total_bytes", 0)
    for spec in CATALOG:
        if abs(spec.total_memory_bytes - total) <= tolerance:
            return spec
    return None


def context_range(parsed: OomText, gpu: GpuSpec | None = None) -> ContextRange:
    """The context range for the message's device (given, else matched by total memory)."""
    spec = _device(parsed, gpu)
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

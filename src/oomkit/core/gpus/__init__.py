"""The device catalog: what PyTorch reports as total memory on common NVIDIA GPUs.

``get_gpu("h100")`` returns a frozen ``GpuSpec`` whose ``usable_bytes()`` is the most PyTorch's
caching allocator can reserve there: ``total_memory`` less the CUDA context. Every figure carries
its source in ``GpuSpec.source_notes``; context sizes are estimates that callers can override.
"""

from __future__ import annotations

from oomkit.core.gpus.catalog import CATALOG
from oomkit.core.gpus.cuda_versions import CudaBuild, cuda_build_for, installed_cuda_build
from oomkit.core.gpus.lookup import UnknownGpuError, get_gpu, list_gpus, normalize_gpu_name
from oomkit.core.gpus.overhead import (
    CONTEXT_OVERHEAD_BYTES,
    DEFAULT_CONTEXT_OVERHEAD_BYTES,
    CudaContext,
    ModuleLoading,
    cuda_context,
)
from oomkit.core.gpus.spec import (
    DEFAULT_KERNEL_COMPUTE_CAPABILITY,
    Architecture,
    GpuSpec,
    GpuSpecError,
    MemorySource,
)

__all__ = [
    "Architecture",
    "CATALOG",
    "CONTEXT_OVERHEAD_BYTES",
    "CudaBuild",
    "CudaContext",
    "ModuleLoading",
    "cuda_build_for",
    "cuda_context",
    "installed_cuda_build",
    "DEFAULT_CONTEXT_OVERHEAD_BYTES",
    "DEFAULT_KERNEL_COMPUTE_CAPABILITY",
    "GpuSpec",
    "GpuSpecError",
    "MemorySource",
    "UnknownGpuError",
    "get_gpu",
    "list_gpus",
    "normalize_gpu_name",
]

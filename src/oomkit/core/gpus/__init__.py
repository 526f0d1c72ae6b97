"""The device catalog: what PyTorch reports as total memory on common NVIDIA GPUs.

``get_gpu("h100")`` returns a frozen ``GpuSpec`` whose ``usable_bytes()`` is the most PyTorch's
caching allocator can reserve there: ``total_memory`` less the CUDA context. Every figure carries
its source in ``GpuSpec.source_notes``; context sizes are estimates that callers can override.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from oomkit._lazy import lazy_exports

if TYPE_CHECKING:
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

# Imported on first use (PEP 562): a snapshot's diagnosis needs GpuSpec and the context figures,
# not the catalog, its name lookup (difflib) or the CUDA builds (issue 41 item 4: start-up).
_LAZY: dict[str, str] = {
    "CATALOG": "oomkit.core.gpus.catalog",
    "CudaBuild": "oomkit.core.gpus.cuda_versions",
    "cuda_build_for": "oomkit.core.gpus.cuda_versions",
    "installed_cuda_build": "oomkit.core.gpus.cuda_versions",
    "UnknownGpuError": "oomkit.core.gpus.lookup",
    "get_gpu": "oomkit.core.gpus.lookup",
    "list_gpus": "oomkit.core.gpus.lookup",
    "normalize_gpu_name": "oomkit.core.gpus.lookup",
    "CONTEXT_OVERHEAD_BYTES": "oomkit.core.gpus.overhead",
    "DEFAULT_CONTEXT_OVERHEAD_BYTES": "oomkit.core.gpus.overhead",
    "CudaContext": "oomkit.core.gpus.overhead",
    "ModuleLoading": "oomkit.core.gpus.overhead",
    "cuda_context": "oomkit.core.gpus.overhead",
    "DEFAULT_KERNEL_COMPUTE_CAPABILITY": "oomkit.core.gpus.spec",
    "Architecture": "oomkit.core.gpus.spec",
    "GpuSpec": "oomkit.core.gpus.spec",
    "GpuSpecError": "oomkit.core.gpus.spec",
    "MemorySource": "oomkit.core.gpus.spec",
}

__getattr__, __dir__ = lazy_exports(globals(), _LAZY)

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

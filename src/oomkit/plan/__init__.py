"""Planning: what-if searches over a workload (allocator settings, batch size, GPU).

``tune`` sweeps ``PYTORCH_CUDA_ALLOC_CONF`` settings over a trace or snapshot and ranks them;
``max_batch_size`` and ``smallest_gpu`` search predictions for the largest batch / smallest GPU
that fits; ``smallest_gpu_count`` how many GPUs of which kind a global batch needs under FSDP2.
Takes records, returns records; never prints.
"""

from __future__ import annotations

from oomkit.plan.batch_search import (
    BatchProbe,
    BatchSearchResult,
    GpuFit,
    SmallestGpuResult,
    default_margin_bytes,
    max_batch_size,
    smallest_gpu,
)
from oomkit.plan.smallest_gpu import GpuCountResult, GpuCountRow, smallest_gpu_count
from oomkit.plan.tuning import (
    DEFAULT_GRID,
    FLAG_REASONS,
    NOT_RECOMMENDED_FLAGS,
    TuningCandidate,
    TuningResult,
    TuningSource,
    tune,
)

__all__ = [
    "BatchProbe",
    "BatchSearchResult",
    "DEFAULT_GRID",
    "FLAG_REASONS",
    "GpuCountResult",
    "GpuCountRow",
    "GpuFit",
    "NOT_RECOMMENDED_FLAGS",
    "SmallestGpuResult",
    "TuningCandidate",
    "TuningResult",
    "TuningSource",
    "default_margin_bytes",
    "max_batch_size",
    "smallest_gpu",
    "smallest_gpu_count",
    "tune",
]

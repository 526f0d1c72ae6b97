"""Planning: what-if searches over a workload (allocator settings, batch size, GPU).

``tune`` sweeps ``PYTORCH_CUDA_ALLOC_CONF`` settings over a trace or snapshot and ranks them;
``max_batch_size`` and ``smallest_gpu`` search predictions for the largest batch / smallest GPU
that fits; ``smallest_gpu_count`` how many GPUs of which kind a global batch needs under FSDP2.
Takes records, returns records; never prints.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from oomkit._lazy import lazy_exports

if TYPE_CHECKING:
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

# Imported on first use (PEP 562): `oomkit tune` and `oomkit explain SNAPSHOT` need the
# settings sweep (plan.tuning), not the batch and GPU searches with their process executors
# (issue 41 item 4: start-up).
_LAZY: dict[str, str] = {
    "BatchProbe": "oomkit.plan.batch_search",
    "BatchSearchResult": "oomkit.plan.batch_search",
    "GpuFit": "oomkit.plan.batch_search",
    "SmallestGpuResult": "oomkit.plan.batch_search",
    "default_margin_bytes": "oomkit.plan.batch_search",
    "max_batch_size": "oomkit.plan.batch_search",
    "smallest_gpu": "oomkit.plan.batch_search",
    "GpuCountResult": "oomkit.plan.smallest_gpu",
    "GpuCountRow": "oomkit.plan.smallest_gpu",
    "smallest_gpu_count": "oomkit.plan.smallest_gpu",
    "DEFAULT_GRID": "oomkit.plan.tuning",
    "FLAG_REASONS": "oomkit.plan.tuning",
    "NOT_RECOMMENDED_FLAGS": "oomkit.plan.tuning",
    "TuningCandidate": "oomkit.plan.tuning",
    "TuningResult": "oomkit.plan.tuning",
    "TuningSource": "oomkit.plan.tuning",
    "tune": "oomkit.plan.tuning",
}


__getattr__, __dir__ = lazy_exports(globals(), _LAZY)

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

"""Analysis: takes records (traces, snapshots, replay results) and returns records; never prints.

``tune`` sweeps ``PYTORCH_CUDA_ALLOC_CONF`` settings over a workload and ranks them.
"""

from __future__ import annotations

from oomkit.analysis.tuning import (
    DEFAULT_GRID,
    FLAG_REASONS,
    NOT_RECOMMENDED_FLAGS,
    TuningCandidate,
    TuningResult,
    TuningSource,
    tune,
)

__all__ = [
    "DEFAULT_GRID",
    "FLAG_REASONS",
    "NOT_RECOMMENDED_FLAGS",
    "TuningCandidate",
    "TuningResult",
    "TuningSource",
    "tune",
]

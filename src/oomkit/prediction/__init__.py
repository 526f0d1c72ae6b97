"""Prediction: record a step without a GPU (``tracing``, ``models``) and replay it on a target.

``predict`` / ``predict_recording`` predict a recorded step's peak memory on a named GPU and
return a ``Prediction``. ``tracing`` (the GPU-free recorder) and ``models`` (the presets) need
torch and are imported only when used; importing this package does not import torch.
"""

from __future__ import annotations

from oomkit.prediction.predictor import (
    OomPoint,
    PeakBreakdown,
    Prediction,
    StepPeak,
    TimelinePoint,
    predict,
    predict_recording,
)
from oomkit.prediction.workload import WorkloadSpec

__all__ = [
    "OomPoint",
    "PeakBreakdown",
    "Prediction",
    "StepPeak",
    "TimelinePoint",
    "WorkloadSpec",
    "predict",
    "predict_recording",
]

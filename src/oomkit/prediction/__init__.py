"""Prediction: record a step without a GPU (``tracing``, ``models``) and replay it on a target.

``predict`` / ``predict_recording`` predict a recorded step's peak memory on a named GPU and
return a ``Prediction``; ``predict_script`` does it for a whole training script run as
``python train.py ARGS`` would run it. ``tracing`` (the GPU-free recorder) and ``models`` (the presets) need
torch and are imported only when used; importing this package does not import torch.
"""

from __future__ import annotations

from oomkit.prediction.module_groups import ModuleGroup, group_modules
from oomkit.prediction.predictor import (
    OomPoint,
    PeakBreakdown,
    Prediction,
    StepPeak,
    TimelinePoint,
    predict,
    predict_recording,
)
from oomkit.prediction.scripts import ScriptPrediction, predict_script
from oomkit.prediction.summary import prediction_summary, verdict_line
from oomkit.prediction.workload import WorkloadSpec

__all__ = [
    "ModuleGroup",
    "OomPoint",
    "PeakBreakdown",
    "Prediction",
    "ScriptPrediction",
    "StepPeak",
    "TimelinePoint",
    "WorkloadSpec",
    "group_modules",
    "predict",
    "predict_recording",
    "predict_script",
    "prediction_summary",
    "verdict_line",
]

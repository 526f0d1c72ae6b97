"""Prediction: record a step without a GPU (``tracing``, ``models``) and replay it on a target.

``predict`` / ``predict_recording`` predict a recorded step's peak memory on a named GPU and
return a ``Prediction``; ``predict_script`` does it for a whole training script run as
``python train.py ARGS`` would run it. ``tracing`` (the GPU-free recorder) and ``models`` (the presets) need
torch and are imported only when used; importing this package does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from oomkit._lazy import lazy_exports

if TYPE_CHECKING:
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

# Imported on first use (PEP 562): a command that reads a saved workload
# (prediction.workload) does not import the predictor, its replay and the script runner
# (issue 41 item 4: start-up).
_LAZY: dict[str, str] = {
    "ModuleGroup": "oomkit.prediction.module_groups",
    "group_modules": "oomkit.prediction.module_groups",
    "OomPoint": "oomkit.prediction.predictor",
    "PeakBreakdown": "oomkit.prediction.predictor",
    "Prediction": "oomkit.prediction.predictor",
    "StepPeak": "oomkit.prediction.predictor",
    "TimelinePoint": "oomkit.prediction.predictor",
    "predict": "oomkit.prediction.predictor",
    "predict_recording": "oomkit.prediction.predictor",
    "ScriptPrediction": "oomkit.prediction.scripts",
    "predict_script": "oomkit.prediction.scripts",
    "prediction_summary": "oomkit.prediction.summary",
    "verdict_line": "oomkit.prediction.summary",
    "WorkloadSpec": "oomkit.prediction.workload",
}


__getattr__, __dir__ = lazy_exports(globals(), _LAZY)

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

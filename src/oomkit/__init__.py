"""oomkit: predict, explain and prevent CUDA out-of-memory errors in PyTorch.

``oomkit.predict(step_fn, *args, gpu="rtx4090")`` predicts a step's peak GPU memory without a GPU.
``import oomkit`` never imports torch; features that need torch import it when used.
"""

from __future__ import annotations

from oomkit._version import __version__
from oomkit.core.target import Target
from oomkit.errors import (
    AllocatorUsageError,
    ConfigError,
    NoFeasibleBatchSizeError,
    OomkitError,
    SnapshotFormatError,
    TorchRequiredError,
    TraceFormatError,
    UnsupportedOpError,
)
from oomkit.interfaces.reports.monitor_live import live_monitor
from oomkit.interfaces.reports.prediction import (
    prediction_summary,
    prediction_to_json,
    render_prediction,
    verdict_line,
)
from oomkit.plan.batch_search import BatchSearchResult, max_batch_size, smallest_gpu
from oomkit.prediction.predictor import Prediction, predict, predict_recording
from oomkit.runtime.batch_probe import BatchSizeResult, find_batch_size
from oomkit.runtime.monitor import Monitor, StepRecord
from oomkit.runtime.resilient import resilient
from oomkit.runtime.watch import watch
from oomkit.units import format_bytes, parse_bytes

__all__ = [
    "__version__",
    "AllocatorUsageError",
    "BatchSearchResult",
    "BatchSizeResult",
    "ConfigError",
    "Monitor",
    "NoFeasibleBatchSizeError",
    "OomkitError",
    "Prediction",
    "SnapshotFormatError",
    "StepRecord",
    "Target",
    "TorchRequiredError",
    "TraceFormatError",
    "UnsupportedOpError",
    "find_batch_size",
    "format_bytes",
    "live_monitor",
    "max_batch_size",
    "parse_bytes",
    "predict",
    "predict_recording",
    "prediction_summary",
    "prediction_to_json",
    "render_prediction",
    "resilient",
    "smallest_gpu",
    "verdict_line",
    "watch",
]

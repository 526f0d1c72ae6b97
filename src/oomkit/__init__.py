"""oomkit: predict, explain and prevent CUDA out-of-memory errors in PyTorch.

``oomkit.predict("gpt2-124m", batch=8, seq=1024, gpu="rtx4090")`` predicts a step's peak GPU
memory without a GPU; so do ``oomkit.predict(scenario)`` (a ``Scenario``, or
``oomkit.load_scenario("run.toml")``) and ``oomkit.predict(step_fn, *args, gpu="rtx4090")``.
``oomkit.fit(...)`` finds the largest batch (``oomkit.fit_alternatives(...)``: with each change
that applies, when not even batch 1 fits), ``oomkit.explain(...)`` explains an OOM.
``import oomkit`` never imports torch (nor pydantic); features that need them import them when
used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from oomkit._lazy import lazy_exports
from oomkit._version import __version__
from oomkit.errors import (
    AllocatorUsageError,
    ConfigError,
    NoFeasibleBatchSizeError,
    OomkitError,
    ScenarioError,
    SnapshotFormatError,
    TorchRequiredError,
    TraceFormatError,
    UnsupportedOpError,
)
from oomkit.units import format_bytes, parse_bytes

if TYPE_CHECKING:
    from oomkit.core.target import Target
    from oomkit.diagnose.diagnosis import Diagnosis
    from oomkit.interfaces.reports.monitor_live import live_monitor
    from oomkit.interfaces.reports.prediction import (
        prediction_summary,
        prediction_to_json,
        render_prediction,
        verdict_line,
    )
    from oomkit.plan.batch_search import BatchSearchResult, max_batch_size, smallest_gpu
    from oomkit.prediction.predictor import Prediction, predict_recording
    from oomkit.runtime.batch_probe import BatchSizeResult, find_batch_size
    from oomkit.runtime.monitor import Monitor, StepRecord
    from oomkit.runtime.resilient import resilient
    from oomkit.runtime.watch import watch
    from oomkit.scenario import Scenario, load_scenario
    from oomkit.scenario.alternatives import FitAlternative
    from oomkit.scenario.api import fit, fit_alternatives, predict
    from oomkit.scenario.explaining import explain
    from oomkit.scenario.fitting import FitAnswer

# The rest of the API is imported on first use (PEP 562), so that ``import oomkit`` and the
# CLI's start-up load only what a command uses (issue 19 item 4: `oomkit replay FILE` needs no
# predictor, runtime or reports). Every name here is also in ``__all__``.
_LAZY: dict[str, str] = {
    "Target": "oomkit.core.target",
    "live_monitor": "oomkit.interfaces.reports.monitor_live",
    "prediction_summary": "oomkit.interfaces.reports.prediction",
    "prediction_to_json": "oomkit.interfaces.reports.prediction",
    "render_prediction": "oomkit.interfaces.reports.prediction",
    "verdict_line": "oomkit.interfaces.reports.prediction",
    "BatchSearchResult": "oomkit.plan.batch_search",
    "max_batch_size": "oomkit.plan.batch_search",
    "smallest_gpu": "oomkit.plan.batch_search",
    "Diagnosis": "oomkit.diagnose.diagnosis",
    "FitAlternative": "oomkit.scenario.alternatives",
    "FitAnswer": "oomkit.scenario.fitting",
    "Prediction": "oomkit.prediction.predictor",
    "Scenario": "oomkit.scenario",
    "explain": "oomkit.scenario.explaining",
    "fit": "oomkit.scenario.api",
    "fit_alternatives": "oomkit.scenario.api",
    "load_scenario": "oomkit.scenario",
    "predict": "oomkit.scenario.api",
    "predict_recording": "oomkit.prediction.predictor",
    "BatchSizeResult": "oomkit.runtime.batch_probe",
    "find_batch_size": "oomkit.runtime.batch_probe",
    "Monitor": "oomkit.runtime.monitor",
    "StepRecord": "oomkit.runtime.monitor",
    "resilient": "oomkit.runtime.resilient",
    "watch": "oomkit.runtime.watch",
}


__getattr__, __dir__ = lazy_exports(globals(), _LAZY)


__all__ = [
    "__version__",
    "AllocatorUsageError",
    "BatchSearchResult",
    "BatchSizeResult",
    "ConfigError",
    "Diagnosis",
    "FitAlternative",
    "FitAnswer",
    "Monitor",
    "NoFeasibleBatchSizeError",
    "OomkitError",
    "Prediction",
    "Scenario",
    "ScenarioError",
    "SnapshotFormatError",
    "StepRecord",
    "Target",
    "TorchRequiredError",
    "TraceFormatError",
    "UnsupportedOpError",
    "explain",
    "find_batch_size",
    "fit",
    "fit_alternatives",
    "format_bytes",
    "live_monitor",
    "load_scenario",
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

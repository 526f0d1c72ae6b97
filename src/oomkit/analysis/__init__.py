"""Analysis: takes records (traces, snapshots, replay results) and returns records; never prints.

``tune`` sweeps ``PYTORCH_CUDA_ALLOC_CONF`` settings over a workload and ranks them.
``predict`` / ``predict_recording`` predict a recorded step's peak memory on a named GPU.
``parse_oom_text`` reads an OOM message's figures; ``diagnose_oom_text`` names its causes;
``diagnose_snapshot`` and ``diagnose_prediction`` do the same from a snapshot or a saved prediction.
``detect_leak`` / ``attribute_leak`` / ``detect_fragmentation`` (``memory_findings`` for all) judge
a monitored run's per-step memory.
"""

from __future__ import annotations

from oomkit.analysis.attribution import AllocationSite, Attribution, LiveTensor
from oomkit.analysis.batch_search import (
    BatchProbe,
    BatchSearchResult,
    GpuFit,
    SmallestGpuResult,
    default_margin_bytes,
    max_batch_size,
    smallest_gpu,
)
from oomkit.analysis.diagnosis import CAUSES, Cause, Diagnosis, Finding, Remedy, diagnose_oom_text
from oomkit.analysis.memory_health import (
    FragmentationFinding,
    LeakCause,
    LeakFinding,
    LeakSite,
    MemorySample,
    attribute_leak,
    detect_fragmentation,
    detect_leak,
    explain_leak,
    memory_findings,
    samples_from_records,
)
from oomkit.analysis.oom_text import OomText, ProcessMemory, find_oom_texts, parse_oom_text
from oomkit.analysis.prediction import (
    OomPoint,
    PeakBreakdown,
    Prediction,
    StepPeak,
    TimelinePoint,
    predict,
    predict_recording,
)
from oomkit.analysis.prediction_diagnosis import diagnose_prediction
from oomkit.analysis.snapshot_diagnosis import diagnose_snapshot
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
    "BatchProbe",
    "BatchSearchResult",
    "GpuFit",
    "SmallestGpuResult",
    "default_margin_bytes",
    "max_batch_size",
    "smallest_gpu",
    "CAUSES",
    "Cause",
    "DEFAULT_GRID",
    "Diagnosis",
    "Finding",
    "OomText",
    "ProcessMemory",
    "Remedy",
    "diagnose_oom_text",
    "diagnose_prediction",
    "diagnose_snapshot",
    "AllocationSite",
    "Attribution",
    "LiveTensor",
    "find_oom_texts",
    "FragmentationFinding",
    "LeakCause",
    "LeakFinding",
    "LeakSite",
    "MemorySample",
    "attribute_leak",
    "detect_fragmentation",
    "detect_leak",
    "explain_leak",
    "memory_findings",
    "samples_from_records",
    "parse_oom_text",
    "FLAG_REASONS",
    "NOT_RECOMMENDED_FLAGS",
    "OomPoint",
    "PeakBreakdown",
    "Prediction",
    "StepPeak",
    "TimelinePoint",
    "TuningCandidate",
    "TuningResult",
    "TuningSource",
    "predict",
    "predict_recording",
    "tune",
]

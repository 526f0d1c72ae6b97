"""Diagnosis: why memory ran out (or is about to), with ranked remedies; never prints.

``parse_oom_text`` reads an OOM message's figures; ``diagnose_oom_text`` names its causes;
``diagnose_snapshot`` and ``diagnose_prediction`` do the same from a snapshot or a saved
prediction. ``detect_leak`` / ``attribute_leak`` / ``detect_fragmentation`` (``memory_findings``
for all) judge a monitored run's per-step memory.
"""

from __future__ import annotations

from oomkit.diagnose.attribution import AllocationSite, Attribution, LiveTensor
from oomkit.diagnose.diagnosis import CAUSES, Cause, Diagnosis, Finding, Remedy, diagnose_oom_text
from oomkit.diagnose.memory_health import (
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
from oomkit.diagnose.oom_text import OomText, ProcessMemory, find_oom_texts, parse_oom_text
from oomkit.diagnose.prediction_diagnosis import diagnose_prediction
from oomkit.diagnose.settings_doctor import (
    LiveAllocator,
    SettingsFinding,
    SettingsReport,
    doctor_environment,
    doctor_snapshot,
)
from oomkit.diagnose.snapshot_diagnosis import diagnose_snapshot

__all__ = [
    "AllocationSite",
    "Attribution",
    "CAUSES",
    "Cause",
    "Diagnosis",
    "Finding",
    "FragmentationFinding",
    "LeakCause",
    "LeakFinding",
    "LeakSite",
    "LiveAllocator",
    "LiveTensor",
    "MemorySample",
    "OomText",
    "ProcessMemory",
    "Remedy",
    "SettingsFinding",
    "SettingsReport",
    "attribute_leak",
    "detect_fragmentation",
    "detect_leak",
    "diagnose_oom_text",
    "diagnose_prediction",
    "diagnose_snapshot",
    "doctor_environment",
    "doctor_snapshot",
    "explain_leak",
    "find_oom_texts",
    "memory_findings",
    "parse_oom_text",
    "samples_from_records",
]

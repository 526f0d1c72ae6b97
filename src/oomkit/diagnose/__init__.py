"""Diagnosis: why memory ran out (or is about to), with ranked remedies; never prints.

``parse_oom_text`` reads an OOM message's figures; ``diagnose_oom_text`` names its causes;
``diagnose_snapshot`` and ``diagnose_prediction`` do the same from a snapshot or a saved
prediction. ``detect_leak`` / ``attribute_leak`` / ``detect_fragmentation`` (``memory_findings``
for all) judge a monitored run's per-step memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from oomkit._lazy import lazy_exports

if TYPE_CHECKING:
    from oomkit.diagnose.attribution import AllocationSite, Attribution, LiveTensor
    from oomkit.diagnose.diagnosis import (
        CAUSES,
        Cause,
        Diagnosis,
        Finding,
        Remedy,
        diagnose_oom_text,
    )
    from oomkit.diagnose.measured_remedy import MeasuredRemedy
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
    from oomkit.diagnose.oom_traceback import OomLocation, find_oom_location
    from oomkit.diagnose.prediction_diagnosis import diagnose_prediction
    from oomkit.diagnose.remedy_measurement import prediction_remedies
    from oomkit.diagnose.settings_doctor import (
        LiveAllocator,
        SettingsFinding,
        SettingsReport,
        doctor_environment,
        doctor_snapshot,
    )
    from oomkit.diagnose.snapshot_diagnosis import diagnose_snapshot

# Imported on first use (PEP 562): `oomkit explain TEXT` needs the OOM-text parser and its
# diagnosis, not the leak and fragmentation judges (which import the planner) nor the snapshot
# diagnosis (issue 19 item 4: start-up).
_LAZY: dict[str, str] = {
    "AllocationSite": "oomkit.diagnose.attribution",
    "Attribution": "oomkit.diagnose.attribution",
    "LiveTensor": "oomkit.diagnose.attribution",
    "CAUSES": "oomkit.diagnose.diagnosis",
    "Cause": "oomkit.diagnose.diagnosis",
    "Diagnosis": "oomkit.diagnose.diagnosis",
    "Finding": "oomkit.diagnose.diagnosis",
    "Remedy": "oomkit.diagnose.diagnosis",
    "diagnose_oom_text": "oomkit.diagnose.diagnosis",
    "FragmentationFinding": "oomkit.diagnose.memory_health",
    "LeakCause": "oomkit.diagnose.memory_health",
    "LeakFinding": "oomkit.diagnose.memory_health",
    "LeakSite": "oomkit.diagnose.memory_health",
    "MemorySample": "oomkit.diagnose.memory_health",
    "attribute_leak": "oomkit.diagnose.memory_health",
    "detect_fragmentation": "oomkit.diagnose.memory_health",
    "detect_leak": "oomkit.diagnose.memory_health",
    "explain_leak": "oomkit.diagnose.memory_health",
    "memory_findings": "oomkit.diagnose.memory_health",
    "samples_from_records": "oomkit.diagnose.memory_health",
    "OomText": "oomkit.diagnose.oom_text",
    "ProcessMemory": "oomkit.diagnose.oom_text",
    "find_oom_texts": "oomkit.diagnose.oom_text",
    "parse_oom_text": "oomkit.diagnose.oom_text",
    "OomLocation": "oomkit.diagnose.oom_traceback",
    "find_oom_location": "oomkit.diagnose.oom_traceback",
    "diagnose_prediction": "oomkit.diagnose.prediction_diagnosis",
    "MeasuredRemedy": "oomkit.diagnose.measured_remedy",
    "prediction_remedies": "oomkit.diagnose.remedy_measurement",
    "LiveAllocator": "oomkit.diagnose.settings_doctor",
    "SettingsFinding": "oomkit.diagnose.settings_doctor",
    "SettingsReport": "oomkit.diagnose.settings_doctor",
    "doctor_environment": "oomkit.diagnose.settings_doctor",
    "doctor_snapshot": "oomkit.diagnose.settings_doctor",
    "diagnose_snapshot": "oomkit.diagnose.snapshot_diagnosis",
}


__getattr__, __dir__ = lazy_exports(globals(), _LAZY)


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
    "MeasuredRemedy",
    "MemorySample",
    "OomLocation",
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
    "find_oom_location",
    "find_oom_texts",
    "memory_findings",
    "parse_oom_text",
    "prediction_remedies",
    "samples_from_records",
]

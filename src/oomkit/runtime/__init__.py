"""Code that runs inside a user's CUDA process: OOM recovery, batch-size probing, monitors.

Everything here talks to ``torch.cuda`` through :mod:`oomkit.runtime.device`, so tests replace the
GPU with a simulated one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from oomkit._lazy import lazy_exports

if TYPE_CHECKING:
    from oomkit.runtime.batch_probe import BatchSizeResult, BatchTrial, find_batch_size
    from oomkit.runtime.device import (
        DeviceMemory,
        TorchCudaDevice,
        current_device,
        is_out_of_memory,
        release_after_oom,
        use_device,
    )
    from oomkit.runtime.experiment import ExperimentResult, Trial, run_experiment
    from oomkit.runtime.monitor import (
        Monitor,
        MonitorSummary,
        StepRecord,
        load_monitor_log,
        read_monitor_log,
    )
    from oomkit.runtime.resilient import RecoveryEvent, Resilient, resilient
    from oomkit.runtime.simulated import SimulatedCudaDevice
    from oomkit.runtime.watch import MemoryRecorder, ObservedOom, Watch, watch

# Imported on first use (PEP 562): `oomkit report` reads monitor logs without the experiment
# runner, the batch probe or the simulated device (issue 41 item 4: start-up).
_LAZY: dict[str, str] = {
    "BatchSizeResult": "oomkit.runtime.batch_probe",
    "BatchTrial": "oomkit.runtime.batch_probe",
    "find_batch_size": "oomkit.runtime.batch_probe",
    "DeviceMemory": "oomkit.runtime.device",
    "TorchCudaDevice": "oomkit.runtime.device",
    "current_device": "oomkit.runtime.device",
    "is_out_of_memory": "oomkit.runtime.device",
    "release_after_oom": "oomkit.runtime.device",
    "use_device": "oomkit.runtime.device",
    "ExperimentResult": "oomkit.runtime.experiment",
    "Trial": "oomkit.runtime.experiment",
    "run_experiment": "oomkit.runtime.experiment",
    "Monitor": "oomkit.runtime.monitor",
    "MonitorSummary": "oomkit.runtime.monitor",
    "StepRecord": "oomkit.runtime.monitor",
    "load_monitor_log": "oomkit.runtime.monitor",
    "read_monitor_log": "oomkit.runtime.monitor",
    "RecoveryEvent": "oomkit.runtime.resilient",
    "Resilient": "oomkit.runtime.resilient",
    "resilient": "oomkit.runtime.resilient",
    "SimulatedCudaDevice": "oomkit.runtime.simulated",
    "MemoryRecorder": "oomkit.runtime.watch",
    "ObservedOom": "oomkit.runtime.watch",
    "Watch": "oomkit.runtime.watch",
    "watch": "oomkit.runtime.watch",
}

__getattr__, __dir__ = lazy_exports(globals(), _LAZY)

__all__ = [
    "BatchSizeResult",
    "BatchTrial",
    "DeviceMemory",
    "ExperimentResult",
    "MemoryRecorder",
    "Monitor",
    "MonitorSummary",
    "ObservedOom",
    "RecoveryEvent",
    "Resilient",
    "SimulatedCudaDevice",
    "StepRecord",
    "TorchCudaDevice",
    "Trial",
    "Watch",
    "current_device",
    "find_batch_size",
    "is_out_of_memory",
    "load_monitor_log",
    "read_monitor_log",
    "release_after_oom",
    "resilient",
    "run_experiment",
    "use_device",
    "watch",
]

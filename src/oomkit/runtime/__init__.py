"""Code that runs inside a user's CUDA process: OOM recovery, batch-size probing, monitors.

Everything here talks to ``torch.cuda`` through :mod:`oomkit.runtime.device`, so tests replace the
GPU with a simulated one.
"""

from __future__ import annotations

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

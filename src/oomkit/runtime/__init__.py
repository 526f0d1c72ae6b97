"""Code that runs inside a user's CUDA process: OOM recovery, batch-size probing, monitors.

Everything here talks to ``torch.cuda`` through :mod:`oomkit.runtime.device`, so tests replace the
GPU with a simulated one.
"""

from __future__ import annotations

from oomkit.runtime.device import (
    DeviceMemory,
    TorchCudaDevice,
    current_device,
    is_out_of_memory,
    release_after_oom,
    use_device,
)

__all__ = [
    "DeviceMemory",
    "TorchCudaDevice",
    "current_device",
    "is_out_of_memory",
    "release_after_oom",
    "use_device",
]

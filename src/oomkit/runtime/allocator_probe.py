"""Ask the running torch what its CUDA allocator is (for ``oomkit doctor``), without changing it.

Reads ``torch.cuda.get_allocator_backend()`` and the ``allocator_settings`` of
``torch.cuda.memory._snapshot()`` (ref §11.2), both of which only report. Asking does initialise
CUDA in this process, which is why only ``oomkit doctor`` calls it.
"""

from __future__ import annotations

from typing import Any

from oomkit.diagnose.settings_doctor import LiveAllocator

__all__ = ["read_live_allocator"]


def read_live_allocator(torch_module: Any = None) -> LiveAllocator:
    """What the installed (or given) torch reports about its CUDA allocator.

    Args:
        torch_module: the ``torch`` module to ask; None imports it. Tests pass a stand-in.

    Returns:
        The record; without a CUDA device only the version and ``cuda_available=False``.
    """
    if torch_module is None:
        import torch as torch_module
    version = str(torch_module.__version__)
    if not torch_module.cuda.is_available():
        return LiveAllocator(torch_version=version, cuda_available=False)
    # torch/cuda/memory.py get_allocator_backend: "native" or "cudaMallocAsync", fixed at load.
    backend = str(torch_module.cuda.get_allocator_backend())
    settings = None
    if backend == "native":
        # torch/cuda/memory.py _snapshot: a dict with "allocator_settings" on torch >= 2.3.
        recorded = torch_module.cuda.memory._snapshot().get("allocator_settings")
        settings = dict(recorded) if isinstance(recorded, dict) else None
    return LiveAllocator(
        torch_version=version, cuda_available=True, backend=backend, settings=settings
    )

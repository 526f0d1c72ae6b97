"""torch's CUDA bindings that a CPU build lacks, answered for the one emulated GPU.

``torch.cuda``'s Python functions check their arguments, then call a ``torch._C._cuda_*``
binding; a CPU build has none, so a script that calls them stopped the recording with
``AttributeError``. While a step is recorded (``cuda_device.as_one_cuda_gpu``) they answer from
the recording's simulated allocator (``step_memory.StepMemory``), after torch's own checks:

- ``set_per_process_memory_fraction`` / ``get_per_process_memory_fraction``
  (``_cuda_setMemoryFraction``, ``_cuda_getMemoryFraction``): a request of the recording, which
  the report's replay applies (``StepMemory.set_memory_fraction``).
- ``torch.cuda.memory._record_memory_history`` (``_cuda_record_memory_history`` and its legacy
  form) turns the history on or off; ``memory_snapshot()``, ``_snapshot()`` and
  ``_dump_snapshot(path)`` (``_cuda_memorySnapshot``) give the simulated allocator's segments
  and that history (``StepMemory.snapshot``).
- ``memory_stats_as_nested_dict`` (``_cuda_memoryStats``): the counters, nested as PyTorch
  nests them (``memory_stats`` flattens them with dots).
- NVTX ranges (``torch.cuda.nvtx``'s stub raises on a CPU build): nothing to record; each call
  returns 0, the depth or id NVTX would.
- ``set_sync_debug_mode`` / ``get_sync_debug_mode``: kept, nothing checked (no device syncs).
- ``ipc_collect`` (``_cuda_ipc_collect``): one process holds nothing for others.
- ``get_allocator_backend``: ``"native"``, the caching allocator oomkit simulates.
- ``torch.cuda.memory._set_allocator_settings(s)``: replayed where the step calls it, as
  PyTorch updates its live allocator (``StepMemory.set_allocator_settings``).
- ``host_memory_stats`` (``_cuda_hostMemoryStats``): empty; pinned host memory is not
  simulated.
- ``torch.accelerator`` (torch/accelerator/__init__.py, memory.py: ``torch._C._accelerator_*``):
  the current accelerator is ``cuda`` (a CPU build's is None, and accelerate 1.16's
  ``get_torch_accelerator_backend`` then put a script's model on the CPU), and its device,
  memory and synchronising calls are ``torch.cuda``'s as answered while recording
  (``cuda_device._torch_cuda_reports``).

Side streams are ``cuda_streams.py``'s. Not answered (the step stops, saying so): CUDA graphs
and memory pools (``CUDAGraph``, ``MemPool``), raw allocations (``caching_allocator_alloc``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from oomkit.prediction.tracing.step_memory import StepMemory

__all__ = ["cuda_bindings", "nested_stats"]


class _Nvtx:
    """``torch._C._nvtx`` on a machine without CUDA: each range or mark is a no-op."""

    @staticmethod
    def _none(*_args: Any, **_kwargs: Any) -> int:
        return 0

    rangePushA = _none
    rangePop = _none
    rangeStartA = _none
    rangeEnd = _none
    markA = _none
    deviceRangeStart = _none
    deviceRangeEnd = _none


def nested_stats(flat: dict[str, int]) -> dict[str, Any]:
    """``memory_stats()``'s flat keys (``"allocated_bytes.all.peak"``) nested as
    ``torch._C._cuda_memoryStats`` returns them; torch/cuda/memory.py ``memory_stats`` joins
    the levels with dots, so this is its inverse."""
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        *levels, last = key.split(".")
        level = nested
        for name in levels:
            level = level.setdefault(name, {})
        level[last] = value
    return nested


def _accelerator_answers(memory: Callable[[], StepMemory]) -> dict[str, Any]:
    """``torch._C._accelerator_*``, the bindings under ``torch.accelerator``, as the emulated
    GPU's ``torch.cuda`` answers: on a CUDA build each forwards to CUDA's device hooks
    (aten/src/ATen/DeviceAccelerator.cpp), which ``torch.cuda``'s functions also reach."""
    cuda = torch.cuda
    return {
        "_accelerator_getAccelerator": lambda: torch.device("cuda"),
        "_accelerator_getDeviceIndex": lambda: cuda.current_device(),
        "_accelerator_setDeviceIndex": lambda index: cuda.set_device(index),
        # exchangeDevice returns the index it replaced; the emulated current device is 0.
        "_accelerator_exchangeDevice": lambda index: cuda.current_device(),
        "_accelerator_maybeExchangeDevice": lambda index: cuda.current_device(),
        "_accelerator_synchronizeDevice": lambda index: None,
        "_accelerator_getStream": lambda index: cuda.current_stream(),
        "_accelerator_setStream": lambda stream: cuda.set_stream(stream),
        "_accelerator_isAllocatorInitialized": lambda: True,
        "_accelerator_emptyCache": lambda: cuda.empty_cache(),
        "_accelerator_getDeviceStats": lambda index: nested_stats(memory().memory_stats()),
        "_accelerator_resetPeakStats": lambda index: memory().reset_peak_memory_stats(),
        "_accelerator_resetAccumulatedStats": lambda index: (
            memory().reset_accumulated_memory_stats()
        ),
        "_accelerator_getMemoryInfo": lambda index: cuda.mem_get_info(),
    }


@contextlib.contextmanager
def cuda_bindings(memory: Callable[[], StepMemory]) -> Iterator[None]:
    """While open, the bindings above answer from ``memory()`` (the innermost recorder's)."""
    sync_mode = [0]

    def record_history(enabled: object, *args: Any, **_kwargs: Any) -> None:
        # _record_memory_history_impl passes (enabled, context, stacks, max_entries, ...);
        # the legacy form (a bool) (enabled, record_context, trace_alloc_max_entries, ...).
        limit = args[2] if len(args) > 2 and isinstance(args[2], int) else 1 << 62
        if isinstance(enabled, bool):
            limit = args[1] if len(args) > 1 and isinstance(args[1], int) else 1
        memory().record_history(enabled, limit)

    def snapshot(options: Any = None) -> dict[str, Any]:
        # memory_snapshot passes (pool id, pool id, include_traces); _snapshot passes None.
        include = not isinstance(options, tuple) or len(options) < 3 or bool(options[2])
        return memory().snapshot(include_traces=include)

    def set_sync_debug_mode(mode: int) -> None:
        sync_mode[0] = mode

    answers: dict[str, Any] = {
        "_cuda_setMemoryFraction": lambda fraction, device: memory().set_memory_fraction(fraction),
        "_cuda_getMemoryFraction": lambda device: memory().memory_fraction,
        "_cuda_record_memory_history": record_history,
        "_cuda_record_memory_history_legacy": record_history,
        "_cuda_memorySnapshot": snapshot,
        "_cuda_memoryStats": lambda device: nested_stats(memory().memory_stats()),
        "_cuda_set_sync_debug_mode": set_sync_debug_mode,
        "_cuda_get_sync_debug_mode": lambda: sync_mode[0],
        # Pinned host memory is not simulated: its counters are empty, as before any use.
        "_cuda_hostMemoryStats": lambda: {},
        "_cuda_resetAccumulatedHostMemoryStats": lambda: None,
        "_cuda_resetPeakHostMemoryStats": lambda: None,
        "_cuda_ipc_collect": lambda: None,
        "_cuda_getAllocatorBackend": lambda: "native",
        # The current stream's cudaStream_t as an int (torch/csrc/cuda/Module.cpp
        # THCPModule_getCurrentStream_raw): libraries pass it to their kernels (bitsandbytes'
        # CUDA backend takes it at import). The default stream's handle is 0 (nullptr).
        "_cuda_getCurrentRawStream": lambda device: 0,
        # torch.cuda.memory._set_allocator_settings (2.9+ through the accelerator binding;
        # before, the CUDA one): replayed at its point (StepMemory.set_allocator_settings).
        "_accelerator_setAllocatorSettings": lambda env: memory().set_allocator_settings(env),
        "_cuda_cudaCachingAllocator_set_allocator_settings": (
            lambda env: memory().set_allocator_settings(env)
        ),
    }
    answers.update(_accelerator_answers(memory))
    import torch.cuda.nvtx as nvtx

    saved = {name: getattr(torch._C, name, None) for name in answers}
    saved_nvtx = nvtx._nvtx
    for name, answer in answers.items():
        setattr(torch._C, name, answer)
    nvtx._nvtx = _Nvtx()  # type: ignore[assignment]
    try:
        yield
    finally:
        nvtx._nvtx = saved_nvtx
        for name, original in saved.items():
            if original is None:
                delattr(torch._C, name)
            else:
                setattr(torch._C, name, original)

"""The one seam between oomkit's runtime code and ``torch.cuda``.

Everything under ``oomkit.runtime`` (OOM recovery, batch-size probing, monitors, recorders) asks
``current_device()`` for memory numbers and clean-ups instead of calling ``torch.cuda`` itself, so
that tests can put a :class:`~oomkit.runtime.simulated.SimulatedCudaDevice` (or any object with
these methods) in its place with :func:`use_device` and run the real recovery code on CPU.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "DeviceMemory",
    "TorchCudaDevice",
    "current_device",
    "is_out_of_memory",
    "release_after_oom",
    "use_device",
]


@runtime_checkable
class DeviceMemory(Protocol):
    """What runtime code may ask of a CUDA device (a subset of ``torch.cuda``'s memory API)."""

    name: str

    def memory_stats(self) -> dict[str, int]:
        """``torch.cuda.memory_stats()``: the flat dict of allocator statistics."""
        ...

    def memory_allocated(self) -> int:
        """``torch.cuda.memory_allocated()`` in bytes."""
        ...

    def memory_reserved(self) -> int:
        """``torch.cuda.memory_reserved()`` in bytes."""
        ...

    def max_memory_allocated(self) -> int:
        """``torch.cuda.max_memory_allocated()`` in bytes."""
        ...

    def max_memory_reserved(self) -> int:
        """``torch.cuda.max_memory_reserved()`` in bytes."""
        ...

    def reset_peak_memory_stats(self) -> None:
        """``torch.cuda.reset_peak_memory_stats()``."""
        ...

    def mem_get_info(self) -> tuple[int, int]:
        """``torch.cuda.mem_get_info()``: (free bytes, total bytes) of the device."""
        ...

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: return unused cached segments to the driver."""
        ...

    def synchronize(self) -> None:
        """``torch.cuda.synchronize()``."""
        ...


class TorchCudaDevice:
    """The real device: forwards to ``torch.cuda`` for one device index."""

    def __init__(self, index: int | None = None) -> None:
        import torch

        self._torch = torch
        self.index = torch.cuda.current_device() if index is None else index
        self.name = f"cuda:{self.index}"

    def memory_stats(self) -> dict[str, int]:
        return dict(self._torch.cuda.memory_stats(self.index))

    def memory_allocated(self) -> int:
        return int(self._torch.cuda.memory_allocated(self.index))

    def memory_reserved(self) -> int:
        return int(self._torch.cuda.memory_reserved(self.index))

    def max_memory_allocated(self) -> int:
        return int(self._torch.cuda.max_memory_allocated(self.index))

    def max_memory_reserved(self) -> int:
        return int(self._torch.cuda.max_memory_reserved(self.index))

    def reset_peak_memory_stats(self) -> None:
        self._torch.cuda.reset_peak_memory_stats(self.index)

    def mem_get_info(self) -> tuple[int, int]:
        free, total = self._torch.cuda.mem_get_info(self.index)
        return int(free), int(total)

    def empty_cache(self) -> None:
        self._torch.cuda.empty_cache()

    def synchronize(self) -> None:
        self._torch.cuda.synchronize(self.index)


_override: list[DeviceMemory] = []


def current_device() -> DeviceMemory:
    """The device runtime code works on: the innermost :func:`use_device`, else CUDA's current one.

    Raises:
        RuntimeError: no device was installed with :func:`use_device` and CUDA is not available.
    """
    if _override:
        return _override[-1]
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(
            "no CUDA device: oomkit's runtime features need a GPU, or a simulated one "
            "(with oomkit.runtime.SimulatedCudaDevice(gpu='24GiB'): ...)"
        )
    return TorchCudaDevice()


@contextlib.contextmanager
def use_device(device: DeviceMemory) -> Iterator[DeviceMemory]:
    """Make ``device`` what :func:`current_device` returns inside the ``with`` block."""
    _override.append(device)
    try:
        yield device
    finally:
        _override.remove(device)


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is a CUDA out-of-memory error, decided by its type.

    ``torch.OutOfMemoryError`` exists since torch 2.1 (torch/__init__.py); the simulated device
    raises that same type. Message matching is never used (style.md "Errors and input").
    """
    import torch

    return isinstance(exc, torch.OutOfMemoryError)


def release_after_oom(exc: BaseException | None = None) -> None:
    """Free what a caught OOM keeps alive, then return cached memory to the device.

    A caught exception's traceback holds the frames of the failed step, and with them every
    tensor those frames referenced: drop it, collect the cycles, then ``empty_cache`` (PyTorch
    FAQ "My out of memory exception handler can't allocate memory").
    """
    if exc is not None:
        exc.__traceback__ = None
        _clear_frames(exc)
    gc.collect()
    current_device().empty_cache()


def _clear_frames(exc: BaseException) -> None:
    seen: set[int] = set()
    cur: Any = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        cur.__traceback__ = None
        cur = cur.__cause__ or cur.__context__

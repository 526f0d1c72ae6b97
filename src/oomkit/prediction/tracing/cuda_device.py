"""One CUDA GPU, as training frameworks see it, whose tensors land on the meta device.

Why it is needed: Lightning and Hugging Face trainers choose their device, precision and
autocast from what ``torch.cuda`` reports. Without a GPU they pick the CPU: Lightning's
``Trainer(accelerator="gpu")`` and transformers' ``TrainingArguments(bf16=True)`` refuse to build,
``precision="bf16-mixed"`` becomes CPU autocast (which casts nothing on meta tensors, a silent
fp32 step), and ``Trainer.fit`` moves the meta model to the CPU ("Cannot copy out of meta
tensor"). Inside ``as_one_cuda_gpu()`` they choose what they choose on a one-GPU machine
instead, and every tensor they put on ``cuda`` is put on ``meta``, the recorder's stand-in for it.

What it changes while open (all undone on exit):
- ``torch.cuda`` reports one device of the target GPU: ``is_available()`` True,
  ``device_count()`` 1, ``current_device()`` 0, the GPU's name, compute capability and memory,
  bf16 supported on sm >= 8.0 (torch/cuda/__init__.py ``is_bf16_supported``); ``set_device``,
  ``synchronize`` and ``empty_cache`` do nothing (there is no device to act on), and the
  memory counters read 0 (the recorder, not the code under it, measures memory).
- A ``TorchFunctionMode`` puts tensors made or moved to ``cuda`` (``device=`` arguments,
  ``Tensor.to``, ``Tensor.cuda``, ``Module.to`` through them) on ``meta``. A meta tensor sent
  back to the CPU (``Strategy.teardown`` moves the model and optimizer state to the CPU after
  fit) stays where it is: the copy would cost host memory, not GPU memory, and a meta tensor has
  no values to copy. ``pin_memory()`` of a meta tensor is the tensor itself.
- ``torch.isnan``/``torch.isinf`` of a meta tensor, read as a bool (transformers' Trainer skips
  a non-finite loss in its running total), answer False: the loss is taken to be finite, as in
  a healthy run; the answer is counted in ``answered_finite_checks``.

Where it may differ: code that reads other GPU properties than those above, or calls CUDA
functions not listed (``torch.cuda.get_rng_state``), still sees no CUDA and raises.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from oomkit.core.gpus import GpuSpec, get_gpu

__all__ = ["OneCudaGpu", "as_one_cuda_gpu"]

_META = torch.device("meta")
# torch/cuda/__init__.py is_bf16_supported: True from compute capability 8.0 (Ampere) on.
_BF16_MIN_CAPABILITY = (8, 0)


@dataclass(frozen=True)
class _DeviceProperties:
    """What ``torch.cuda.get_device_properties`` reports that frameworks read."""

    name: str
    total_memory: int
    major: int
    minor: int


class OneCudaGpu:
    """What the emulation answered while it was open (read after it closes)."""

    def __init__(self) -> None:
        self.answered_finite_checks = 0
        self.stand_in_reads = 0


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return False


def _is_cpu(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cpu"
    return isinstance(device, str) and device.split(":")[0] == "cpu"


# Reading a scalar: what Python asks of a one-element tensor to get its value.
_READS = frozenset(
    {
        torch.Tensor.item,
        torch.Tensor.__bool__,
        torch.Tensor.__int__,
        torch.Tensor.__float__,
        torch.Tensor.__index__,
        torch.Tensor.tolist,
    }
)
# Reads whose value a trainer only logs or prints (never __bool__: that picks a branch).
_LOGGED_READS = frozenset({torch.Tensor.item, torch.Tensor.__float__, torch.Tensor.tolist})
# Factory functions whose value is the Python number they are given.
_FROM_PYTHON = frozenset({torch.tensor, torch.as_tensor, torch.scalar_tensor})
# Ops whose result on a known scalar is worked out on its CPU copy (no device memory).
_MAX_KNOWN_NUMEL = 1


class _CudaOnMeta(TorchFunctionMode):
    """Puts tensors bound for ``cuda`` on ``meta``; keeps meta tensors sent to the CPU; keeps
    the value of one-element tensors made from Python numbers, so reading them answers it."""

    def __init__(self, record: OneCudaGpu, *, stand_ins: bool) -> None:
        super().__init__()
        self._record = record
        self._stand_ins = stand_ins
        # id(meta tensor) -> (the tensor, its value as a CPU tensor); by id as tensors compare
        # elementwise. Lightning's has_len_all_ranks reads `reduce(torch.tensor(len)) == 0`.
        self._known: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}
        # Results of isnan/isinf on meta tensors of unknown value, by id.
        self._finite_checks: dict[int, weakref.ref[torch.Tensor]] = {}

    def _value(self, value: Any) -> torch.Tensor | None:
        if not isinstance(value, torch.Tensor) or value.device.type != "meta":
            return None
        entry = self._known.get(id(value))
        if entry is None or entry[0]() is not value:
            return None
        return entry[1]

    def _remember(self, result: Any, value: Any) -> None:
        if (
            isinstance(result, torch.Tensor)
            and result.device.type == "meta"
            and isinstance(value, torch.Tensor)
            and value.numel() <= _MAX_KNOWN_NUMEL
        ):
            self._known[id(result)] = (weakref.ref(result), value)

    def _known_result(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``func`` on the CPU copies when every meta tensor it reads has a known value."""
        leaves = [*args, *kwargs.values()]
        metas = [a for a in leaves if isinstance(a, torch.Tensor) and a.device.type == "meta"]
        if not metas or any(self._value(a) is None for a in metas):
            return None

        def cpu(a: Any) -> Any:
            known = self._value(a)
            return a if known is None else known

        try:
            return func(*[cpu(a) for a in args], **{k: cpu(v) for k, v in kwargs.items()})
        except (RuntimeError, TypeError, ValueError):
            return None

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = _META
        self_tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
        on_meta = self_tensor is not None and self_tensor.device.type == "meta"
        if func in _READS and on_meta:
            known = self._value(self_tensor)
            if known is not None:
                return func(known, *args[1:], **kwargs)
            if not self._stand_ins:
                pass
            elif func is torch.Tensor.__bool__:
                ref = self._finite_checks.get(id(self_tensor))
                if ref is not None and ref() is self_tensor:
                    self._record.answered_finite_checks += 1
                    return False
            elif func in _LOGGED_READS and self_tensor is not None and self_tensor.numel() == 1:
                # A trainer reads a loss, a norm or a seed for logging: the value decides nothing
                # that allocates, so a stand-in 0 of the tensor's kind serves.
                self._record.stand_in_reads += 1
                stand_in = torch.zeros((), dtype=self_tensor.dtype, device="cpu")
                return func(stand_in, *args[1:], **kwargs)
        if func is torch.Tensor.to:
            args = tuple(_META if _is_cuda(a) else a for a in args)
            if on_meta:
                # A meta tensor sent to the CPU stays: the CPU is read as its own device.
                args = tuple(_META if _is_cpu(a) else a for a in args)
                if _is_cpu(kwargs.get("device")):
                    kwargs["device"] = _META
        elif func is torch.Tensor.cuda:
            assert self_tensor is not None
            result = self_tensor.to(_META, non_blocking=bool(kwargs.get("non_blocking", False)))
            self._remember(result, self._value(self_tensor))
            return result
        elif func in (torch.Tensor.cpu, torch.Tensor.pin_memory) and on_meta:
            return self_tensor
        if func in _FROM_PYTHON and args and isinstance(args[0], (int, float, bool)):
            if kwargs.get("device") == _META:
                # As on CUDA: made on the CPU, then copied to the device (a copy the recorder
                # sees allocate, where a meta factory from Python data does not pass its hooks).
                value = func(*args, **{**kwargs, "device": "cpu"})
                result = value.to(_META)
                self._remember(result, value)
                return result
        result = func(*args, **kwargs)
        if isinstance(result, torch.Tensor) and result.device.type == "meta":
            if result.numel() <= _MAX_KNOWN_NUMEL:
                self._remember(result, self._known_result(func, args, kwargs))
            if func in (torch.isnan, torch.isinf, torch.Tensor.isnan, torch.Tensor.isinf):
                if result.numel() == 1 and id(result) not in self._known:
                    self._finite_checks[id(result)] = weakref.ref(result)
        return result


@contextlib.contextmanager
def _torch_cuda_reports(gpu: GpuSpec) -> Iterator[None]:
    """``torch.cuda``'s queries answer for one ``gpu``; its device actions do nothing."""
    major, minor = gpu.compute_capability or (9, 0)
    properties = _DeviceProperties(gpu.name, gpu.total_memory_bytes, major, minor)
    answers: dict[str, Any] = {
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "set_device": lambda device: None,
        "synchronize": lambda device=None: None,
        "empty_cache": lambda: None,
        "get_device_name": lambda device=None: gpu.name,
        "get_device_capability": lambda device=None: (major, minor),
        "get_device_properties": lambda device=None: properties,
        "is_bf16_supported": lambda including_emulation=True: (major, minor)
        >= _BF16_MIN_CAPABILITY,
        "memory_allocated": lambda device=None: 0,
        "memory_reserved": lambda device=None: 0,
        "max_memory_allocated": lambda device=None: 0,
        "max_memory_reserved": lambda device=None: 0,
        "reset_peak_memory_stats": lambda device=None: None,
    }
    saved = {name: getattr(torch.cuda, name) for name in answers}
    for name, answer in answers.items():
        setattr(torch.cuda, name, answer)
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(torch.cuda, name, original)


@contextlib.contextmanager
def as_one_cuda_gpu(gpu: GpuSpec | None = None, *, stand_ins: bool = True) -> Iterator[OneCudaGpu]:
    """While open, frameworks see one CUDA ``gpu`` and their CUDA tensors land on meta.

    Args:
        gpu: the GPU reported; ``None`` means an H100 SXM (the recorder's default).
        stand_ins: answer a logged read of an unknown value with 0 and a finiteness check with
            False (a trainer's run); off while a builder runs, where a read may size something.

    Yields:
        A record of what was answered (``answered_finite_checks``).
    """
    record = OneCudaGpu()
    with _torch_cuda_reports(get_gpu("h100-sxm") if gpu is None else gpu), _CudaOnMeta(record, stand_ins=stand_ins):
        yield record

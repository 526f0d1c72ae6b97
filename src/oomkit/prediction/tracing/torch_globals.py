"""torch's process-wide settings a user's code changes, kept with that code and off the caller's.

A script runs in its own process, so what it sets for the whole of torch ends with it:
``torch.set_default_dtype(torch.bfloat16)``, ``torch.set_default_device("cuda")``,
``torch.set_grad_enabled(False)``, ``torch.backends.cudnn.benchmark = True``,
``torch.backends.cuda.enable_flash_sdp(False)``, ``torch.use_deterministic_algorithms(True)``,
``torch.manual_seed(0)``. oomkit runs that code in its own process, which goes on after it: a
Python caller's next ``oomkit.predict``, ``fit``'s next build, the next test. Left set, these
change what later recordings see (the emulations read the cuDNN, SDPA and determinism switches,
and the recorder the grad mode), and a default device of ``cuda`` stays on torch's mode stack.

:class:`TorchGlobals` is those settings at one moment; :class:`UsersGlobals` runs each piece of
a user's code (a file's import, its builder, each step) with the settings the previous piece
left, and gives the caller back its own after each. The CPU random state is given back as well,
but not carried from piece to piece: nothing recorded depends on its values.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["TorchGlobals", "UsersGlobals", "caller_globals_kept"]


def _default_device() -> torch.device | None:
    """``torch.set_default_device``'s device (torch/__init__.py keeps its ``DeviceContext`` in
    ``_GLOBAL_DEVICE_CONTEXT``); ``None``: never set, or set back with ``None``."""
    context = getattr(getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None), "device_context", None)
    return None if context is None else context.device


def _set_attribute(owner: Any, name: str) -> Callable[[Any], object]:
    return lambda value: setattr(owner, name, value)


@functools.cache
def _switches() -> tuple[tuple[str, Callable[[], Any], Callable[[Any], object]], ...]:
    """Each setting: its name, how torch reads it, how torch sets it."""
    cudnn = torch.backends.cudnn
    cuda = torch.backends.cuda
    switches: list[tuple[str, Callable[[], Any], Callable[[Any], object]]] = [
        ("default dtype", torch.get_default_dtype, torch.set_default_dtype),
        ("default device", _default_device, torch.set_default_device),
        # set_grad_enabled is also a context manager; called, it sets the mode at once.
        ("grad mode", torch.is_grad_enabled, torch.set_grad_enabled),
        (
            "deterministic algorithms",
            lambda: (
                torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled(),
            ),
            lambda pair: torch.use_deterministic_algorithms(pair[0], warn_only=pair[1]),
        ),
        (
            "anomaly detection",
            lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
            lambda pair: torch.autograd.set_detect_anomaly(pair[0], check_nan=pair[1]),
        ),
        ("threads", torch.get_num_threads, torch.set_num_threads),
        ("flash SDPA", cuda.flash_sdp_enabled, cuda.enable_flash_sdp),
        ("memory-efficient SDPA", cuda.mem_efficient_sdp_enabled, cuda.enable_mem_efficient_sdp),
        ("math SDPA", cuda.math_sdp_enabled, cuda.enable_math_sdp),
    ]
    if hasattr(cuda, "cudnn_sdp_enabled"):  # torch >= 2.3
        switches.append(("cuDNN SDPA", cuda.cudnn_sdp_enabled, cuda.enable_cudnn_sdp))
    for name in ("enabled", "benchmark", "benchmark_limit", "deterministic"):
        switches.append(
            (f"cudnn.{name}", functools.partial(getattr, cudnn, name), _set_attribute(cudnn, name))
        )
    switches.append(
        (
            "cuda.matmul.allow_fp16_reduced_precision_reduction",
            functools.partial(getattr, cuda.matmul, "allow_fp16_reduced_precision_reduction"),
            _set_attribute(cuda.matmul, "allow_fp16_reduced_precision_reduction"),
        )
    )
    switches.extend(_precision_switches())
    return tuple(switches)


# torch >= 2.9's float32 precision settings (torch/backends/__init__.py ``fp32_precision``),
# the whole first, then each backend's (setting the whole one sets them); the legacy setters
# write them too (a script's ``allow_tf32 = True``). Once one is set through this API, the
# legacy readers (``torch.get_float32_matmul_precision``, ``cuda.matmul.allow_tf32``,
# ``cudnn.allow_tf32``) raise "you have used mix of the legacy and new APIs": the legacy
# matmul precision, a state of its own, is read as ``_MIXED`` then (and not written back).
_PRECISIONS = (
    "fp32_precision",
    "cuda.matmul.fp32_precision",
    "cudnn.fp32_precision",
    "cudnn.conv.fp32_precision",
    "cudnn.rnn.fp32_precision",
    "mkldnn.fp32_precision",
    "mkldnn.matmul.fp32_precision",
    "mkldnn.conv.fp32_precision",
    "mkldnn.rnn.fp32_precision",
)
_MIXED = "mixed"


def _matmul_precision() -> str:
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:  # torch >= 2.9 after its new precision API was used
        return _MIXED


def _set_matmul_precision(value: str) -> None:
    if value != _MIXED:
        torch.set_float32_matmul_precision(value)


def _precision_switches() -> list[tuple[str, Callable[[], Any], Callable[[Any], object]]]:
    """The float32 precision settings: the legacy matmul precision, then torch >= 2.9's
    (above) or, before it, the legacy TF32 switches."""
    cudnn, cuda = torch.backends.cudnn, torch.backends.cuda
    legacy = ("float32 matmul precision", _matmul_precision, _set_matmul_precision)
    if not hasattr(torch.backends, "fp32_precision"):
        return [
            legacy,
            (
                "cudnn.allow_tf32",
                functools.partial(getattr, cudnn, "allow_tf32"),
                _set_attribute(cudnn, "allow_tf32"),
            ),
            (
                "cuda.matmul.allow_tf32",
                functools.partial(getattr, cuda.matmul, "allow_tf32"),
                _set_attribute(cuda.matmul, "allow_tf32"),
            ),
        ]
    switches: list[tuple[str, Callable[[], Any], Callable[[Any], object]]] = [legacy]
    for path in _PRECISIONS:
        *parents, name = path.split(".")
        owner: Any = torch.backends
        for parent in parents:
            owner = getattr(owner, parent, None)
        if owner is not None and hasattr(owner, name):
            read = functools.partial(getattr, owner, name)
            switches.append((path, read, _set_attribute(owner, name)))
    return switches


@dataclasses.dataclass(frozen=True)
class TorchGlobals:
    """torch's process-wide settings at one moment (module docstring).

    Attributes:
        values: each setting's value, in ``_switches()`` order.
        rng_state: the CPU generator's state (``torch.get_rng_state()``).
    """

    values: tuple[Any, ...]
    rng_state: torch.Tensor

    @classmethod
    def now(cls) -> TorchGlobals:
        """The settings in effect."""
        return cls(tuple(read() for _, read, _ in _switches()), torch.get_rng_state())

    def restore(self, *, rng: bool = True) -> None:
        """Sets each setting that differs from this record back to it (and the random state,
        unless ``rng`` is False)."""
        for (_, read, write), value in zip(_switches(), self.values, strict=True):
            if read() != value:
                write(value)
        if rng:
            torch.set_rng_state(self.rng_state)


def caller_globals_kept() -> contextlib.AbstractContextManager[None]:
    """While open, a user's code (a whole script) may change torch's settings; on exit the
    caller's are back (one piece of ``UsersGlobals``)."""
    return UsersGlobals().running()


class UsersGlobals:
    """The settings a user's code runs with across its pieces (module docstring)."""

    def __init__(self) -> None:
        self._left: TorchGlobals | None = None  # None: what the caller has

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """While open, the user's code runs with the settings its previous piece left; on exit
        they are noted for the next piece and the caller's are back."""
        caller = TorchGlobals.now()
        if self._left is not None:
            self._left.restore(rng=False)
        try:
            yield
        finally:
            self._left = TorchGlobals.now()
            caller.restore()

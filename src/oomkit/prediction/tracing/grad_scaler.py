"""Notice a disabled ``torch.amp.GradScaler`` stepping in traced code.

A GradScaler made while CUDA is emulated (in a script, a builder or the step) is enabled and
runs as torch wrote it (torch/amp/grad_scaler.py): its scale, growth tracker, ``found_inf`` and
``unscale_``'s temporaries are recorded, and its overflow check answers "none"
(``values.py``, the ``finite values`` assumption). One made where torch saw no CUDA, in the
user's own session before tracing, was disabled by torch (``GradScaler.__init__``: "CUDA is not
available. Disabling.") and records none of that; as one made with ``enabled=False`` cannot be
told apart from it afterwards, a disabled scaler made outside the recording is counted and
warned about.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["grad_scaler_warnings", "watch_grad_scalers"]

_KEY = "torch.amp.GradScaler.step"


@contextlib.contextmanager
def watch_grad_scalers(counts: Counter[str]) -> Iterator[None]:
    """While open, each ``GradScaler.step`` of a disabled scaler made before it opened adds 1
    to ``counts["torch.amp.GradScaler.step"]``; scalers made while it is open are the
    recording's own (CUDA emulated: disabled only with ``enabled=False``)."""
    scaler_cls: Any = getattr(getattr(torch, "amp", None), "GradScaler", None)
    if scaler_cls is None:  # pragma: no cover - torch without torch.amp.GradScaler
        yield
        return
    made: weakref.WeakSet[Any] = weakref.WeakSet()
    original_init, original_step = scaler_cls.__init__, scaler_cls.step

    @functools.wraps(original_init)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        made.add(self)

    @functools.wraps(original_step)
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not getattr(self, "_enabled", True) and self not in made:
            counts[_KEY] += 1
        return original_step(self, *args, **kwargs)

    scaler_cls.__init__, scaler_cls.step = init, step
    try:
        yield
    finally:
        scaler_cls.__init__, scaler_cls.step = original_init, original_step


def grad_scaler_warnings(counts: Counter[str]) -> list[str]:
    """The warning for the disabled scalers ``watch_grad_scalers`` saw step."""
    count = counts.get(_KEY, 0)
    if not count:
        return []
    return [
        f"a disabled torch.amp.GradScaler stepped {count} time(s): it was made before the "
        "recording, where torch saw no CUDA and disabled it, or with enabled=False. Enabled on "
        "a GPU it holds a float32 scale and an int32 growth tracker, makes found_inf and "
        "inv_scale each step (a few KiB, not included) and skips steps whose gradients "
        "overflow; to record it, make it in the builder or the step, where CUDA is emulated"
    ]

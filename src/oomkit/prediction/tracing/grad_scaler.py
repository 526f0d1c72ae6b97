"""Notice ``torch.amp.GradScaler`` in traced code, whose CUDA behaviour is not modelled.

torch/amp/grad_scaler.py keeps a float32 ``scale`` and an int32 growth tracker on the device,
makes a ``found_inf`` per device in ``unscale_`` (``_amp_foreach_non_finite_check_and_unscale_``)
and skips ``optimizer.step()`` when a gradient is inf/NaN, so on a real GPU the first steps of
fp16 training may create no optimizer state. None of that can be observed on meta (the scaler
disables itself without CUDA, and ``found_inf.item()`` has no value), so the recorder only
counts ``GradScaler.step`` calls and warns.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["count_grad_scaler_steps", "grad_scaler_warnings"]


@contextlib.contextmanager
def count_grad_scaler_steps(counts: Counter[str]) -> Iterator[None]:
    """While open, each ``GradScaler.step`` call adds 1 to ``counts["torch.amp.GradScaler.step"]``."""
    scaler_cls: Any = getattr(getattr(torch, "amp", None), "GradScaler", None)
    if scaler_cls is None:  # pragma: no cover - torch without torch.amp.GradScaler
        yield
        return
    original = scaler_cls.step

    @functools.wraps(original)
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        counts["torch.amp.GradScaler.step"] += 1
        return original(self, *args, **kwargs)

    scaler_cls.step = step
    try:
        yield
    finally:
        scaler_cls.step = original


def grad_scaler_warnings(counts: Counter[str]) -> list[str]:
    """What a recording leaves out for each ``GradScaler`` method ``counts`` saw called."""
    return [
        f"{name} ran {count} time(s); GradScaler is not modelled: its scale and found_inf "
        "tensors, unscale_'s temporaries and the optimizer steps it skips when gradients "
        "overflow (state is then created a step later) are not included"
        for name, count in sorted(counts.items())
    ]

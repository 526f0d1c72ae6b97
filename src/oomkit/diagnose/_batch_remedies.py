"""A smaller batch with gradient accumulation as a remedy, re-predicted with that accumulation.

The accumulation keeps the global batch. ``measured_batch`` is the remedy on its own (the
largest halving that fits, tried from the largest down); ``fitting_batch`` finds the largest
halving that fits under other changes (``remedy_measurement``'s combinations: batch 1 first,
then a bisection).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

from oomkit.diagnose._remedy_code import ACCUMULATION_LOOP_CODE, MEASURED_WHY
from oomkit.diagnose.measured_remedy import MeasuredRemedy
from oomkit.units import format_bytes

if TYPE_CHECKING:
    from oomkit.diagnose.remedy_measurement import Repredict
    from oomkit.prediction.predictor import Prediction

__all__ = ["batch_parts", "batch_predict", "fitting_batch", "halvings", "measured_batch"]

# The largest batch-halving search the measured batch remedy does.
_MAX_HALVINGS = 8


def halvings(batch_size: int) -> list[int]:
    """``batch_size // 2``, its half, ... down to 1: the batches a halving remedy tries, at
    most ``_MAX_HALVINGS``."""
    sizes: list[int] = []
    size = batch_size
    while size > 1 and len(sizes) < _MAX_HALVINGS:
        size //= 2
        sizes.append(size)
    return sizes


def batch_predict(repredict_with: Repredict, options: Any, size: int) -> Prediction | None:
    """``options`` at batch ``size``, run as micro-batches with gradient accumulation,
    re-predicted; ``None`` where the model refuses the batch (BatchNorm needs more than one
    value per channel in training, torch.nn.functional._verify_batch_size).

    Accumulation keeps the gradients alive through the next micro-batch's forward and
    backward, so it is recorded: with ``max(grad_accum, 2)`` micro-batches, not the
    ``batch / size`` the remedy gives. The micro-batches after the second repeat its memory
    (the same ops on the same live tensors), and each costs a recording of its own.
    """
    accumulated = dataclasses.replace(
        options, batch_size=size, grad_accum=max(options.grad_accum, 2)
    )
    try:
        return repredict_with(accumulated, None)
    except ValueError:
        return None


def batch_parts(base: Any, size: int) -> tuple[str, str, str]:
    """The title, code and flag of running ``base``'s batch as micro-batches of ``size``."""
    steps = math.ceil(base.batch_size / size)
    code = (
        f"accumulation_steps = {steps}  # {steps} micro-batches of {size} (was one batch of "
        f"{base.batch_size})\n"
        f"loader = DataLoader(dataset, batch_size={size}, shuffle=True)\n"
        + ACCUMULATION_LOOP_CODE
    )
    title = f"batch size {size} with {steps} gradient-accumulation steps"
    return title, code, f"--batch {size} --grad-accum {steps * max(base.grad_accum, 1)}"


def measured_batch(base: Any, repredict_with: Repredict, required: int) -> MeasuredRemedy | None:
    """The largest halved batch that fits, with accumulation steps that keep the batch."""
    for size in halvings(base.batch_size):
        new = batch_predict(repredict_with, base, size)
        if new is None:
            return None
        if new.fits:
            break
    else:
        return None
    title, code, flag = batch_parts(base, size)
    return MeasuredRemedy(
        title,
        required - new.required_bytes,
        "high",
        code,
        f"{MEASURED_WHY}: at batch {size}, with the gradients kept between micro-batches, "
        f"the step needs {format_bytes(new.required_bytes)} reserved and fits; the effective "
        "batch is unchanged.",
        estimate=False,
        fits=True,
        peak_reserved_bytes=new.required_bytes,
        flag=flag,
    )


def fitting_batch(
    base: Any, options: Any, repredict_with: Repredict, *, measured_alone: bool
) -> tuple[int, Prediction] | None:
    """``options`` at ``base``'s batch if it fits there (not tried when ``measured_alone``:
    one change, measured already), else at the largest halving that fits; ``None`` if not
    even batch 1 does. Only where batch 1 fits are the halvings between bisected (the need
    grows with the batch)."""
    if not measured_alone:
        new = repredict_with(options, None)
        if new.fits:
            return base.batch_size, new
    sizes = halvings(base.batch_size)
    smallest = batch_predict(repredict_with, options, 1) if sizes else None
    if smallest is None or not smallest.fits:
        return None
    # sizes[hi] fits (the last, 1, does); sizes[lo] does not (-1: the step's batch).
    lo, hi, fitting = -1, len(sizes) - 1, smallest
    while hi - lo > 1:
        mid = (lo + hi) // 2
        tried = batch_predict(repredict_with, options, sizes[mid])
        if tried is not None and tried.fits:
            hi, fitting = mid, tried
        else:
            lo = mid
    return sizes[hi], fitting

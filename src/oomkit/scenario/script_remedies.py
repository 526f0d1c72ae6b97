"""A whole script that does not fit: its own batch argument, smaller, measured by predicting it.

``oomkit predict train.py -- ARGS`` of a run that runs out of memory cannot be rebuilt with a
preset's changes (precision, checkpointing, LoRA: the script chooses those in its code), but its
batch is one of its arguments (``script_batch.batch_arg_of``: in ARGS, or its parser's option).
The batch is halved, then halved again (at most ``MAX_TRIES`` runs), and each smaller batch is
predicted as ``oomkit predict train.py -- ARGS`` with it; the first that fits is the remedy, or
the smallest tried, said as still not fitting.

The Hugging Face Trainer's batch (``--per_device_train_batch_size``) is run with
``--gradient_accumulation_steps`` multiplied by the same factor, so the global batch and the
measurement are the run's own. Another script's accumulation is its code's: the smaller batch is
measured as the script runs it, and the remedy says that accumulating gradients over
micro-batches (to keep the global batch) holds the gradients through the next micro-batch's
forward and backward, which the measurement does not include.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from oomkit.diagnose._remedy_code import MEASURED_WHY
from oomkit.diagnose.measured_remedy import MeasuredRemedy
from oomkit.errors import OomkitError
from oomkit.scenario.script_batch import batch_arg_of, batch_in_argv, script_argv
from oomkit.units import format_bytes

if TYPE_CHECKING:
    from oomkit.prediction.predictor import Prediction
    from oomkit.scenario.model import Scenario

__all__ = ["MAX_TRIES", "script_batch_remedy"]

# Halvings tried at most (each a run of the script): batch 64 is tried at 32, 16, 8 and 4.
MAX_TRIES = 4
# The Trainer's arguments (transformers.TrainingArguments' fields as its parser spells them).
_HF_BATCH = "--per_device_train_batch_size"
_HF_ACCUMULATION = "--gradient_accumulation_steps"


def script_batch_remedy(
    scenario: Scenario,
    prediction: Prediction,
    predict: Callable[[Scenario], Prediction],
    progress: Callable[[int, int], None] | None = None,
) -> MeasuredRemedy | None:
    """The script's batch halved until it fits (at most ``MAX_TRIES`` halvings), measured.

    Args:
        scenario: a whole script's (``model.script``).
        prediction: its prediction, which does not fit.
        predict: predicts a scenario (``scenario.run.predict``).
        progress: called as ``progress(done, total)`` while measuring.

    Returns:
        The remedy; None where the script's batch argument or its value is not known, the
        batch is 1, or the script fails at a smaller batch (its own checks: a batch that must
        divide a world size, a dataset of fewer examples).
    """
    model = scenario.model
    script = model.script
    if script is None or prediction.fits:
        return None
    argv = tuple(model.script_args)
    try:
        name = batch_arg_of(script, argv, model.script_batch_arg)
    except OomkitError:  # no batch argument, or several: nothing to halve
        return None
    batch = scenario.step.batch or batch_in_argv(argv, name)
    if batch is None or batch < 2:
        return None
    sizes = [batch >> n for n in range(1, MAX_TRIES + 1) if batch >> n >= 1]
    required = prediction.required_bytes
    usable = prediction.usable_bytes
    for done, size in enumerate(sizes):
        factor = batch // size
        args = script_argv(argv, name, size)
        accumulation = None
        if name == _HF_BATCH:
            accumulation = (batch_in_argv(argv, _HF_ACCUMULATION) or 1) * factor
            args = script_argv(args, _HF_ACCUMULATION, accumulation)
        smaller = scenario.model_copy(
            update={
                "model": model.model_copy(update={"script_args": args}),
                "step": scenario.step.model_copy(update={"batch": None}),
            }
        )
        try:
            new = predict(smaller)
        except OomkitError:  # a smaller batch the script refuses (its own checks): no remedy
            return None
        if progress is not None:
            progress(done + 1, len(sizes))
        if new.fits or size == sizes[-1]:
            return _remedy(name, batch, size, accumulation, new, required, usable)
    return None


def _remedy(
    name: str,
    batch: int,
    size: int,
    accumulation: int | None,
    new: Prediction,
    required: int,
    usable: int,
) -> MeasuredRemedy:
    """The remedy of running the script at ``size``, as ``new`` measured it."""
    verdict = "fits" if new.fits else "still does not fit"
    if accumulation is not None:
        flag = f"-- {name} {size} {_HF_ACCUMULATION} {accumulation}"
        title = "a smaller batch with gradient accumulation (the same global batch)"
        kept = (
            f" with {_HF_ACCUMULATION} {accumulation} (the same global batch, the Trainer's "
            "accumulation recorded)"
        )
    else:
        flag = f"-- {name} {size}"
        title = f"a smaller batch, {size} instead of {batch}"
        kept = (
            f". To keep the global batch, accumulate gradients over {batch // size} "
            "micro-batches: the gradients are then held through the next micro-batch's forward "
            "and backward, up to their size more, which this run of the script does not include"
        )
    return MeasuredRemedy(
        title,
        required - new.required_bytes,
        "high",
        f"{flag.removeprefix('-- ')}  # in the script's arguments, after --",
        f"{MEASURED_WHY}: at {name} {size}{kept}: the script needs "
        f"{format_bytes(new.required_bytes)} reserved instead of {format_bytes(required)} and "
        f"{verdict} in the {format_bytes(usable)} usable.",
        estimate=False,
        fits=bool(new.fits),
        peak_reserved_bytes=new.required_bytes,
        flag=flag,
    )

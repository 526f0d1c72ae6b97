"""Why a predicted step would run out of memory: from a ``Prediction``, or a saved ``--json``.

``diagnose_predicted`` reads a ``Prediction`` record (``oomkit explain p.json`` re-predicts the
scenario a save carries and diagnoses the fresh record); ``diagnose_prediction`` reads a save
made before saves carried their scenario, field by field, as the documented fallback.

The prediction's ``oom.message`` is the message PyTorch would print on that device, so it goes
through ``diagnose_oom_text`` with the prediction's GPU (its CUDA-context figure included). The
prediction adds what the message lacks: memory by category and by module at the OOM, and a
batch-size remedy estimated from the activation memory (taken to scale with the batch). The
batch size, mode and optimizer come from the saved ``workload`` record
(``oomkit.prediction.workload``); a prediction saved before it existed falls back to its
description ("GPT-2 124M, batch 8, ..., adamw, train": ``workload_from_description``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from oomkit.core.gpus import GpuSpec
from oomkit.diagnose._model_remedies import (
    estimated_model_remedies,
    measured_model_remedies,
    saved_compute_capability,
)
from oomkit.diagnose._remedies import batch_remedy
from oomkit.diagnose.attribution import AllocationSite, Attribution
from oomkit.diagnose.diagnosis import Diagnosis, Finding, diagnose_oom_text
from oomkit.diagnose.oom_text import parse_oom_text
from oomkit.diagnose.remedy_measurement import measured_remedies_of, rank_measured
from oomkit.errors import OomTextError, PredictionFormatError
from oomkit.prediction.workload import WorkloadSpec, workload_from_json
from oomkit.units import format_bytes

if TYPE_CHECKING:
    from oomkit.prediction.predictor import Prediction

__all__ = ["diagnose_predicted", "diagnose_prediction", "is_prediction"]

# Categories that do not scale with the batch (tracing/categories.py names).
_STATE_CATEGORIES = ("parameter", "gradient", "optimizer_state", "buffer")
_KEYS = ("oom", "capacity_bytes", "peak_allocated_at", "gpu")
# Optimizers that keep two states per parameter (exp_avg, exp_avg_sq: torch/optim/adamw.py).
_ADAM = ("adam", "adamw")


def _training(workload: WorkloadSpec | None, by_category: Mapping[str, int]) -> bool:
    """Whether the step trains: its mode where known, else whether the memory shows gradients
    or optimizer state (a ``file.py:function`` step's mode is its own)."""
    if workload is not None and workload.training is not None:
        return workload.training
    return any(by_category.get(c, 0) > 0 for c in ("gradient", "optimizer_state"))


def _zero_grad_applies(workload: WorkloadSpec | None, oom: Mapping[str, Any]) -> bool:
    """Whether ``zero_grad(set_to_none=True)`` could lower this OOM: not for a step that sets
    it already (oomkit's presets and ``--hf`` steps: models/steps.py ``train_step``), nor for
    an OOM at step 1 or outside the forward pass, where no earlier step's gradients are alive
    (torch/optim/optimizer.py ``zero_grad``: set_to_none=False keeps them to the next forward)."""
    if workload is not None and workload.kind in ("preset", "hf"):
        return False
    if oom.get("step") == 1:
        return False
    return oom.get("phase") in (None, "forward", "user")


def is_prediction(data: object) -> bool:
    """Whether a JSON value looks like ``oomkit predict --json`` output."""
    return isinstance(data, Mapping) and all(key in data for key in _KEYS)


def _get(data: Mapping[str, Any], key: str, kind: type) -> Any:
    value = data.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise PredictionFormatError(
            f"the saved prediction's {key!r} is missing or not a {kind.__name__}; save it again "
            "with `oomkit predict ... --json > prediction.json`"
        )
    return value


@dataclass(frozen=True)
class _Facts:
    """What a diagnosis of a predicted OOM reads, from a record or a save.

    Attributes:
        message: PyTorch's OOM text for the device.
        oom_step / oom_phase: the step (from 1) and phase the OOM came in.
        requested_bytes: the failing request.
        event_index: the failing alloc's index in the events.
        gpu: the GPU (its total and context).
        usable_bytes / required_bytes: what PyTorch may reserve; what the step needs unlimited.
        allocated_bytes / reserved_bytes / by_category / top_modules: the peak-allocated moment.
        description: what was predicted.
        workload: the step as data, where known.
        compute_capability: the GPU's, where known.
    """

    message: str
    oom_step: int | None
    oom_phase: str | None
    requested_bytes: int
    event_index: int | None
    gpu: GpuSpec
    usable_bytes: int
    required_bytes: int | None
    allocated_bytes: int
    reserved_bytes: int | None
    by_category: Mapping[str, int]
    top_modules: tuple[tuple[str, int], ...]
    description: str
    workload: WorkloadSpec | None
    compute_capability: tuple[int, int] | None


Measure = Callable[[Callable[[int, int], None] | None], tuple[list[Any], list[str]]]


def diagnose_predicted(
    prediction: Prediction,
    *,
    measure: bool = True,
    progress: Callable[[int, int], None] | None = None,
    measured_remedies: Measure | None = None,
) -> Diagnosis:
    """Diagnose the OOM a ``Prediction`` predicts (``oomkit.explain``, ``explain p.json``).

    Model changes are estimated from memory by category; where the prediction is of a built-in
    preset or a ``--hf`` model and ``measure`` is true, they are measured by re-predicting the
    step with each change (``remedy_measurement``), on the prediction's own target.

    Args:
        prediction: the record (``oomkit.predict`` returns it).
        measure: re-predict to measure model changes where the workload is known.
        progress: called as ``progress(done, total)`` while measuring (a progress bar).
        measured_remedies: ``measured_remedies(progress)`` -> (remedies, warnings), for a step
            oomkit cannot rebuild with a change but can run again (a whole script with its
            own batch argument smaller: ``scenario/script_remedies``); called only when
            ``measure``. ``None``: a preset's or ``--hf`` model's changes.

    Raises:
        PredictionFormatError: the prediction fits (there is no OOM to explain).
    """
    oom = prediction.oom
    if oom is None:
        raise PredictionFormatError(
            f"the prediction fits with {format_bytes(prediction.headroom_bytes)} headroom: there "
            "is no OOM to explain. Explain the error text or a snapshot of a run that failed "
            "instead"
        )
    at = prediction.peak_allocated_at
    facts = _Facts(
        message=oom.message,
        oom_step=oom.step,
        oom_phase=oom.phase,
        requested_bytes=oom.requested_bytes,
        event_index=oom.event_index,
        gpu=prediction.gpu,
        usable_bytes=prediction.usable_bytes,
        required_bytes=prediction.required_bytes,
        allocated_bytes=at.allocated_bytes,
        reserved_bytes=at.reserved_bytes,
        by_category=dict(at.by_category_bytes),
        top_modules=tuple(at.top_modules),
        description=prediction.description,
        workload=prediction.workload,
        compute_capability=prediction.gpu.compute_capability,
    )
    if measured_remedies is None and _rebuilt(prediction.workload):
        measured_remedies = lambda bar: measured_remedies_of(prediction, bar)  # noqa: E731
    return _diagnose(facts, measured_remedies, measure, progress)


def _rebuilt(workload: WorkloadSpec | None) -> bool:
    """Whether oomkit can rebuild the step with a change: a built-in preset or a --hf model."""
    return workload is not None and workload.kind in ("preset", "hf")


def diagnose_prediction(
    data: Mapping[str, Any],
    *,
    measure: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> Diagnosis:
    """Diagnose the OOM a saved prediction predicts, from its fields (saves made before they
    carried their scenario; newer ones are re-predicted and go to ``diagnose_predicted``).

    Model changes (mixed precision, checkpointing, optimizer, ...) are estimated from memory by
    category. Where the prediction names a built-in preset or a ``--hf`` model (its
    ``workload``) and ``measure`` is true, precision, checkpointing, optimizer and batch size
    are measured instead by re-predicting the step with each change, and LoRA, QLoRA and 8-bit
    AdamW are offered, measured the same way (a few seconds per change; needs torch).

    Args:
        data: the object ``oomkit predict --json`` printed.
        measure: re-predict to measure model changes where the workload is known.
        progress: called as ``progress(done, total)`` while measuring (a progress bar).

    Returns:
        The diagnosis (``source == "prediction"``), attribution by category and module.

    Raises:
        PredictionFormatError: the object is not a prediction, or it predicts no OOM.
    """
    if not is_prediction(data):
        raise PredictionFormatError(
            "this JSON is not a saved prediction (it lacks oom, capacity_bytes, "
            "peak_allocated_at or gpu); make one with `oomkit predict ... --json > p.json`"
        )
    oom = data["oom"]
    if oom is None:
        headroom = data.get("headroom_bytes")
        room = f" with {format_bytes(headroom)} headroom" if isinstance(headroom, int) else ""
        raise PredictionFormatError(
            f"the prediction fits{room}: there is no OOM to explain. Explain the error text or a "
            "snapshot of a run that failed instead"
        )
    if not isinstance(oom, Mapping):
        raise PredictionFormatError("the saved prediction's 'oom' is not an object")
    gpu_data = _get(data, "gpu", Mapping)
    capacity = _get(data, "capacity_bytes", int)
    context = _get(data, "context_overhead_bytes", int)
    at = _get(data, "peak_allocated_at", Mapping)
    required = data.get("required_bytes")
    reserved = at.get("reserved_bytes")
    step, phase, index = oom.get("step"), oom.get("phase"), oom.get("event_index")
    facts = _Facts(
        message=str(oom.get("message", "")),
        oom_step=step if isinstance(step, int) else None,
        oom_phase=phase if isinstance(phase, str) else None,
        requested_bytes=_get(oom, "requested_bytes", int),
        event_index=index if isinstance(index, int) else None,
        gpu=GpuSpec(str(gpu_data.get("name", "the predicted GPU")), capacity, context),
        usable_bytes=_get(data, "usable_bytes", int),
        required_bytes=required if isinstance(required, int) else None,
        allocated_bytes=_get(at, "allocated_bytes", int),
        reserved_bytes=reserved if isinstance(reserved, int) else None,
        by_category={str(k): int(v) for k, v in dict(at.get("by_category_bytes", {})).items()},
        top_modules=tuple(
            (str(m["module"]), int(m["bytes"]))
            for m in at.get("top_modules", ())
            if isinstance(m, Mapping) and "module" in m and "bytes" in m
        ),
        description=str(data.get("description", "")),
        # The workload as data; saves from before the record fall back to the description.
        workload=workload_from_json(data),
        compute_capability=saved_compute_capability(data),
    )
    measured = None
    if _rebuilt(facts.workload):
        measured = lambda bar: measured_model_remedies(data, bar)  # noqa: E731
    return _diagnose(facts, measured, measure, progress)


def _diagnose(
    facts: _Facts,
    measured_remedies: Measure | None,
    measure: bool,
    progress: Callable[[int, int], None] | None,
) -> Diagnosis:
    """The diagnosis of a predicted OOM from its facts; ``measured_remedies(progress)`` re-predicts
    the changes (called only when ``measure``; ``None``: nothing can be re-predicted)."""
    try:
        parsed = parse_oom_text(facts.message)
    except OomTextError as exc:
        raise PredictionFormatError(
            f"the prediction's OOM message is not an OOM message ({exc})"
        ) from exc
    base = diagnose_oom_text(parsed, facts.gpu)
    causes = list(base.causes)
    required, usable = facts.required_bytes, facts.usable_bytes
    if required is not None and required > usable:
        # The message sees one request; the prediction saw the whole step: what it needs on a
        # device without limit, against what this one offers.
        causes = [f for f in causes if f.cause != "shortage"]
        causes.append(
            Finding(
                "shortage",
                required - usable,
                f"the step needs about {format_bytes(required)} reserved and the GPU offers "
                f"{format_bytes(usable)} to PyTorch: {format_bytes(required - usable)} short",
                {
                    "required_bytes": required,
                    "usable_bytes": usable,
                    "shortfall_bytes": required - usable,
                },
            )
        )
        causes.sort(key=lambda f: -f.explained_bytes)

    by_category = facts.by_category
    requested, allocated = facts.requested_bytes, facts.allocated_bytes
    steady = sum(by_category.get(c, 0) for c in _STATE_CATEGORIES)
    workload = facts.workload
    training = _training(workload, by_category)
    warnings = list(base.warnings)
    # Under LoRA only the adapters train: the parameter bytes say nothing of their gradients
    # and optimizer states, so the batch remedy is re-predicted, never scaled from them.
    lora = workload is not None and workload.lora is not None
    if training and "gradient" not in by_category and lora:
        warnings.append(
            "the OOM came before gradients existed, and under LoRA only the adapters get "
            "gradients and optimizer state: the batch-size remedy is re-predicted, not estimated"
        )
    elif training and "gradient" not in by_category:
        # The OOM came before the backward pass: gradients (one per parameter) and the
        # optimizer's state (Adam/AdamW: two per parameter, SGD without momentum: none) are
        # still to come and do not scale with the batch.
        params = by_category.get("parameter", 0)
        adam = workload is not None and workload.optimizer in _ADAM
        steady += params * (1 + (2 if adam else 0))
        warnings.append(
            "the OOM came before gradients and optimizer state existed; they were estimated "
            "from the parameter bytes for the batch-size remedy"
        )
    batch = None
    if not (lora and training and "gradient" not in by_category):
        batch = batch_remedy(
            need_bytes=required if required is not None else allocated + requested,
            steady_bytes=steady,
            available_bytes=usable,
            batch_size=None if workload is None else workload.batch_size,
            measured_from="the prediction's memory by category",
        )
    model = estimated_model_remedies(
        by_category,
        training=training,
        precision=None if workload is None else workload.precision,
        optimizer=None if workload is None else workload.optimizer,
        checkpointing=None if workload is None else workload.checkpointing,
        description=facts.description,
        compute_capability=facts.compute_capability,
        frozen_base=lora,
        zero_grad_applies=_zero_grad_applies(
            workload, {"step": facts.oom_step, "phase": facts.oom_phase}
        ),
    )
    if batch is not None:
        model.append(batch)
    if measure and measured_remedies is not None:
        measured, measure_warnings = measured_remedies(progress)
        warnings.extend(measure_warnings)
        if measured:
            # A measured figure replaces the estimate of the same change: a smaller batch
            # measured (_batch_remedies' "batch size N with ...", script_remedies' "a smaller
            # batch, N instead of M") replaces the one scaled from the activations.
            titles = {r.title for r in measured}
            measured_batch = any(
                r.title.startswith(("batch size", "a smaller batch,")) for r in measured
            )
            model = [
                r for r in model if r.title not in titles and not (measured_batch and r is batch)
            ]
            model.extend(measured)
    # The step's own shortfall, not the one request's: what a remedy must save to fit.
    deficit = base.deficit_bytes
    if required is not None and required > usable:
        deficit = required - usable
    remedies = rank_measured(list(base.remedies) + model, deficit)

    sites = tuple(AllocationSite(None, None, None, m, b, 1) for m, b in facts.top_modules)
    attribution = Attribution(
        moment="oom",
        event_index=facts.event_index,
        allocated_bytes=allocated,
        by_category_bytes=dict(by_category),
        top_sites=sites,
    )
    figures = {
        "requested_bytes": requested,
        "allocated_bytes": allocated,
        "reserved_bytes": facts.reserved_bytes,
        "total_bytes": facts.gpu.total_memory_bytes,
        "required_bytes": required,
        "usable_bytes": usable,
    }
    return Diagnosis(
        cause=causes[0].cause,
        causes=tuple(causes),
        remedies=tuple(remedies),
        memory_explained=base.memory_explained,
        deficit_bytes=base.deficit_bytes,
        warnings=tuple(warnings),
        source="prediction",
        attribution=attribution,
        figures_bytes=figures,
    )

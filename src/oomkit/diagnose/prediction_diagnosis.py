"""Why a predicted step would run out of memory, from a saved ``oomkit predict --json``.

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
from typing import Any

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
from oomkit.diagnose.remedy_measurement import rank_measured
from oomkit.errors import OomTextError, PredictionFormatError
from oomkit.prediction.workload import WorkloadSpec, workload_from_json
from oomkit.units import format_bytes

__all__ = ["diagnose_prediction", "is_prediction"]

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


def diagnose_prediction(
    data: Mapping[str, Any],
    *,
    measure: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> Diagnosis:
    """Diagnose the OOM a saved prediction predicts.

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
    gpu = GpuSpec(str(gpu_data.get("name", "the predicted GPU")), capacity, context)
    try:
        parsed = parse_oom_text(str(oom.get("message", "")))
    except OomTextError as exc:
        raise PredictionFormatError(
            f"the saved prediction's oom.message is not an OOM message ({exc})"
        ) from exc
    base = diagnose_oom_text(parsed, gpu)
    causes = list(base.causes)
    required, usable = data.get("required_bytes"), data.get("usable_bytes")
    if isinstance(required, int) and isinstance(usable, int) and required > usable:
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

    at = _get(data, "peak_allocated_at", Mapping)
    by_category = {str(k): int(v) for k, v in dict(at.get("by_category_bytes", {})).items()}
    requested = _get(oom, "requested_bytes", int)
    allocated = _get(at, "allocated_bytes", int)
    steady = sum(by_category.get(c, 0) for c in _STATE_CATEGORIES)
    description = str(data.get("description", ""))
    # The workload as data; saves from before the record fall back to reading the description.
    workload = workload_from_json(data)
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
    required = data.get("required_bytes")
    batch = None
    if not (lora and training and "gradient" not in by_category):
        batch = batch_remedy(
            need_bytes=required if isinstance(required, int) else allocated + requested,
            steady_bytes=steady,
            available_bytes=_get(data, "usable_bytes", int),
            batch_size=None if workload is None else workload.batch_size,
            measured_from="the prediction's memory by category",
        )
    model = estimated_model_remedies(
        by_category,
        training=training,
        precision=None if workload is None else workload.precision,
        optimizer=None if workload is None else workload.optimizer,
        checkpointing=None if workload is None else workload.checkpointing,
        description=description,
        compute_capability=saved_compute_capability(data),
        frozen_base=lora,
        zero_grad_applies=_zero_grad_applies(workload, oom),
    )
    if batch is not None:
        model.append(batch)
    if measure and workload is not None and workload.kind in ("preset", "hf"):
        measured, measure_warnings = measured_model_remedies(data, progress)
        warnings.extend(measure_warnings)
        if measured:
            # A measured figure replaces the estimate of the same change.
            titles = {r.title for r in measured}
            measured_batch = any(r.title.startswith("batch size") for r in measured)
            model = [
                r for r in model if r.title not in titles and not (measured_batch and r is batch)
            ]
            model.extend(measured)
    # The step's own shortfall, not the one request's: what a remedy must save to fit.
    deficit = base.deficit_bytes
    if isinstance(required, int) and isinstance(usable, int) and required > usable:
        deficit = required - usable
    remedies = rank_measured(list(base.remedies) + model, deficit)

    sites = tuple(
        AllocationSite(None, None, None, str(m["module"]), int(m["bytes"]), 1)
        for m in at.get("top_modules", ())
        if isinstance(m, Mapping) and "module" in m and "bytes" in m
    )
    attribution = Attribution(
        moment="oom",
        event_index=oom.get("event_index") if isinstance(oom.get("event_index"), int) else None,
        allocated_bytes=allocated,
        by_category_bytes=by_category,
        top_sites=sites,
    )
    figures = {
        "requested_bytes": requested,
        "allocated_bytes": allocated,
        "reserved_bytes": at.get("reserved_bytes"),
        "total_bytes": capacity,
        "required_bytes": data.get("required_bytes"),
        "usable_bytes": data.get("usable_bytes"),
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
        figures_bytes={k: v for k, v in figures.items() if isinstance(v, int) or v is None},
    )

"""Remedies that change the model or the training loop, estimated or measured by re-predicting.

Estimates come from memory by category at the OOM (oomkit's tracing categories: ``activation``,
``gradient``, ``optimizer_state``, ``temporary``, ``input``, ``autocast_cache``...) and are
marked ``estimate=True``; each is offered only where the evidence supports it:

- mixed precision: autocast keeps the activations saved for backward in bf16/fp16, about half
  of fp32 activations. Not offered when the trace shows autocast (an ``autocast_cache``
  category) or the run already uses bf16/fp16.
- activation checkpointing: only block inputs stay; estimated at three quarters of the
  activations (the recomputed block's own activations come back one block at a time).
- optimizer: Adam/AdamW keep two fp32 states per parameter (``exp_avg``, ``exp_avg_sq``);
  SGD with momentum keeps one, so it saves half the ``optimizer_state`` bytes. ``foreach``
  implementations (the default on CUDA, torch/optim/adamw.py ``_multi_tensor_adamw``) build
  per-parameter-group temporaries during ``step()``; ``foreach=False`` or ``fused=True`` avoids
  most of them (the ``temporary`` category at an OOM in the optimizer step).
- ``zero_grad(set_to_none=True)`` (the default since PyTorch 2.0, torch/optim/optimizer.py):
  with ``set_to_none=False`` last step's gradients stay allocated through the next forward.
- freezing layers (transfer learning): a frozen parameter has no gradient and no optimizer
  state; estimated for half of the parameters.
- not keeping the whole dataset on the GPU: ``input`` memory far above one batch.
- releasing references after a caught OOM: the exception's traceback keeps the failed
  step's frames, and with them their tensors, alive until the ``except`` block ends.

Where a step is known (a saved prediction of a built-in preset or a ``--hf`` model, with its
``workload``), the savings of precision, checkpointing, optimizer and batch size are measured
instead: the predictor runs again with the change applied (``measured_model_remedies``); so are
the fine-tuning changes, which are never estimated (``_finetune_remedies``: LoRA, QLoRA, 8-bit
AdamW). Under LoRA the batch remedy is measured only: the saved categories cannot say which
parameters train.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from oomkit.diagnose._remedy_code import (
    CHECKPOINT_CODE,
    FP16_CODE,
    MEASURED_WHY,
    MIXED_CODE,
    SGD_CODE,
)
from oomkit.diagnose.diagnosis import Remedy
from oomkit.errors import ConfigError, OomkitError
from oomkit.units import format_bytes

if TYPE_CHECKING:
    from oomkit.core.gpus import GpuSpec
    from oomkit.core.target import ParallelLayout, Target
    from oomkit.prediction.workload import WorkloadSpec

# The measured remedies import the target, the workload record and the re-prediction machinery
# when they run: the estimates a snapshot gets need none of them (issue 41 item 4: start-up).

__all__ = [
    "MEASURED_WHY",
    "caught_oom_remedy",
    "estimated_model_remedies",
    "measured_model_remedies",
    "saved_compute_capability",
    "saved_parallel",
    "saved_target",
]

# An input category at least this share of allocated memory looks like a dataset kept on the GPU.
_DATASET_SHARE = 4

# torch/cuda/__init__.py is_bf16_supported: native bf16 needs compute capability 8.0 (Ampere);
# older GPUs (V100, T4) only emulate it, slowly, so they get fp16 autocast with a GradScaler.
_NATIVE_BF16_CAPABILITY = (8, 0)


@dataclasses.dataclass(frozen=True)
class _MixedPrecision:
    title: str
    precision: str  # the StepOptions.precision that applies it
    dtype: str
    code: str


def _mixed_precision_for(compute_capability: tuple[int, int] | None) -> _MixedPrecision:
    """bf16 autocast where the GPU has native bf16 (or the GPU is unknown), fp16 otherwise."""
    if compute_capability is not None and tuple(compute_capability) < _NATIVE_BF16_CAPABILITY:
        return _MixedPrecision(
            "fp16 mixed precision (autocast + GradScaler)", "fp16-mixed", "fp16", FP16_CODE
        )
    return _MixedPrecision("bf16 mixed precision (autocast)", "bf16-mixed", "bf16", MIXED_CODE)


_FOREACH_CODE = (
    "optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)\n"
    "# or, where fused is not available: torch.optim.AdamW(..., foreach=False)"
)
_ZERO_GRAD_CODE = (
    "optimizer.zero_grad(set_to_none=True)  # frees the gradients until the next backward"
)
_FREEZE_CODE = (
    "for param in model.backbone.parameters():  # the pretrained part\n"
    "    param.requires_grad_(False)\n"
    "optimizer = torch.optim.AdamW(\n"
    "    (p for p in model.parameters() if p.requires_grad), lr=1e-4\n"
    ")"
)
_DATASET_CODE = (
    "loader = DataLoader(dataset, batch_size=32, shuffle=True, pin_memory=True)  # CPU tensors\n"
    "for inputs, targets in loader:\n"
    '    inputs = inputs.to("cuda", non_blocking=True)\n'
    '    targets = targets.to("cuda", non_blocking=True)'
)
_CAUGHT_OOM_CODE = (
    "try:\n"
    "    loss = train_step(batch)\n"
    "    failed = False\n"
    "except torch.OutOfMemoryError:\n"
    "    failed = True  # do not retry here: the traceback still holds the step's tensors\n"
    "if failed:\n"
    "    import gc; gc.collect(); torch.cuda.empty_cache()\n"
    "    loss = train_step(smaller_batch)"
)


def _is_mixed(precision: str | None, description: str, categories: Mapping[str, int]) -> bool:
    if categories.get("autocast_cache", 0) > 0:
        return True
    if precision is not None:
        return precision != "fp32"
    lowered = description.lower()
    return "bf16" in lowered or "fp16" in lowered


def estimated_model_remedies(
    by_category_bytes: Mapping[str, int],
    *,
    training: bool = True,
    precision: str | None = None,
    optimizer: str | None = None,
    checkpointing: bool | str | None = None,
    description: str = "",
    parameter_bytes: int | None = None,
    compute_capability: tuple[int, int] | None = None,
    frozen_base: bool = False,
    zero_grad_applies: bool = True,
) -> list[Remedy]:
    """Model and loop changes, priced from memory by category at the OOM (estimates).

    Args:
        by_category_bytes: live bytes by oomkit category at the OOM (or the peak).
        training: whether the step trains (no gradient/optimizer remedies otherwise).
        precision: the run's ``StepOptions.precision``, when known.
        optimizer: ``"adamw"``, ``"adam"`` or ``"sgd"``, when known.
        checkpointing: whether activation checkpointing is on, when known: a
            ``StepOptions.checkpointing`` mode (``"none"`` is off) or a boolean.
        description: the prediction's description ("..., bf16-mixed, adamw, train"), read when
            the options are unknown.
        parameter_bytes: parameter bytes (defaults to the ``parameter`` category).
        compute_capability: the GPU's, when known: below 8.0 (no native bf16) the mixed
            precision remedy is fp16 with a GradScaler instead of bf16.
        frozen_base: the base weights are frozen already (LoRA): no freezing remedy.
        zero_grad_applies: False where ``zero_grad(set_to_none=True)`` cannot help: the step
            sets it already (oomkit's presets and ``--hf`` steps), or the OOM comes before a
            previous step's gradients could be alive (step 1, or after the forward pass).

    Returns:
        The remedies the categories support, unsorted; every one has ``estimate=True``.
    """
    cats = {str(k): int(v) for k, v in by_category_bytes.items()}
    activation = cats.get("activation", 0)
    gradient = cats.get("gradient", 0)
    state = cats.get("optimizer_state", 0)
    temporary = cats.get("temporary", 0)
    inputs = cats.get("input", 0)
    params = parameter_bytes if parameter_bytes is not None else cats.get("parameter", 0)
    allocated = sum(cats.values())
    lowered = description.lower()
    if optimizer is None:
        optimizer = next((o for o in ("adamw", "adam", "sgd") if o in lowered.split(", ")), None)
    out: list[Remedy] = []

    if activation > 0 and not _is_mixed(precision, description, cats):
        mixed = _mixed_precision_for(compute_capability)
        out.append(
            Remedy(
                mixed.title,
                activation // 2,
                "medium",
                mixed.code,
                f"The {format_bytes(activation)} of activations are fp32; under autocast the "
                f"ones saved for backward are mostly {mixed.dtype}, about half (an estimate "
                "from the activation category).",
            )
        )
    if training and activation > 0 and checkpointing in (None, False, "none"):
        out.append(
            Remedy(
                "activation checkpointing",
                activation * 3 // 4,
                "low",
                CHECKPOINT_CODE,
                f"Only each block's input stays of the {format_bytes(activation)} of "
                "activations; the rest is recomputed in backward (~30% more compute). "
                "Estimated at three quarters of the activations.",
            )
        )
    if training and state > 0 and optimizer != "sgd":
        out.append(
            Remedy(
                "SGD with momentum instead of Adam (one optimizer state, not two)",
                state // 2,
                "medium",
                SGD_CODE,
                f"Adam/AdamW keep two states per parameter ({format_bytes(state)} here); SGD "
                "with momentum keeps one. Changes training dynamics: retune the learning rate.",
            )
        )
    if training and temporary > 0 and (state > 0 or gradient > 0):
        out.append(
            Remedy(
                "fused (or non-foreach) optimizer step",
                temporary,
                "low",
                _FOREACH_CODE,
                f"{format_bytes(temporary)} of temporaries were live; the default foreach "
                "optimizer step builds whole-group temporaries, the fused kernel does not.",
            )
        )
    if training and zero_grad_applies and gradient > 0 and activation > 0:
        out.append(
            Remedy(
                "zero_grad(set_to_none=True)",
                gradient,
                "low",
                _ZERO_GRAD_CODE,
                f"{format_bytes(gradient)} of gradients were live while activations were being "
                "built: with set_to_none=False last step's gradients stay through the forward.",
            )
        )
    if training and not frozen_base and params > 0 and (gradient > 0 or state > 0):
        grad_and_state = (gradient or params) + state
        out.append(
            Remedy(
                "freeze pretrained layers (transfer learning)",
                grad_and_state // 2,
                "low",
                _FREEZE_CODE,
                "A frozen parameter needs no gradient and no optimizer state; estimated for "
                f"half of the parameters ({format_bytes(grad_and_state)} of gradients and state "
                "in all).",
                changes_training=True,
            )
        )
    if inputs > 0 and allocated > 0 and inputs * _DATASET_SHARE >= allocated:
        out.append(
            Remedy(
                "keep the dataset on the CPU; move one batch at a time",
                inputs,
                "medium",
                _DATASET_CODE,
                f"{format_bytes(inputs)} of inputs were on the GPU at once, "
                f"{100 * inputs // allocated}% of allocated memory: the whole dataset, not one "
                "batch.",
            )
        )
    return out


def caught_oom_remedy(held_bytes: int) -> Remedy:
    """Leave the ``except`` block before retrying: the traceback holds the failed step's tensors.

    Args:
        held_bytes: bytes still live at a later OOM that were allocated before the first one.
    """
    return Remedy(
        "release references after a caught OOM",
        held_bytes,
        "medium",
        _CAUGHT_OOM_CODE,
        f"{format_bytes(held_bytes)} allocated before the first OOM was still live at the next "
        "one: the exception's traceback keeps the failed step's frames and tensors alive inside "
        "the except block. Retry after it.",
    )


def _gpu_of(data: Mapping[str, Any]) -> GpuSpec:
    from oomkit.core.gpus import GpuSpec

    gpu = data.get("gpu") or {}
    return GpuSpec(
        str(gpu.get("name", "the predicted GPU")),
        int(data["capacity_bytes"]),
        int(data["context_overhead_bytes"]),
        # The saved GPU's compute capability: re-predictions choose the same kernels (SDPA
        # backend, cuBLAS workspace) as the saved prediction did.
        compute_capability=saved_compute_capability(data),
        architecture=gpu.get("architecture"),
    )


def _saved_int(data: Mapping[str, Any], key: str) -> int | None:
    value = data.get(key) if isinstance(data, Mapping) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def saved_target(data: Mapping[str, Any]) -> Target:
    """The target a saved prediction was made for, so that re-predictions model the same
    machine: its GPU (with compute capability), allocator setting, torch version and the cuDNN
    version it was traced with (``target.cudnn_version``; older saves kept it only as
    ``workload.cudnn_version``, and before that not at all: then ``None``, the settings in
    effect).

    Raises:
        ConfigError: the saved ``alloc_conf`` is not a setting PyTorch accepts.
    """
    from oomkit.core.target import Target

    saved = data.get("target")
    saved = saved if isinstance(saved, Mapping) else {}
    workload = data.get("workload")
    cudnn = _saved_int(saved, "cudnn_version")
    if cudnn is None and isinstance(workload, Mapping):
        cudnn = _saved_int(workload, "cudnn_version")
    torch_version = data.get("torch_version")
    cuda_version = saved.get("cuda_version")
    return Target.resolve(
        _gpu_of(data),
        alloc_conf=data.get("alloc_conf") or None,
        torch_version=torch_version if isinstance(torch_version, str) else None,
        cudnn_version=cudnn,
        cuda_version=cuda_version if isinstance(cuda_version, str) else None,
    )


# The workloads oomkit can rebuild from their saved record: presets, and --hf models (from the
# same directory, or the hub name's config in the local cache: explain never goes online).
_REBUILDABLE = ("preset", "hf")


def saved_parallel(data: Mapping[str, Any]) -> ParallelLayout | None:
    """The saved prediction's parallel layout (``target.parallel``); ``None``: one GPU.

    Raises:
        ConfigError: a saved layout that is not one (re-predicting it as one GPU would be wrong).
    """
    saved = data.get("target")
    parallel = saved.get("parallel") if isinstance(saved, Mapping) else None
    if parallel is None:
        return None
    if not isinstance(parallel, Mapping) or not set(parallel) <= {"fsdp", "tp", "dp", "pp", "cp"}:
        raise ConfigError(f"the saved target.parallel is not a layout: {parallel!r}")
    from oomkit.core.target import ParallelLayout

    return ParallelLayout(**parallel)


def saved_step_target(data: Mapping[str, Any]) -> Target:
    """The saved prediction's target with its parallel layout (``saved_target`` keeps one GPU).

    Raises:
        ConfigError: a saved setting or layout that is not one.
    """
    return dataclasses.replace(saved_target(data), parallel=saved_parallel(data))


def _repredict(data: Mapping[str, Any], workload: WorkloadSpec, options: Any) -> Any:
    """The saved step re-predicted with ``options`` on the saved target (rank 0 of the saved
    layout, not one GPU): ``remedy_measurement.repredict``."""
    from oomkit.diagnose.remedy_measurement import predict_rebuilt, rebuild, repredict

    layout = saved_parallel(data)
    if layout is not None:
        return repredict(workload, dataclasses.replace(saved_target(data), parallel=layout), options)
    built = rebuild(workload, options)  # first: a workload that cannot be rebuilt says so
    return predict_rebuilt(workload, built, saved_target(data), options)


def saved_compute_capability(data: Mapping[str, Any]) -> tuple[int, int] | None:
    """The saved prediction's GPU compute capability (``gpu.compute_capability``), if any."""
    gpu = data.get("gpu")
    cc = gpu.get("compute_capability") if isinstance(gpu, Mapping) else None
    if isinstance(cc, (list, tuple)) and len(cc) == 2 and all(isinstance(v, int) for v in cc):
        return (int(cc[0]), int(cc[1]))
    return None


def measured_model_remedies(
    data: Mapping[str, Any], progress: Callable[[int, int], None] | None = None
) -> tuple[list[Remedy], list[str]]:
    """Precision, checkpointing, optimizer, fine-tuning (LoRA, QLoRA, 8-bit AdamW), ``--fsdp N``
    and batch-size changes, measured by re-predicting (``remedy_measurement.measure_remedies``).

    Args:
        data: a saved ``oomkit predict --json`` whose ``workload`` names a built-in preset or a
            ``--hf`` model and its ``StepOptions`` (``{"kind": "preset", "name": ...,
            "options": {...}, "steps": N}``; older saves: ``{"preset": ..., "options": ...,
            "steps": N}``).
        progress: called as ``progress(done, total)`` after each change is measured (the
            batch-size search counts as one, so does the ``--fsdp`` search), for a progress bar.

    Returns:
        The remedies (``MeasuredRemedy``: ``estimate=False``, confidence high, saving =
        required reserved bytes before minus after, ``fits`` and ``peak_reserved_bytes`` of the
        re-prediction) and warnings; empty when the workload is unknown or torch is missing.
    """
    from oomkit.diagnose.remedy_measurement import FSDP_SIZES, measure_remedies, repredict
    from oomkit.prediction.workload import workload_from_json

    workload = workload_from_json(data)
    if workload is None or workload.kind not in _REBUILDABLE:
        return [], []
    try:
        from oomkit.prediction.models import StepOptions
    except ImportError:
        return [], ["torch is not installed: model changes were estimated, not re-predicted"]
    known = {name: value for name, value in workload.options.items() if value is not None}
    try:
        base = StepOptions(**known)
    except (TypeError, ValueError) as exc:
        return [], [f"the saved workload's options are not StepOptions ({exc}); estimated"]
    try:
        layout = saved_parallel(data)
    except ConfigError as exc:
        return [], [_not_rebuilt(workload, exc)]

    def repredict_with(options: Any, parallel: ParallelLayout | None) -> Any:
        if parallel is None:
            return _repredict(data, workload, options)  # looked up at call time: tests spy on it
        return repredict(workload, dataclasses.replace(saved_target(data), parallel=parallel),
                         options)

    one_gpu = layout is None and workload.kind == "preset"
    try:
        measured, warnings = measure_remedies(
            base,
            repredict_with,
            required_bytes=int(data["required_bytes"]),
            usable_bytes=int(data["usable_bytes"]),
            compute_capability=saved_compute_capability(data),
            fsdp_sizes=FSDP_SIZES if one_gpu else (),
            progress=progress,
        )
    except OomkitError as exc:
        return [], [_not_rebuilt(workload, exc)]
    return list(measured), warnings


def _not_rebuilt(workload: WorkloadSpec, exc: OomkitError) -> str:
    return (
        f"{workload.name} could not be rebuilt to re-predict it ({exc}); model changes were "
        "estimated (run explain where the model's config is, or with its config in the cache)"
    )

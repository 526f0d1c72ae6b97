"""What a prediction recorded, as data: the workload record saved with a prediction.

``oomkit predict`` attaches a ``WorkloadSpec`` to its ``Prediction`` and ``--json`` saves it as
``workload``, so that ``oomkit explain`` reads the batch size, mode and optimizer from fields
instead of from the human-readable description, and can re-predict a preset with a change
applied. ``workload_from_json`` reads it back; predictions saved before the record existed (no
``workload``, or one without ``kind``) fall back to ``workload_from_description``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

__all__ = [
    "WorkloadKind",
    "WorkloadSpec",
    "workload_from_description",
    "workload_from_json",
    "workload_to_json",
]

WorkloadKind = Literal["preset", "function", "hf", "script", "unknown"]
_KINDS: tuple[WorkloadKind, ...] = get_args(WorkloadKind)
# StepOptions fields (oomkit.prediction.models.options), saved as ``workload.options``, with the
# type ``workload_from_json`` reads each back as (``float``: any number; ``checkpointing``: also
# older oomkit's boolean). A saved value of another type reads as not known.
_OPTION_TYPES: dict[str, type] = {
    "batch_size": int,
    "seq_len": int,
    "image_size": int,
    "precision": str,
    "optimizer": str,
    "checkpointing": str,
    "mode": str,
    "new_tokens": int,
    "lora": Mapping,
    "optimizer_impl": str,
    "quantize": str,
    "double_quant": bool,
    "compute_dtype": str,
    "grad_accum": int,
    "max_grad_norm": float,
    "checkpoint_reentrant": bool,
    "compile": bool,
    "trainer_mixed_precision": str,
    "trainer_empty_cache_steps": int,
    "hf_class": str,
    "attn_implementation": str,
}
# The fine-tuning fields are saved only when they differ from StepOptions' defaults (None when
# not known), so that saves of other workloads keep the keys older oomkit wrote.
_OMITTED_AT_DEFAULT: dict[str, object] = {
    "lora": None,
    "optimizer_impl": "foreach",
    "quantize": None,
    "double_quant": False,
    "compute_dtype": None,
    "grad_accum": 1,
    "max_grad_norm": None,
    "checkpoint_reentrant": False,
    "compile": False,
    "trainer_mixed_precision": None,
    "trainer_empty_cache_steps": None,
    "hf_class": None,
    "attn_implementation": None,
}
_OPTIMIZERS = ("adamw", "adam", "sgd", "adamw8bit", "paged-adamw8bit", "adafactor", "torch-adafactor")


@dataclass(frozen=True)
class WorkloadSpec:
    """The step a prediction recorded; ``None`` marks what is not known.

    Attributes:
        kind: ``"preset"`` (built-in, can be rebuilt), ``"function"`` (``file.py:function``),
            ``"hf"`` (``--hf``) or ``"unknown"`` (read back from an old save's description).
        name: the preset name, ``file.py:function`` or the Hugging Face model.
        batch_size: sequences (images) per step; for a function, the ``batch_size`` it was
            called with, ``None`` when it takes none.
        seq_len: tokens per sequence, where given.
        image_size: image height and width, where given.
        precision: ``StepOptions.precision`` (``None`` for a function: its own choice).
        optimizer: ``"adamw"``, ``"adam"`` or ``"sgd"``; ``None`` when not known.
        checkpointing: activation checkpointing, ``"none"``, ``"full"`` or ``"selective-op"``
            (``StepOptions.checkpointing``); ``None`` when not known.
        mode: ``"train"``, ``"inference"`` or ``"generate"``; ``None`` when not known.
        new_tokens: tokens generated (``generate`` only).
        steps: steps recorded.
        lora: ``StepOptions.lora`` as a mapping of ``LoraOptions``' fields (r, alpha, targets,
            dropout, modules_to_save, dora); ``None``: no LoRA, or not known.
        optimizer_impl: ``StepOptions.optimizer_impl`` (``foreach``, ``fused``, ``for-loop``).
        quantize: ``StepOptions.quantize`` (``nf4``, ``fp4``, ``int8``); ``None``: none or not
            known.
        double_quant: ``StepOptions.double_quant``.
        compute_dtype: ``StepOptions.compute_dtype``.
        grad_accum: ``StepOptions.grad_accum`` (micro-batches per optimizer step).
        max_grad_norm: ``StepOptions.max_grad_norm`` (``None``: no clipping, or not known).
        checkpoint_reentrant: ``StepOptions.checkpoint_reentrant``.
        compile: ``StepOptions.compile`` (the forward wrapped in ``torch.compile``).
        trainer_mixed_precision: ``StepOptions.trainer_mixed_precision`` (the HF Trainer's
            loop, with its Accelerator's ``mixed_precision``); ``None``: a plain loop, or not
            known.
        trainer_empty_cache_steps: ``StepOptions.trainer_empty_cache_steps`` (the Trainer's
            ``torch_empty_cache_steps``); ``None``: not set, or not known.
        precision_source: where ``precision`` came from when it was not asked for (``"from the
            config's torch_dtype"`` for a Hugging Face model); ``None`` when it was given (or
            not known). The verdict names it.
        ddp_bucket_cap_mb: ``--dp``'s ``--bucket-cap-mb`` (DDP's ``bucket_cap_mb``); ``None``:
            DDP's default, or not DDP.
        ddp_gradient_as_bucket_view: ``--gradient-as-bucket-view``; ``None``: not DDP (or an
            older save).
        float8_recipe: ``--float8``'s recipe (torchao, ``models/float8.py``); ``None``: no
            float8 training.
        float8_all_gather: ``--float8-all-gather``; ``None``: no float8 training.
        hf_class: ``StepOptions.hf_class`` (``--hf`` only; ``None``: from the config).
        attn_implementation: ``StepOptions.attn_implementation`` (``--hf`` only; ``None``: the
            config's, else sdpa).
    """

    kind: WorkloadKind
    name: str
    batch_size: int | None = None
    seq_len: int | None = None
    image_size: int | None = None
    precision: str | None = None
    optimizer: str | None = None
    checkpointing: str | None = None
    mode: str | None = None
    new_tokens: int | None = None
    steps: int | None = None
    lora: Mapping[str, Any] | None = None
    optimizer_impl: str | None = None
    quantize: str | None = None
    double_quant: bool | None = None
    compute_dtype: str | None = None
    grad_accum: int | None = None
    max_grad_norm: float | None = None
    checkpoint_reentrant: bool | None = None
    compile: bool | None = None
    trainer_mixed_precision: str | None = None
    trainer_empty_cache_steps: int | None = None
    precision_source: str | None = None
    ddp_bucket_cap_mb: float | None = None
    ddp_gradient_as_bucket_view: bool | None = None
    float8_recipe: str | None = None
    float8_all_gather: bool | None = None
    hf_class: str | None = None
    attn_implementation: str | None = None

    @property
    def training(self) -> bool | None:
        """Whether the step trains; ``None`` when the mode is not known."""
        return None if self.mode is None else self.mode == "train"

    @property
    def options(self) -> dict[str, Any]:
        """The ``StepOptions`` fields, ``None`` where not known (a preset knows them all)."""
        return {name: getattr(self, name) for name in _OPTION_TYPES}


def workload_to_json(workload: WorkloadSpec, cudnn_version: int | None = None) -> dict[str, Any]:
    """The saved form: ``kind``, ``name``, ``options`` (the fine-tuning ones only when set) and
    ``steps`` (and ``precision_source`` when set, ``ddp`` for a ``--dp`` run); a preset also keeps
    ``preset`` (the key older oomkit read), and ``cudnn_version`` the cuDNN the step was traced
    with (older saves' only record of it; new ones also have ``target.cudnn_version``)."""
    out: dict[str, Any] = {"kind": workload.kind, "name": workload.name}
    if workload.kind == "preset":
        out["preset"] = workload.name
    out["options"] = {
        name: value
        for name, value in workload.options.items()
        if name not in _OMITTED_AT_DEFAULT or value not in (None, _OMITTED_AT_DEFAULT[name])
    }
    out["steps"] = workload.steps
    if workload.precision_source is not None:
        out["precision_source"] = workload.precision_source
    if workload.ddp_gradient_as_bucket_view is not None:  # a --dp run: DDP's bucket options
        out["ddp"] = {
            "bucket_cap_mb": workload.ddp_bucket_cap_mb,
            "gradient_as_bucket_view": workload.ddp_gradient_as_bucket_view,
        }
    if workload.float8_recipe is not None:  # a --float8 run: torchao's recipe
        out["float8"] = {
            "recipe": workload.float8_recipe,
            "all_gather": bool(workload.float8_all_gather),
        }
    if cudnn_version is not None:
        out["cudnn_version"] = cudnn_version
    return out


def _typed(value: Any, kind: type) -> Any:
    """``value`` if it is a ``kind`` (a bool is no number), else ``None``; for ``float``, any
    number, as a float."""
    if isinstance(value, bool) and kind is not bool:
        return None
    if kind is float:
        return float(value) if isinstance(value, int | float) else None
    return value if isinstance(value, kind) else None


def workload_from_json(data: Mapping[str, Any]) -> WorkloadSpec | None:
    """The workload of a saved prediction (the ``oomkit predict --json`` object).

    A ``workload`` with ``kind`` is read field by field. Older saves are read too: a
    ``workload`` with only ``preset``/``options``/``steps`` is a preset; a save without one
    falls back to ``workload_from_description`` (kind ``"unknown"``), or ``None`` when it has
    no description either.
    """
    saved = data.get("workload")
    if isinstance(saved, Mapping):
        options = saved.get("options")
        options = options if isinstance(options, Mapping) else {}
        name = saved.get("name", saved.get("preset"))
        kind = next((k for k in _KINDS if k == saved.get("kind")), None)
        ddp = saved.get("ddp")
        ddp = ddp if isinstance(ddp, Mapping) else {}
        float8 = saved.get("float8")
        float8 = float8 if isinstance(float8, Mapping) else {}
        if kind is None:  # saved before the record had a kind: only presets were saved
            kind = "preset" if isinstance(saved.get("preset"), str) else "unknown"
        read = {field: _typed(options.get(field), type_) for field, type_ in _OPTION_TYPES.items()}
        read["checkpointing"] = _checkpointing(options.get("checkpointing"))
        return WorkloadSpec(
            kind=kind,
            name=str(name or ""),
            steps=_typed(saved.get("steps"), int),
            precision_source=_typed(saved.get("precision_source"), str),
            ddp_bucket_cap_mb=_typed(ddp.get("bucket_cap_mb"), float),
            ddp_gradient_as_bucket_view=_typed(ddp.get("gradient_as_bucket_view"), bool),
            float8_recipe=_typed(float8.get("recipe"), str),
            float8_all_gather=_typed(float8.get("all_gather"), bool),
            **read,
        )
    description = data.get("description")
    if isinstance(description, str) and description:
        return workload_from_description(description, steps=_typed(data.get("steps"), int))
    return None


def _checkpointing(value: object) -> str | None:
    """A saved ``checkpointing`` option: a mode, or older oomkit's boolean (full / none)."""
    if isinstance(value, bool):
        return "full" if value else "none"
    return value if isinstance(value, str) else None


def workload_from_description(description: str, *, steps: int | None = None) -> WorkloadSpec:
    """The documented fallback for predictions saved without a workload record.

    Reads a preset's description (``"GPT-2 124M, batch 8, seq 1024, fp32, adamw, train"``): the
    batch size from ``batch N``, the optimizer from an ``adamw`` / ``adam`` / ``sgd`` item, and
    the mode ``"train"`` when the text says ``train`` (otherwise not known). Anything else stays
    ``None``.
    """
    batch = re.search(r"\bbatch (\d+)\b", description)
    items = description.lower().split(", ")
    optimizer = next((o for o in _OPTIMIZERS if o in items), None)
    if optimizer is None and re.search(r"\badam", description):
        optimizer = "adam"  # e.g. "..., Adam, ...": what older oomkit took to mean two states
    return WorkloadSpec(
        kind="unknown",
        name=description,
        batch_size=int(batch.group(1)) if batch else None,
        optimizer=optimizer,
        mode="train" if "train" in description else None,
        steps=steps,
    )

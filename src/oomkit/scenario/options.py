"""A scenario's step as ``StepOptions``, with the defaults people run and each one named.

The scenario keeps what the user said (``None``: the default); this module resolves the rest
the way such a run is usually set up, and says so in the result (``ResolvedStep.defaults``,
shown among the prediction's assumptions):

- weights in bf16 for ``inference`` / ``generate`` and for a LoRA or QLoRA base, as models are
  served and as peft users load them (``from_pretrained(torch_dtype=torch.bfloat16)``); fp16
  on a GPU without bf16 (compute capability below 8.0: T4, V100, P100);
- training: the preset's default (bf16-mixed for GPT-2 and Llama, fp32 for the others), and
  fp16-mixed instead of bf16-mixed on a GPU without bf16: there, bf16-mixed would run every
  attention through math SDPA (sdp_utils.cpp check_tensor_dtype: flash and memory-efficient
  attention need sm80 for bf16), which no one trains with;
- one step for ``generate`` (each step is a whole generation), else the command's default.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from oomkit.errors import OomkitError

if TYPE_CHECKING:
    from oomkit.core.gpus import GpuSpec
    from oomkit.scenario.model import Scenario

__all__ = [
    "ResolvedStep",
    "default_steps",
    "field_wording",
    "has_bf16",
    "lora_options",
    "step_options",
]

# sm80 (Ampere) is the first architecture with bf16 tensor cores; torch.cuda.is_bf16_supported()
# answers from the same capability (torch/cuda/__init__.py is_bf16_supported: major >= 8).
_BF16_MAJOR = 8


def has_bf16(gpu: GpuSpec) -> bool:
    """Whether ``gpu`` computes in bf16 (compute capability 8.0 or above); a GPU named by size
    only is taken to (it runs the newest kernels: ``GpuSpec.kernel_compute_capability``)."""
    return gpu.kernel_compute_capability[0] >= _BF16_MAJOR


@dataclass(frozen=True)
class ResolvedStep:
    """``StepOptions`` for one batch, and the defaults chosen for it, by field, in words.

    Attributes:
        options: the ``StepOptions`` to build the step with.
        defaults: ``{"precision": "bf16 weights, the default for generate; --precision fp32
            to change"}``: each default the result depends on that was not given.
        trainer_notes: what ``--trainer-args`` was read as (keys read, overridden, ignored).
    """

    options: Any
    defaults: Mapping[str, str] = field(default_factory=dict)
    trainer_notes: Mapping[str, str] = field(default_factory=dict)


def default_steps(scenario: Scenario, command: str) -> tuple[int, str | None]:
    """The steps to record and, when chosen here, why: ``run.steps`` as given, else 1 for
    ``generate`` (each step is a whole generation), 2 for ``fit`` (the first optimizer step and
    the steady state), 3 for ``predict``."""
    if scenario.run.steps is not None:
        return scenario.run.steps, None
    if scenario.step.mode == "generate":
        return 1, "1 step, the default for generate (each is a whole generation); --steps N to change"
    return (2, None) if command == "fit" else (3, None)


def lora_options(scenario: Scenario) -> Any:
    """The ``LoraOptions`` of the scenario's ``lora`` section; ``None`` without one."""
    lora = scenario.lora
    if lora is None:
        return None
    from oomkit.prediction.models.lora_options import LoraOptions

    given: dict[str, Any] = {
        name: value
        for name, value in (
            ("alpha", lora.alpha),
            ("targets", lora.targets),
            ("dropout", lora.dropout),
            ("modules_to_save", lora.modules_to_save),
        )
        if value is not None
    }
    try:
        return LoraOptions(r=lora.rank, dora=lora.dora, **given)
    except ValueError as exc:
        raise OomkitError(field_wording(str(exc))) from exc


def _default_precision(
    scenario: Scenario, preset: Any, gpu: GpuSpec
) -> tuple[str | None, str | None]:
    """The precision to use when ``step.precision`` is not given, and the words naming it;
    ``(None, None)``: the model's own (a Hugging Face config's dtype)."""
    bf16 = has_bf16(gpu)
    low, why_low = ("bf16", "") if bf16 else ("fp16", f" ({gpu.name} has no bf16)")
    mode = scenario.step.mode or "train"
    if mode in ("inference", "generate"):
        if preset is None:
            return None, None  # --hf: from_config builds it in its config's dtype
        return low, f"{low} weights, the default for {mode}{why_low}; --precision fp32 to change"
    if scenario.lora is not None or scenario.quantize is not None:
        base = "QLoRA" if scenario.quantize is not None else "LoRA"
        if preset is None:
            return None, None
        return low, (
            f"{low} base weights, the default for a {base} base (as peft users load it)"
            f"{why_low}; --precision bf16-mixed or fp32 to change"
        )
    if preset is None:
        return None, None
    chosen = preset.default_precision
    if chosen == "bf16-mixed" and not bf16:
        return "fp16-mixed", (
            f"fp16-mixed, the default on {gpu.name}, which has no bf16 (bf16-mixed would run "
            "attention through math SDPA); --precision to change"
        )
    return chosen, None


def step_options(
    scenario: Scenario, batch_size: int | None, preset: Any, gpu: GpuSpec
) -> ResolvedStep:
    """The ``StepOptions`` the scenario names at ``batch_size`` (``None``: the default).

    Args:
        scenario: the request.
        batch_size: the batch; ``None`` takes ``step.batch``, else the preset's default.
        preset: the ``ModelPreset`` built (its default precision and batch apply where the
            scenario names none); ``None`` for a Hugging Face model.
        gpu: the target GPU (whether it has bf16 decides the precision defaults).

    Raises:
        OomkitError: a combination ``StepOptions`` refuses, worded with the scenario's flags.
    """
    from oomkit.prediction.models import StepOptions
    from oomkit.prediction.models.options import GENERATE_COMPILE_REASON

    step = scenario.step
    if step.compile and step.mode == "generate":
        raise OomkitError(
            f"--compile with --mode generate is not modelled: {GENERATE_COMPILE_REASON}. Drop "
            "--compile to predict the generate step eagerly, or predict the compiled forward "
            "at the longest length: --mode inference --compile --seq PROMPT+NEW_TOKENS"
        )
    quantize = scenario.quantize
    fields: dict[str, Any] = {
        name: value
        for name, value in (
            ("checkpointing", step.checkpointing),
            ("checkpoint_reentrant", step.checkpoint_reentrant or None),
            ("grad_accum", step.grad_accum),
            ("max_grad_norm", step.max_grad_norm),
            ("precision", step.precision),
            ("optimizer", step.optimizer),
            ("mode", step.mode),
            ("batch_size", batch_size if batch_size is not None else step.batch),
            ("seq_len", step.seq),
            ("image_size", step.image_size),
            ("new_tokens", step.new_tokens),
            ("optimizer_impl", step.optimizer_impl),
            ("lora", lora_options(scenario)),
            ("quantize", None if quantize is None else quantize.format),
            ("double_quant", None if quantize is None else quantize.double_quant or None),
            ("compute_dtype", None if quantize is None else quantize.compute_dtype),
            ("compile", step.compile or None),
            ("hf_class", scenario.model.hf_class),
            ("attn_implementation", scenario.model.attn_implementation),
        )
        if value is not None
    }
    defaults: dict[str, str] = {}
    notes: dict[str, str] = {}
    if scenario.model.trainer_args is not None:  # its values, under the fields given
        fields, notes = _trainer_fields(scenario, fields, preset)
    elif "precision" not in fields:
        precision, words = _default_precision(scenario, preset, gpu)
        if precision is not None:
            fields["precision"] = precision
        if words is not None:
            defaults["precision"] = words
    if preset is not None and scenario.model.trainer_args is None:
        fields.setdefault("batch_size", preset.default_batch_size)
    try:
        options = StepOptions(**fields)
    except ValueError as exc:  # a combination the sections' types cannot rule out
        raise OomkitError(field_wording(str(exc))) from exc
    return ResolvedStep(options, defaults, notes)


def _trainer_fields(
    scenario: Scenario, explicit: dict[str, Any], preset: Any
) -> tuple[dict[str, Any], dict[str, str]]:
    """The StepOptions fields of ``model.trainer_args`` with the fields given (``explicit``)
    winning, and what was read, overridden or ignored.

    Raises:
        ConfigError: a bad file (exit 2), see ``read_trainer_args``.
    """
    from oomkit.prediction.models.trainer_args import read_trainer_args

    path = scenario.model.trainer_args
    assert path is not None
    settings = read_trainer_args(path)
    model_precision: str | None = "fp32"  # a preset is built in fp32
    if preset is None and settings.mixed_precision is not None and "precision" not in explicit:
        # --hf: the model is built in its config's dtype; bf16=True over bf16 weights.
        from oomkit.prediction.models.hf import config_precision, load_hf_config

        model_precision = config_precision(load_hf_config(scenario.model.hf))[0]
    elif preset is None:
        model_precision = None  # --hf: the config's own dtype, as from_config builds it
    fields, notes = settings.step_fields(explicit, model_precision)
    return fields, {"trainer args": path, **notes}


# A library message names StepOptions' fields (StepOptions(seq_len=...)); a scenario's user
# knows its flags and fields: each is written as both.
_FIELDS = {
    "seq_len": ("--seq", "step.seq"),
    "image_size": ("--image-size", "step.image_size"),
    "new_tokens": ("--new-tokens", "step.new_tokens"),
    "batch_size": ("--batch", "step.batch"),
    "lora": ("--lora", "lora.rank"),
    "quantize": ("--quantize", "quantize.format"),
    "double_quant": ("--double-quant", "quantize.double_quant"),
    "compute_dtype": ("--compute-dtype", "quantize.compute_dtype"),
    "grad_accum": ("--grad-accum", "step.grad_accum"),
    "optimizer": ("--optimizer", "step.optimizer"),
    "optimizer_impl": ("--optimizer-impl", "step.optimizer_impl"),
    "precision": ("--precision", "step.precision"),
    "mode": ("--mode", "step.mode"),
    "compile": ("--compile", "step.compile"),
}
# StepOptions(...) with its arguments, one level of parentheses inside (a tuple value).
_STEP_OPTIONS_RE = re.compile(r"StepOptions\(((?:[^()]|\([^()]*\))*)\)")
_ARGUMENT_RE = re.compile(r"\s*(\w+)=((?:[^,()]|\([^()]*\))*)\s*(?:,|$)")


def field_wording(message: str) -> str:
    """``message`` with each ``StepOptions(field=value, ...)`` written as the flags that set
    them (``StepOptions(seq_len=...)`` -> ``--seq N``; ``StepOptions(optimizer='adamw',
    optimizer_impl='fused')`` -> ``--optimizer adamw --optimizer-impl fused``); left as it is
    where a field has no flag."""

    def flags(match: re.Match[str]) -> str:
        arguments = match.group(1)
        parsed = [(m.group(1), m.group(2).strip()) for m in _ARGUMENT_RE.finditer(arguments)]
        if not parsed or any(name not in _FIELDS or "(" in value for name, value in parsed):
            return match.group(0)  # a field without a flag, or a Python value (LoraOptions(...))
        words = []
        for name, value in parsed:
            if value == "True":  # a switch: the flag alone
                words.append(_FIELDS[name][0])
            else:
                shown = "N" if value == "..." else value.strip(chr(39))
                words.append(f"{_FIELDS[name][0]} {shown}".rstrip())
        return " ".join(words)

    return _STEP_OPTIONS_RE.sub(flags, message)

"""What one built-in workload step does (StepOptions) and what building it returns (BuiltStep)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args

from oomkit.prediction.models.lora_options import LoraOptions, lora_options_from

__all__ = [
    "BuiltStep",
    "ComputeDtype",
    "Mode",
    "OptimizerImpl",
    "OptimizerName",
    "Precision",
    "Quantize",
    "StepOptions",
]

Precision = Literal["fp32", "fp16-mixed", "bf16-mixed", "bf16", "fp16"]
OptimizerName = Literal["adamw", "adam", "sgd", "adamw8bit", "paged-adamw8bit", "adafactor"]
OptimizerImpl = Literal["foreach", "fused", "for-loop"]
Quantize = Literal["nf4", "fp4"]
ComputeDtype = Literal["fp32", "bf16", "fp16"]
Mode = Literal["train", "inference", "generate"]

PRECISIONS: tuple[Precision, ...] = get_args(Precision)
OPTIMIZERS: tuple[OptimizerName, ...] = get_args(OptimizerName)
MODES: tuple[Mode, ...] = get_args(Mode)
OPTIMIZER_IMPLS: tuple[OptimizerImpl, ...] = get_args(OptimizerImpl)
QUANTIZE: tuple[Quantize, ...] = get_args(Quantize)
COMPUTE_DTYPES: tuple[ComputeDtype, ...] = get_args(ComputeDtype)


@dataclass(frozen=True)
class StepOptions:
    """How a preset or Hugging Face model is run for one step.

    Attributes:
        batch_size: sequences (or images) per step.
        seq_len: tokens per sequence for text models; ``None`` takes the preset's default. In
            ``generate`` mode it is the prompt length.
        image_size: image height and width in pixels for vision models; ``None`` means 224.
        precision: ``fp32``; ``fp16-mixed`` / ``bf16-mixed`` (fp32 weights and optimizer states,
            forward and loss under ``torch.autocast("cuda", dtype)``; fp16 adds GradScaler's
            tensors); ``bf16`` / ``fp16`` (model, gradients and optimizer states all in that
            dtype, no autocast, no scaler). ``None`` (the default): the model's own, i.e.
            ``fp32`` for a preset, and for a Hugging Face model the dtype its config names
            (``torch_dtype``, ``dtype`` in newer transformers), which ``from_config`` builds it
            in (``bfloat16`` -> ``bf16``; no dtype -> ``fp32``).
        optimizer: ``adamw`` / ``adam`` (two states per parameter), ``sgd`` (momentum 0.9, one),
            ``adamw8bit`` / ``paged-adamw8bit`` or ``adafactor`` (see ``optimizer_impl``).
        checkpointing: recompute each block in backward (``torch.utils.checkpoint``,
            ``use_reentrant=False``) instead of keeping its activations.
        mode: ``train`` (forward, loss, backward, optimizer step, ``zero_grad(set_to_none=True)``),
            ``inference`` (forward under ``torch.no_grad``) or ``generate`` (greedy decoding with a
            KV cache; decoder models only).
        new_tokens: ``generate`` only: tokens produced after the prompt.
        lora: LoRA adapters injected with peft (``LoraOptions``; a mapping of its fields is
            accepted too); the base weights are then frozen. ``None``: full fine-tuning.
        optimizer_impl: ``foreach`` (CUDA's default), ``fused`` (``adamw`` / ``adam``: torch
            has no meta kernel for fused SGD) or ``for-loop`` (torch's ``adamw`` / ``adam`` /
            ``sgd``). The optimizers beyond torch's (their states are
            in ``oomkit.prediction.models.optimizers``): ``adamw8bit`` / ``paged-adamw8bit``
            (bitsandbytes' 8-bit states, emulated; paged states are unified memory, not counted
            on the device) and ``adafactor`` (transformers' ``Adafactor`` as the HF Trainer
            configures it).
        quantize: ``nf4`` / ``fp4``: every ``nn.Linear`` but the output layer stored as
            bitsandbytes ``Linear4bit`` stores it (QLoRA; emulated, see
            ``oomkit.prediction.models.quantized``); training then needs ``lora``. ``None``: no
            quantization.
        double_quant: ``bnb_4bit_use_double_quant`` (``quantize`` only).
        compute_dtype: ``bnb_4bit_compute_dtype`` (``quantize`` only); ``None``: the model's
            parameter dtype (bf16 for ``precision="bf16"``, else fp32).
        compile: wrap the model's forward in ``torch.compile`` (default Inductor mode); record
            with ``compile=True`` (``predict(..., compile=True)``) so that it is recorded as
            compiled (``train`` and ``inference`` modes).
    """

    batch_size: int = 8
    seq_len: int | None = None
    image_size: int | None = None
    precision: Precision | None = None
    optimizer: OptimizerName = "adamw"
    checkpointing: bool = False
    mode: Mode = "train"
    new_tokens: int = 128
    lora: LoraOptions | None = None
    optimizer_impl: OptimizerImpl = "foreach"
    quantize: Quantize | None = None
    double_quant: bool = False
    compute_dtype: ComputeDtype | None = None
    compile: bool = False

    def __post_init__(self) -> None:
        lora: Any = self.lora
        object.__setattr__(self, "lora", lora_options_from(lora))
        if self.precision is not None:
            _check_choice("precision", self.precision, PRECISIONS, "bf16-mixed")
        _check_choice("optimizer", self.optimizer, OPTIMIZERS, "adamw")
        _check_choice("mode", self.mode, MODES, "train")
        _check_choice("optimizer_impl", self.optimizer_impl, OPTIMIZER_IMPLS, "fused")
        # torch 2.13 has no meta kernel for _fused_sgd_, so fused applies to Adam/AdamW only.
        allowed = {"foreach": OPTIMIZERS, "for-loop": ("adamw", "adam", "sgd")}.get(
            self.optimizer_impl, ("adamw", "adam")
        )
        if self.optimizer not in allowed:
            raise ValueError(
                f"StepOptions.optimizer_impl {self.optimizer_impl!r} applies to "
                f"{', '.join(allowed)} only, not {self.optimizer!r}. Example: "
                "StepOptions(optimizer='adamw', optimizer_impl='fused')"
            )
        self._check_quantize()
        if self.compile and self.mode == "generate":
            raise ValueError(
                "StepOptions.compile applies to mode 'train' and 'inference': a generate step's "
                "growing KV cache would recompile on every token. Example: "
                "StepOptions(mode='train', compile=True)"
            )
        for field_name, example in (("batch_size", 8), ("new_tokens", 128)):
            value = getattr(self, field_name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"StepOptions.{field_name} must be a positive integer; got {value!r}. "
                    f"Example: StepOptions({field_name}={example})"
                )
        for field_name, example in (("seq_len", 1024), ("image_size", 224)):
            value = getattr(self, field_name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(
                    f"StepOptions.{field_name} must be a positive integer or None (the preset's "
                    f"default); got {value!r}. Example: StepOptions({field_name}={example})"
                )


    def _check_quantize(self) -> None:
        if self.quantize is None:
            if self.double_quant or self.compute_dtype is not None:
                raise ValueError(
                    "StepOptions.double_quant and compute_dtype configure 4-bit weights; add "
                    "quantize, e.g. StepOptions(quantize='nf4')"
                )
            return
        _check_choice("quantize", self.quantize, QUANTIZE, "nf4")
        if self.compute_dtype is not None:
            _check_choice("compute_dtype", self.compute_dtype, COMPUTE_DTYPES, "bf16")
        if self.mode == "train" and self.lora is None:
            raise ValueError(
                "4-bit weights are frozen (bitsandbytes Params4bit has no gradient): training "
                "a quantized model needs LoRA adapters: add StepOptions(lora=...), or use mode "
                "'inference'"
            )
        if self.mode == "generate":
            raise ValueError(
                "generating with 4-bit weights takes bitsandbytes' gemv_4bit path, which oomkit "
                "does not model; use mode 'train' (with LoRA) or 'inference'"
            )


def _check_choice(name: str, value: object, choices: tuple[str, ...], example: str) -> None:
    if value not in choices:
        raise ValueError(
            f"StepOptions.{name} must be one of {', '.join(choices)}; got {value!r}. "
            f"Example: StepOptions({name}={example!r})"
        )


@dataclass(frozen=True)
class BuiltStep:
    """A ready-to-trace step of a built model.

    Attributes:
        step_fn: runs one step; call it under the Tracer (meta tensors).
        track: model, optimizer (train mode) and inputs, created once: pass them to
            ``trace_step(step_fn, *track)`` or ``Tracer.track`` so they count from the start.
        description: one line, e.g. ``"GPT-2 124M, batch 8, seq 1024, bf16-mixed, adamw, train"``.
        parameter_count: parameters of the model (tied weights once).
        options: the options as built, defaults resolved (``precision`` is never ``None``
            here); ``None`` only from code that builds a ``BuiltStep`` by hand.
        precision_source: where ``options.precision`` came from when the caller gave none
            (``"from the config's torch_dtype"``); ``None`` when it was given.
    """

    step_fn: Callable[[], object]
    track: tuple[object, ...]
    description: str
    parameter_count: int
    options: StepOptions | None = None
    precision_source: str | None = None

"""What one built-in workload step does (StepOptions) and what building it returns (BuiltStep)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args

from oomkit.errors import ConfigError
from oomkit.prediction.models.lora_options import LoraOptions, lora_options_from

__all__ = [
    "ATTN_IMPLEMENTATIONS",
    "CHECKPOINTING_MODES",
    "AttnImplementation",
    "GENERATE_COMPILE_REASON",
    "BuiltStep",
    "Checkpointing",
    "ComputeDtype",
    "Mode",
    "OptimizerImpl",
    "OptimizerName",
    "Precision",
    "Quantize",
    "StepOptions",
    "TrainerMixedPrecision",
]

Precision = Literal["fp32", "fp16-mixed", "bf16-mixed", "bf16", "fp16"]
OptimizerName = Literal[
    "adamw", "adam", "sgd", "adamw8bit", "paged-adamw8bit", "adafactor", "torch-adafactor"
]
OptimizerImpl = Literal["foreach", "fused", "for-loop"]
Quantize = Literal["nf4", "fp4", "int8"]
ComputeDtype = Literal["fp32", "bf16", "fp16"]
Mode = Literal["train", "inference", "generate"]
Checkpointing = Literal["none", "full", "selective-op"]
TrainerMixedPrecision = Literal["no", "bf16", "fp16"]
# transformers' attn_implementation values oomkit models (models/hf_attention.py).
AttnImplementation = Literal["eager", "sdpa", "flash_attention_2", "flex_attention"]

PRECISIONS: tuple[Precision, ...] = get_args(Precision)
OPTIMIZERS: tuple[OptimizerName, ...] = get_args(OptimizerName)
MODES: tuple[Mode, ...] = get_args(Mode)
OPTIMIZER_IMPLS: tuple[OptimizerImpl, ...] = get_args(OptimizerImpl)
QUANTIZE: tuple[Quantize, ...] = get_args(Quantize)
COMPUTE_DTYPES: tuple[ComputeDtype, ...] = get_args(ComputeDtype)
CHECKPOINTING_MODES: tuple[Checkpointing, ...] = get_args(Checkpointing)
TRAINER_MIXED_PRECISIONS: tuple[TrainerMixedPrecision, ...] = get_args(TrainerMixedPrecision)
ATTN_IMPLEMENTATIONS: tuple[AttnImplementation, ...] = get_args(AttnImplementation)

# Why a compiled generate step is refused rather than predicted. The preset's loop (and
# transformers' DynamicCache) grows the KV cache by one token per step, so a compiled decode
# recompiles at the second shape with the cache length symbolic (torch/_dynamo/config.py
# automatic_dynamic_shapes); transformers compiles generation only with a static cache and its
# CompileConfig's default mode "reduce-overhead" (generation/configuration_utils.py), i.e. CUDA
# graphs. Neither is what tracing/compile_plan.py emulates (static sizes, default mode).
GENERATE_COMPILE_REASON = (
    "a compiled generate loop runs its decode step as one dynamic-shape graph (the KV cache "
    "grows a token per step, so dynamo's automatic_dynamic_shapes makes its length symbolic "
    "after the second shape), or, with Hugging Face's static cache, under CUDA graphs "
    "(transformers' CompileConfig default mode 'reduce-overhead'); oomkit's Inductor emulation "
    "plans static sizes only and does not model CUDA graph pools"
)


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
            ``adamw8bit`` / ``paged-adamw8bit``, ``adafactor`` (transformers') or
            ``torch-adafactor`` (``torch.optim.Adafactor``) (see ``optimizer_impl``).
        checkpointing: activation checkpointing of each transformer (or residual) block:
            ``none``; ``full`` (recompute the whole block in backward,
            ``torch.utils.checkpoint`` with ``use_reentrant=False``); ``selective-op``
            (torchtitan's per-op policy: the block's matmul, attention and reduce-scatter
            outputs are saved, every second ``mm`` and everything else recomputed; see
            ``oomkit.prediction.models.selective_ac``). ``True`` / ``False`` are read as
            ``full`` / ``none``.
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
            ``oomkit.prediction.models.quantized``); ``int8``: as ``Linear8bitLt`` (LLM.int8(),
            threshold 6.0; ``oomkit.prediction.models.int8``); training then needs ``lora``.
            ``None``: no quantization.
        double_quant: ``bnb_4bit_use_double_quant`` (``quantize`` only).
        compute_dtype: ``bnb_4bit_compute_dtype`` (``quantize`` only); ``None``: the model's
            parameter dtype (bf16 for ``precision="bf16"``, else fp32).
        grad_accum: gradient accumulation (``train`` only): each step runs this many
            micro-batches of ``batch_size``, forward and backward each, the loss divided by it
            as the HF Trainer does (gradients are made by the first backward and added to in
            place by the later ones), then one optimizer step and ``zero_grad``.
        max_grad_norm: clip the gradients' total norm to this before the optimizer step
            (``torch.nn.utils.clip_grad_norm_``, foreach as on CUDA; the HF Trainer's
            ``max_grad_norm``, 1.0 by default there); ``None``: no clipping.
        checkpoint_reentrant: with ``checkpointing``, ``use_reentrant=True`` (torch's
            reentrant ``CheckpointFunction``) instead of the non-reentrant default (Hugging Face
            models only: ``gradient_checkpointing_kwargs={"use_reentrant": True}``).
        compile: wrap the model's forward in ``torch.compile`` (default Inductor mode); record
            with ``compile=True`` (``predict(..., compile=True)``) so that it is recorded as
            compiled (``train`` and ``inference`` modes).
        trainer_mixed_precision: the step is the Hugging Face Trainer's ``training_step``, whose
            Accelerator was built with this ``mixed_precision`` (``"no"``, ``"bf16"``,
            ``"fp16"``; ``trainer_step_options`` sets it from ``bf16`` / ``fp16``): the
            model's outputs are dropped when ``compute_loss`` returns (before backward), the
            running-loss scalar ``tr_loss`` is kept and added to, and with ``bf16`` / ``fp16``
            a Hugging Face model's forward is wrapped as accelerate's ``prepare_model`` wraps
            it (autocast, then ``convert_outputs_to_fp32``), whatever its weights' dtype.
            ``None``: a plain training loop (``train`` only).
        trainer_empty_cache_steps: the Trainer's ``torch_empty_cache_steps``: in the optimizer
            steps this divides (0, N, 2N, ... of the recording), each micro-batch empties the
            cache after its loss, before its backward (``training_step``:
            ``clear_device_cache()``). Needs ``trainer_mixed_precision``.
        hf_class: Hugging Face models only: the class the model is built with, an auto class
            (``"AutoModelForSequenceClassification"``, ``...ForTokenClassification``,
            ``...ForCausalLM``, ``...ForMaskedLM``, ``...ForImageClassification``) or a
            concrete one (``"BertForSequenceClassification"``). ``None``: the config's
            ``architectures[0]``, else the first auto class that knows the config (an encoder
            as a masked LM).
        attn_implementation: Hugging Face models only: transformers' ``attn_implementation``
            (``eager``: the full attention-probability matrices; ``sdpa``; ``flash_attention_2``
            and ``flex_attention``, emulated from their kernels' allocations:
            ``oomkit.prediction.models.hf_attention``). ``None``: the config's own, else
            ``sdpa`` (transformers' default where SDPA is available).
    """

    batch_size: int = 8
    seq_len: int | None = None
    image_size: int | None = None
    precision: Precision | None = None
    optimizer: OptimizerName = "adamw"
    checkpointing: Checkpointing = "none"
    mode: Mode = "train"
    new_tokens: int = 128
    lora: LoraOptions | None = None
    optimizer_impl: OptimizerImpl = "foreach"
    quantize: Quantize | None = None
    double_quant: bool = False
    compute_dtype: ComputeDtype | None = None
    grad_accum: int = 1
    max_grad_norm: float | None = None
    checkpoint_reentrant: bool = False
    compile: bool = False
    trainer_mixed_precision: TrainerMixedPrecision | None = None
    trainer_empty_cache_steps: int | None = None
    hf_class: str | None = None
    attn_implementation: AttnImplementation | None = None

    def __post_init__(self) -> None:
        lora: Any = self.lora
        object.__setattr__(self, "lora", lora_options_from(lora))
        checkpointing: object = self.checkpointing
        if isinstance(checkpointing, bool):  # the boolean field of older oomkit
            object.__setattr__(self, "checkpointing", "full" if checkpointing else "none")
        _check_choice("checkpointing", self.checkpointing, CHECKPOINTING_MODES, "selective-op")
        if self.precision is not None:
            _check_choice("precision", self.precision, PRECISIONS, "bf16-mixed")
        _check_choice("optimizer", self.optimizer, OPTIMIZERS, "adamw")
        _check_choice("mode", self.mode, MODES, "train")
        _check_choice("optimizer_impl", self.optimizer_impl, OPTIMIZER_IMPLS, "fused")
        # torch 2.13 has no meta kernel for _fused_sgd_, so fused applies to Adam/AdamW only.
        for_loop = ("adamw", "adam", "sgd", "torch-adafactor")
        allowed = {"foreach": OPTIMIZERS, "for-loop": for_loop}.get(
            self.optimizer_impl, ("adamw", "adam")
        )
        if self.optimizer not in allowed:
            raise ConfigError(
                f"StepOptions.optimizer_impl {self.optimizer_impl!r} applies to "
                f"{', '.join(allowed)} only, not {self.optimizer!r}. Example: "
                "StepOptions(optimizer='adamw', optimizer_impl='fused')"
            )
        self._check_quantize()
        self._check_training_loop()
        if self.attn_implementation is not None:
            _check_choice("attn_implementation", self.attn_implementation, ATTN_IMPLEMENTATIONS,
                          "eager")
        if self.hf_class is not None and (
            not isinstance(self.hf_class, str) or not self.hf_class.isidentifier()
        ):
            raise ConfigError(
                f"StepOptions.hf_class must be a transformers class name; got {self.hf_class!r}. "
                "Example: StepOptions(hf_class='AutoModelForSequenceClassification')"
            )
        if self.compile and self.mode == "generate":
            raise ConfigError(
                "StepOptions.compile applies to mode 'train' and 'inference', not 'generate': "
                f"{GENERATE_COMPILE_REASON}. Predict the generate step eagerly (compile=False), "
                "or the compiled forward at the longest length (prompt + new tokens). Example: "
                "StepOptions(mode='inference', seq_len=1152, compile=True)"
            )
        for field_name, example in (("batch_size", 8), ("new_tokens", 128), ("grad_accum", 4)):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(
                    f"StepOptions.{field_name} must be a positive integer; got {value!r}. "
                    f"Example: StepOptions({field_name}={example})"
                )
        for field_name, example in (("seq_len", 1024), ("image_size", 224)):
            value = getattr(self, field_name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(
                    f"StepOptions.{field_name} must be a positive integer or None (the preset's "
                    f"default); got {value!r}. Example: StepOptions({field_name}={example})"
                )

    def _check_training_loop(self) -> None:
        norm = self.max_grad_norm
        if norm is not None and (
            isinstance(norm, bool) or not isinstance(norm, int | float) or not norm > 0
        ):
            raise ConfigError(
                f"StepOptions.max_grad_norm must be a positive number or None (no clipping); got "
                f"{norm!r}. Example: StepOptions(max_grad_norm=1.0)"
            )
        if self.checkpoint_reentrant and self.checkpointing == "none":
            raise ConfigError(
                "StepOptions.checkpoint_reentrant picks how checkpointing recomputes; add "
                "StepOptions(checkpointing='full'), or drop it"
            )
        if self.checkpoint_reentrant and self.checkpointing == "selective-op":
            # torch/utils/checkpoint.py: use_reentrant=True takes no context_fn (the policy).
            raise ConfigError(
                "selective-op checkpointing needs use_reentrant=False (torch's reentrant "
                "checkpoint takes no policy); drop checkpoint_reentrant or use 'full'"
            )
        if self.trainer_mixed_precision is not None:
            _check_choice(
                "trainer_mixed_precision", self.trainer_mixed_precision, TRAINER_MIXED_PRECISIONS, "bf16"
            )
        every = self.trainer_empty_cache_steps
        if every is not None:
            if isinstance(every, bool) or not isinstance(every, int) or every < 1:
                raise ConfigError(
                    "StepOptions.trainer_empty_cache_steps must be a whole number >= 1 (the "
                    f"Trainer's torch_empty_cache_steps) or None; got {every!r}"
                )
            if self.trainer_mixed_precision is None:
                raise ConfigError(
                    "StepOptions.trainer_empty_cache_steps is the Trainer's training_step's; add "
                    "trainer_mixed_precision (trainer_step_options sets both), or drop it"
                )
        if self.mode != "train" and (
            self.grad_accum != 1 or norm is not None or self.trainer_mixed_precision is not None
        ):
            raise ConfigError(
                "gradient accumulation, clipping and the Trainer's loop apply to training steps; "
                "use StepOptions(mode='train'), or drop grad_accum, max_grad_norm and "
                "trainer_mixed_precision"
            )

    def _check_quantize(self) -> None:
        if self.quantize is None:
            if self.double_quant or self.compute_dtype is not None:
                raise ConfigError(
                    "StepOptions.double_quant and compute_dtype configure 4-bit weights; add "
                    "quantize, e.g. StepOptions(quantize='nf4')"
                )
            return
        _check_choice("quantize", self.quantize, QUANTIZE, "nf4")
        if self.quantize == "int8" and (self.double_quant or self.compute_dtype is not None):
            raise ConfigError(
                "StepOptions.double_quant and compute_dtype configure 4-bit weights; int8 "
                "(Linear8bitLt) has neither: drop them, or use StepOptions(quantize='nf4')"
            )
        if self.compute_dtype is not None:
            _check_choice("compute_dtype", self.compute_dtype, COMPUTE_DTYPES, "bf16")
        if self.mode == "train" and self.lora is None:
            raise ConfigError(
                "quantized weights are frozen (bitsandbytes Params4bit / Int8Params have no "
                "gradient): training "
                "a quantized model needs LoRA adapters: add StepOptions(lora=...), or use mode "
                "'inference'"
            )
        if self.mode == "generate" and self.quantize != "int8":
            raise ConfigError(
                "generating with 4-bit weights takes bitsandbytes' gemv_4bit path, which oomkit "
                "does not model; use mode 'train' (with LoRA) or 'inference'"
            )


def _check_choice(name: str, value: object, choices: tuple[str, ...], example: str) -> None:
    if value not in choices:
        raise ConfigError(
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

"""What one built-in workload step does (StepOptions) and what building it returns (BuiltStep)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

__all__ = ["BuiltStep", "Mode", "OptimizerName", "Precision", "StepOptions"]

Precision = Literal["fp32", "fp16-mixed", "bf16-mixed", "bf16", "fp16"]
OptimizerName = Literal["adamw", "adam", "sgd"]
Mode = Literal["train", "inference", "generate"]

PRECISIONS: tuple[Precision, ...] = get_args(Precision)
OPTIMIZERS: tuple[OptimizerName, ...] = get_args(OptimizerName)
MODES: tuple[Mode, ...] = get_args(Mode)


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
        optimizer: ``adamw`` / ``adam`` (two states per parameter) or ``sgd`` (momentum 0.9, one).
        checkpointing: recompute each block in backward (``torch.utils.checkpoint``,
            ``use_reentrant=False``) instead of keeping its activations.
        mode: ``train`` (forward, loss, backward, optimizer step, ``zero_grad(set_to_none=True)``),
            ``inference`` (forward under ``torch.no_grad``) or ``generate`` (greedy decoding with a
            KV cache; decoder models only).
        new_tokens: ``generate`` only: tokens produced after the prompt.
    """

    batch_size: int = 8
    seq_len: int | None = None
    image_size: int | None = None
    precision: Precision | None = None
    optimizer: OptimizerName = "adamw"
    checkpointing: bool = False
    mode: Mode = "train"
    new_tokens: int = 128

    def __post_init__(self) -> None:
        if self.precision is not None:
            _check_choice("precision", self.precision, PRECISIONS, "bf16-mixed")
        _check_choice("optimizer", self.optimizer, OPTIMIZERS, "adamw")
        _check_choice("mode", self.mode, MODES, "train")
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

"""The fine-tuning flags of ``predict`` and ``fit``: --lora, --quantize, --grad-accum, --trainer-args."""

from __future__ import annotations

import argparse
from typing import Any

from oomkit.errors import OomkitError
from oomkit.interfaces.cli._common import float_arg, positive_int

__all__ = [
    "FINETUNE_OPTION_FLAGS",
    "add_lora_flags",
    "add_quantize_flags",
    "add_trainer_flags",
    "lora_options",
    "trainer_fields",
]


def _probability(text: str) -> float:
    return float_arg(text, lambda p: 0.0 <= p < 1.0, "expected a probability in [0, 1), e.g. 0.05")


def add_lora_flags(parser: argparse.ArgumentParser) -> None:
    """--lora R and its options: peft LoRA adapters on a preset or --hf model."""
    parser.add_argument(
        "--lora",
        type=positive_int,
        metavar="R",
        help="train LoRA adapters of rank R (peft) instead of the whole model: base weights "
        "frozen, no gradients or optimizer states for them (presets, --hf)",
    )
    parser.add_argument(
        "--lora-alpha", type=positive_int, metavar="N", help="lora_alpha (default 8, peft's)"
    )
    parser.add_argument(
        "--lora-targets",
        metavar="NAMES",
        help="comma-separated modules to adapt, e.g. q_proj,v_proj (default: peft's for the "
        "architecture)",
    )
    parser.add_argument(
        "--lora-dropout", type=_probability, metavar="P", help="lora_dropout (default 0)"
    )
    parser.add_argument(
        "--lora-modules-to-save",
        metavar="NAMES",
        help="comma-separated modules trained in full beside the adapters, e.g. lm_head",
    )
    parser.add_argument("--dora", action="store_true", help="DoRA (LoraConfig use_dora=True)")


def add_quantize_flags(parser: argparse.ArgumentParser) -> None:
    """--quantize and its options: bitsandbytes 4-bit or 8-bit base weights, emulated."""
    parser.add_argument(
        "--quantize",
        choices=("nf4", "fp4", "int8"),
        help="store every Linear but the output layer as bitsandbytes Linear4bit (nf4, fp4: "
        "QLoRA) or Linear8bitLt (int8: LLM.int8(), threshold 6.0, no outlier columns assumed); "
        "training needs --lora",
    )
    parser.add_argument(
        "--double-quant",
        action="store_true",
        help="bnb_4bit_use_double_quant (with --quantize nf4|fp4)",
    )
    parser.add_argument(
        "--compute-dtype",
        choices=("fp32", "bf16", "fp16"),
        help="bnb_4bit_compute_dtype (with --quantize nf4|fp4; default: the model's parameter "
        "dtype)",
    )


def lora_options(args: argparse.Namespace) -> Any:
    """The ``LoraOptions`` of --lora and its options; ``None`` without --lora.

    Raises:
        OomkitError: a LoRA option without --lora.
    """
    given: dict[str, Any] = {
        name: value
        for name, value in (
            ("alpha", getattr(args, "lora_alpha", None)),
            ("targets", getattr(args, "lora_targets", None)),
            ("dropout", getattr(args, "lora_dropout", None)),
            ("modules_to_save", getattr(args, "lora_modules_to_save", None)),
            ("dora", getattr(args, "dora", False) or None),
        )
        if value is not None
    }
    if getattr(args, "lora", None) is None:
        if given:
            flags = ", ".join(_LORA_FLAGS[name] for name in given)
            raise OomkitError(
                f"{flags} {'configures' if len(given) == 1 else 'configure'} LoRA: add --lora R "
                "(e.g. --lora 16), or drop it."
            )
        return None
    from oomkit.prediction.models.lora_options import LoraOptions

    try:
        return LoraOptions(r=args.lora, **given)
    except ValueError as exc:
        raise OomkitError(str(exc)) from exc


# The LoRA options' flags by argparse dest, for refusing them on a file.py:function target.
FINETUNE_OPTION_FLAGS = (
    ("lora_alpha", "--lora-alpha"),
    ("lora_targets", "--lora-targets"),
    ("lora_dropout", "--lora-dropout"),
    ("lora_modules_to_save", "--lora-modules-to-save"),
)

_LORA_FLAGS = {
    "alpha": "--lora-alpha",
    "targets": "--lora-targets",
    "dropout": "--lora-dropout",
    "modules_to_save": "--lora-modules-to-save",
    "dora": "--dora",
}


def add_trainer_flags(parser: argparse.ArgumentParser) -> None:
    """--grad-accum and --trainer-args: the training loop as the HF Trainer runs it."""
    parser.add_argument(
        "--grad-accum",
        type=positive_int,
        metavar="N",
        help="gradient accumulation: N micro-batches of --batch per optimizer step, each "
        "forward and backward recorded (presets, --hf)",
    )
    parser.add_argument(
        "--trainer-args",
        metavar="FILE",
        help="a transformers TrainingArguments (or TRL SFTConfig) JSON: its batch, "
        "accumulation, checkpointing, bf16/fp16, optim, max_grad_norm and max_length; flags "
        "given override it (presets, --hf)",
    )


def trainer_fields(args: argparse.Namespace, explicit: dict[str, Any], preset: Any) -> dict[str, Any]:
    """The StepOptions fields of ``--trainer-args FILE`` with the flags given (``explicit``)
    winning; what was read, overridden or ignored goes to ``args.trainer_notes`` (the
    prediction's assumptions).

    Raises:
        ConfigError: a bad file (exit 2), see ``read_trainer_args``.
    """
    from oomkit.prediction.models.trainer_args import read_trainer_args

    settings = read_trainer_args(args.trainer_args)
    model_precision: str | None = "fp32"  # a preset is built in fp32
    if preset is None and settings.mixed_precision is not None and "precision" not in explicit:
        # --hf: the model is built in its config's dtype; bf16=True over bf16 weights.
        from oomkit.prediction.models.hf import config_precision, load_hf_config

        model_precision = config_precision(load_hf_config(args.hf))[0]
    elif preset is None:
        model_precision = None  # --hf: the config's own dtype, as from_config builds it
    fields, notes = settings.step_fields(explicit, model_precision)
    args.trainer_notes = {"trainer args": args.trainer_args, **notes}
    return fields

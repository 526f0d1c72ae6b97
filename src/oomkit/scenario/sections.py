"""The sections of a ``Scenario``, one record each.

What runs, the step, LoRA, quantization, lengths, the target, the parallel layout, the run and
the search.

Each field carries its command-line face in its JSON Schema (``x-flag``, ``x-group``,
``x-commands``): the CLI generates its flags from them, so the two cannot drift.
"""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from oomkit.scenario.script_fields import check_script_fields
from oomkit.units import parse_bytes

__all__ = [
    "LengthsSection",
    "LoraSection",
    "ModelSection",
    "QuantizeSection",
    "RunSection",
    "SearchSection",
    "StepSection",
    "field_flag",
]

# Bounds on every count a user gives (issue 36: a number from a flag or a file is range-checked
# before anything is built). 2**31 sequences, tokens or ranks is beyond any GPU's memory, and
# torch's meta kernels overflow int64 strides long before a product of such counts is reached.
_MAX_COUNT = 2**31 - 1
# Sizes are bytes within what a 64-bit size_t holds (the caching allocator's sizes are size_t:
# c10/cuda/CUDACachingAllocator.cpp).
_MAX_BYTES = 2**64 - 1


# A size without a unit is bytes; below this, it is almost surely a forgotten unit (`--budget
# 24` meant 24 GiB, not 24 bytes), so it is refused (0 stays valid: `--margin 0`).
_MIN_UNITLESS_BYTES = 2**20


def _bytes(value: object) -> object:
    """A size: bytes as an int, or text with a unit (``"500MiB"``); other values are left to
    the int check (which refuses them)."""
    if isinstance(value, str):
        size = parse_bytes(value)
        stripped = value.strip()
        if stripped.replace(".", "", 1).isdigit() and 0 < size < _MIN_UNITLESS_BYTES:
            raise ValueError(
                f"{value!r} has no unit, so it would mean {size} bytes; give the unit, e.g. "
                f"{stripped}GiB or {stripped}MiB (a number alone counts bytes only from "
                "1048576 on)"
            )
        return size
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        raise ValueError(f"a size must be a finite number of bytes; got {value!r}")
    return value


def _names(value: object) -> object:
    """A list of names given as ``"q_proj,v_proj"`` (a flag) or a list (a file)."""
    if isinstance(value, str):
        return tuple(part.strip() for part in value.split(",") if part.strip())
    if isinstance(value, list):
        return tuple(value)
    return value


Count = Annotated[int, Field(ge=1, le=_MAX_COUNT)]
Bytes = Annotated[int, BeforeValidator(_bytes), Field(ge=0, le=_MAX_BYTES)]
Names = Annotated[tuple[str, ...], BeforeValidator(_names)]
Precision = Literal["fp32", "fp16-mixed", "bf16-mixed", "bf16", "fp16"]
Optimizer = Literal[
    "adamw", "adam", "sgd", "adamw8bit", "paged-adamw8bit", "adafactor", "torch-adafactor"
]


def _flag(
    flag: str | None,
    group: str,
    *,
    metavar: str | None = None,
    commands: tuple[str, ...] = ("predict", "fit"),
) -> dict[str, Any]:
    """A field's command-line face in its JSON Schema: its flag (``None``: ``--config`` /
    ``--set`` only), its ``--help`` group and the commands that take it."""
    extra: dict[str, Any] = {"x-group": group, "x-commands": list(commands)}
    if flag is not None:
        extra["x-flag"] = flag
    if metavar is not None:
        extra["x-metavar"] = metavar
    return extra


WORKLOAD = "workload"
PRECISION = "precision and optimizer"
FINETUNE = "fine-tuning"
MULTI_GPU = "multi-GPU"
DEVICE = "device and allocator"
RUN = "run"
SEARCH = "search"


def _needs(cls: type[BaseModel], data: Any, section: str, key: str, words: str) -> Any:
    """Refuse a section's options without the field that turns it on (``--lora-alpha``
    without ``--lora``), by their flags; unknown keys are left to the section's own check."""
    if not isinstance(data, Mapping) or data.get(key) is not None:
        return data
    known = [name for name in data if name in cls.model_fields]
    if len(known) < len(data):
        return data
    flags = ", ".join(field_flag(cls, name) or f"{section}.{name}" for name in known)
    one = len(known) == 1
    verb = words.replace("configure ", "configures ").replace("go with", "goes with") if one else words
    raise ValueError(f"{flags or f'a {section} section'} {verb}, or drop {'it' if one else 'them'}.")


def _kinds(annotation: Any) -> set[Any]:
    """The plain types a field's annotation admits (``Count | None``: int and NoneType)."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _kinds(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return set().union(*(_kinds(arg) for arg in typing.get_args(annotation)))
    return {annotation}


def _numeric(annotation: Any) -> bool:
    """Whether a field takes a number and not a bool (``int``, ``Count | None``, ``float``...)."""
    kinds = _kinds(annotation)
    return bool(kinds & {int, float}) and bool not in kinds


class _Section(BaseModel):
    """A frozen section that refuses unknown keys (a typo in a config file is an error)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _not_a_bool(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic's lax mode reads True as 1: `batch=True` or `batch = true` in a file is a
        # mistake, not a batch of one.
        if isinstance(value, bool) and info.field_name is not None:
            if _numeric(cls.model_fields[info.field_name].annotation):
                raise ValueError(f"expected a number, not {str(value).lower()}")
        return value


class ModelSection(_Section):
    """What runs: exactly one of a built-in preset, a Hugging Face model, a builder function
    (``file.py:function``) or a whole training script (``file.py``)."""

    preset: str | None = Field(
        None,
        description="a built-in model (`oomkit presets`)",
        json_schema_extra=_flag(None, WORKLOAD),
    )
    hf: str | None = Field(
        None,
        description="a Hugging Face config directory or hub name",
        json_schema_extra=_flag("--hf", WORKLOAD, metavar="NAME_OR_PATH"),
    )
    function: str | None = Field(
        None,
        description="path/to/file.py:function that builds the step (the builder contract)",
        json_schema_extra=_flag(None, WORKLOAD),
    )
    script: str | None = Field(
        None,
        description="path/to/train.py: a whole training script, run as `python train.py`",
        json_schema_extra=_flag(None, WORKLOAD),
    )
    script_args: tuple[str, ...] = Field(
        (),
        description="the script's own arguments (after -- on the command line)",
        json_schema_extra=_flag(None, WORKLOAD),
    )
    script_world_size: Count | None = Field(
        None,
        description="a torchrun script's ranks (torchrun's --nproc-per-node x --nnodes): it "
        "runs as rank 0 (or script_rank) of a fake process group",
        # No flag of its own: --world-size N (torchtitan.world_size) lands here with a script
        # (Scenario._script_world_size); --rank R and --all-ranks too, below.
        json_schema_extra=_flag(None, WORKLOAD),
    )
    script_rank: int | None = Field(
        None,
        ge=0,
        description="the rank of a torchrun script recorded (default 0)",
        json_schema_extra=_flag(None, WORKLOAD),
    )
    script_all_ranks: bool = Field(
        False,
        description="record each rank of a torchrun script and name the peak (one recording "
        "per rank)",
        json_schema_extra=_flag(None, WORKLOAD),
    )
    script_batch_arg: str | None = Field(
        None,
        description="a script's argument that sets its batch (e.g. --batch_size)",
        json_schema_extra=_flag("--batch-arg", WORKLOAD, metavar="NAME", commands=("fit",)),
    )
    hf_class: str | None = Field(
        None,
        description="--hf: the class to build (an Auto... or a name)",
        json_schema_extra=_flag("--hf-class", WORKLOAD, metavar="CLASS"),
    )
    attn_implementation: (
        Literal["eager", "sdpa", "flash_attention_2", "flex_attention"] | None
    ) = Field(
        None,
        description="--hf: attention kernel (default: the config's)",
        json_schema_extra=_flag("--attn-implementation", WORKLOAD),
    )
    trainer_args: str | None = Field(
        None,
        description="a TrainingArguments / SFTConfig JSON file",
        json_schema_extra=_flag("--trainer-args", FINETUNE, metavar="FILE"),
    )
    eval_function: str | None = Field(
        None,
        description="an eval step (file.py:function) to fit too",
        json_schema_extra=_flag("--eval", SEARCH, metavar="FILE.PY:FUNCTION", commands=("fit",)),
    )

    @property
    def kind(self) -> Literal["preset", "hf", "function", "script"] | None:
        """Which of the four ways names what runs (``None`` when none is given)."""
        for name in ("preset", "hf", "function", "script"):
            if getattr(self, name) is not None:
                return name
        return None

    @property
    def name(self) -> str | None:
        """The preset, model, ``file.py:function`` or script named."""
        kind = self.kind
        return None if kind is None else getattr(self, kind)

    @model_validator(mode="after")
    def _one_way(self) -> ModelSection:
        given = [n for n in ("preset", "hf", "function", "script") if getattr(self, n) is not None]
        if len(given) > 1:
            named = " and ".join(
                f"{'--hf' if n == 'hf' else 'TARGET'} {getattr(self, n)!r} (model.{n})"
                for n in given
            )
            raise ValueError(f"give either a TARGET or --hf, not both: got {named}.")
        if self.function is not None and not _is_function(self.function):
            raise ValueError(
                f"model.function must be path/to/file.py:function; got {self.function!r}. "
                "Example: train.py:build_step"
            )
        if self.script is not None and not self.script.endswith(".py"):
            raise ValueError(
                f"model.script must be a Python file (path/to/train.py); got {self.script!r}"
            )
        hf_only = [
            flag for flag, value in (("--hf-class", self.hf_class),
                                     ("--attn-implementation", self.attn_implementation))
            if value is not None
        ]
        if hf_only and self.hf is None:
            raise ValueError(
                f"{' and '.join(hf_only)} {'applies' if len(hf_only) == 1 else 'apply'} to "
                "Hugging Face models (--hf) only; drop it, or predict the model with --hf"
            )
        check_script_fields(self)  # world size, ranks, batch argument and arguments of a script
        if self.eval_function is not None and not _is_function(self.eval_function):
            raise ValueError(
                f"--eval (model.eval_function) takes path/to/file.py:function; got "
                f"{self.eval_function!r}. The function builds the evaluation step as the "
                "training one's does."
            )
        return self


def _is_function(text: str) -> bool:
    path, sep, function = text.rpartition(":")
    return bool(sep) and path.endswith(".py") and bool(function)


class StepSection(_Section):
    """The step: its sizes, mode, precision, optimizer and what changes its memory."""

    batch: Count | None = Field(
        None,
        description="batch size (default 8; Llama 4)",
        json_schema_extra=_flag("--batch", WORKLOAD, metavar="N"),
    )
    seq: Count | None = Field(
        None,
        description="sequence length (default: the preset's)",
        json_schema_extra=_flag("--seq", WORKLOAD, metavar="N"),
    )
    image_size: Count | None = Field(
        None,
        description="image size of a vision model (default 224)",
        json_schema_extra=_flag("--image-size", WORKLOAD, metavar="N"),
    )
    mode: Literal["train", "inference", "generate"] | None = Field(
        None,
        description="train (default), inference or generate",
        json_schema_extra=_flag("--mode", WORKLOAD),
    )
    new_tokens: Count | None = Field(
        None,
        description="tokens --mode generate makes (default 128)",
        json_schema_extra=_flag("--new-tokens", WORKLOAD, metavar="N", commands=("predict",)),
    )
    compile: bool = Field(
        False,
        description="record torch.compile'd code compiled",
        json_schema_extra=_flag("--compile", WORKLOAD),
    )
    values: dict[str, int | float] = Field(
        default_factory=dict,
        description="what a tensor read at FILE:LINE returns",
        json_schema_extra=_flag("--value", WORKLOAD, metavar="FILE:LINE=NUMBER"),
    )
    precision: Precision | None = Field(
        None,
        description="fp32, fp16-mixed, bf16-mixed, bf16 or fp16",
        json_schema_extra=_flag("--precision", PRECISION),
    )
    optimizer: Optimizer | None = Field(
        None,
        description="adamw (default), adam, sgd, adamw8bit, ...",
        json_schema_extra=_flag("--optimizer", PRECISION),
    )
    optimizer_impl: Literal["foreach", "fused", "for-loop"] | None = Field(
        None,
        description="foreach (default), fused or for-loop kernels",
        json_schema_extra=_flag("--optimizer-impl", PRECISION),
    )
    grad_accum: Count | None = Field(
        None,
        description="micro-batches per optimizer step",
        json_schema_extra=_flag("--grad-accum", PRECISION, metavar="N"),
    )
    max_grad_norm: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="clip gradients to this total norm",
        json_schema_extra=_flag("--max-grad-norm", PRECISION, metavar="X"),
    )
    checkpointing: Literal["none", "full", "selective-op"] | None = Field(
        None,
        description="none (default), full or selective-op",
        json_schema_extra=_flag("--checkpointing", PRECISION),
    )
    checkpoint_reentrant: bool = Field(
        False,
        description="checkpoint with use_reentrant=True (--hf)",
        json_schema_extra=_flag("--checkpoint-reentrant", PRECISION),
    )


    @field_validator("values")
    @classmethod
    def _stated(cls, values: dict[str, int | float]) -> dict[str, int | float]:
        for key, value in values.items():
            path, colon, line = key.rpartition(":")
            if not colon or not path or not line.isdigit():
                raise ValueError(
                    f"a stated value is keyed by FILE:LINE, the line that reads it; got {key!r}. "
                    "Example: --value train.py:42=1024"
                )
            if isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(
                    f"the value stated for {key} must be a finite number; got {value!r}"
                )
        return values


class LoraSection(_Section):
    """LoRA adapters (peft): the base weights frozen, adapters trained."""

    rank: Count = Field(
        description="train LoRA adapters of rank R (peft)",
        json_schema_extra=_flag("--lora", FINETUNE, metavar="R"),
    )
    alpha: Count | None = Field(
        None,
        description="lora_alpha (default 8, peft's)",
        json_schema_extra=_flag("--lora-alpha", FINETUNE, metavar="N"),
    )
    targets: Names | None = Field(
        None,
        description="modules to adapt (default: peft's)",
        json_schema_extra=_flag("--lora-targets", FINETUNE, metavar="NAMES"),
    )
    dropout: float | None = Field(
        None,
        ge=0.0,
        lt=1.0,
        allow_inf_nan=False,  # NaN had been "must be below 1.0"
        description="lora_dropout (default 0)",
        json_schema_extra=_flag("--lora-dropout", FINETUNE, metavar="P"),
    )
    modules_to_save: Names | None = Field(
        None,
        description="modules trained in full, e.g. lm_head",
        json_schema_extra=_flag("--lora-modules-to-save", FINETUNE, metavar="NAMES"),
    )
    dora: bool = Field(
        False,
        description="DoRA (LoraConfig use_dora=True)",
        json_schema_extra=_flag("--dora", FINETUNE),
    )

    @model_validator(mode="before")
    @classmethod
    def _needs_rank(cls, data: Any) -> Any:
        return _needs(cls, data, "lora", "rank", "configure LoRA: add --lora R (e.g. --lora 16)")


class QuantizeSection(_Section):
    """bitsandbytes base weights: 4-bit (QLoRA) or 8-bit, emulated."""

    format: Literal["nf4", "fp4", "int8"] = Field(
        description="bitsandbytes nf4 / fp4 (QLoRA) or int8 base",
        json_schema_extra=_flag("--quantize", FINETUNE),
    )
    double_quant: bool = Field(
        False,
        description="bnb_4bit_use_double_quant (nf4, fp4)",
        json_schema_extra=_flag("--double-quant", FINETUNE),
    )
    compute_dtype: Literal["fp32", "bf16", "fp16"] | None = Field(
        None,
        description="bnb_4bit_compute_dtype (default: the weights')",
        json_schema_extra=_flag("--compute-dtype", FINETUNE),
    )

    @model_validator(mode="before")
    @classmethod
    def _needs_format(cls, data: Any) -> Any:
        return _needs(
            cls, data, "quantize", "format", "configure quantization: add quantize, e.g. --quantize nf4"
        )


class LengthsSection(_Section):
    """A run of variable-length steps (the epoch envelope)."""

    @model_validator(mode="before")
    @classmethod
    def _needs_file(cls, data: Any) -> Any:
        return _needs(cls, data, "lengths", "file", "go with --lengths FILE (the epoch envelope)")

    file: str = Field(
        description="per-step sequence lengths (a text or JSON file)",
        json_schema_extra=_flag("--lengths", RUN, metavar="FILE"),
    )
    pad_to: Count = Field(
        1,
        description="pad each length up to a multiple of N",
        json_schema_extra=_flag("--pad-to", RUN, metavar="N"),
    )
    seed: int | None = Field(
        None,
        ge=-(2**63),
        le=2**64 - 1,
        description="shuffle the steps (default: the file's order)",
        json_schema_extra=_flag("--seed", RUN, metavar="N"),
    )


class RunSection(_Section):
    """How the prediction runs: steps recorded, the budget, processes."""

    steps: Count | None = Field(
        None,
        description="steps recorded (default 3; fit 2; generate 1)",
        json_schema_extra=_flag("--steps", RUN, metavar="N"),
    )
    budget_bytes: Bytes | None = Field(
        None,
        description="exit 1 when peak reserved exceeds SIZE",
        json_schema_extra=_flag("--budget", RUN, metavar="SIZE", commands=("predict",)),
    )
    no_remedies: bool = Field(
        False,
        description="do not measure remedies for an OOM",
        json_schema_extra=_flag("--no-remedies", RUN, commands=("predict",)),
    )
    cache: bool = Field(
        True,
        description=(
            "replay a kept recording of the same step and keep new ones (prediction/"
            "recording_cache.py); false records afresh (--set run.cache=false)"
        ),
    )
    jobs: Annotated[int, Field(ge=1, le=4096)] | None = Field(
        None,
        description="processes to trace with (default: one per core)",
        json_schema_extra=_flag("--jobs", RUN, metavar="N"),
    )


class SearchSection(_Section):
    """``fit``: the batch search and its reverse questions."""

    margin_bytes: Bytes | None = Field(
        None,
        description="memory to leave free (default: 2 percent)",
        json_schema_extra=_flag("--margin", SEARCH, metavar="SIZE", commands=("fit",)),
    )
    max_batch: Count = Field(
        65536,
        description="the largest batch tried",
        json_schema_extra=_flag("--max-batch", SEARCH, metavar="N", commands=("fit",)),
    )
    smallest_gpu: bool = Field(
        False,
        description="name the smallest catalog GPU --batch fits on",
        json_schema_extra=_flag("--smallest-gpu", SEARCH, commands=("fit",)),
    )
    global_batch: Count | None = Field(
        None,
        description="with --smallest-gpu: try GPU counts",
        json_schema_extra=_flag("--global-batch", SEARCH, metavar="B", commands=("fit",)),
    )
    multiple_of: Count | None = Field(
        None,
        description="try only batches that are multiples of N",
        json_schema_extra=_flag("--multiple-of", SEARCH, metavar="N", commands=("fit",)),
    )
    power_of_two: bool = Field(
        False,
        description="try only powers of two (times --multiple-of)",
        json_schema_extra=_flag("--power-of-two", SEARCH, commands=("fit",)),
    )
    allow_retries: bool = Field(
        False,
        description="count batches that fit only with retries",
        # A search option, not a flag typed every day: --set search.allow_retries=true.
        json_schema_extra=_flag(None, SEARCH, commands=("fit",)),
    )
    max_gpus: Count = Field(
        64,
        description="with --global-batch: the largest GPU count tried",
        json_schema_extra=_flag("--max-gpus", SEARCH, metavar="N", commands=("fit",)),
    )


def field_flag(section: type[BaseModel], name: str) -> str | None:
    """The command-line flag that sets ``section``'s field ``name`` (``None``: config only)."""
    field = section.model_fields.get(name)
    extra = field.json_schema_extra if field is not None else None
    flag = extra.get("x-flag") if isinstance(extra, dict) else None
    return flag if isinstance(flag, str) else None

"""The Hugging Face Trainer's own settings (``TrainingArguments``, TRL's ``SFTConfig``) as step options.

``read_trainer_args`` reads a ``TrainingArguments`` (or ``SFTConfig``) object, a mapping or a JSON
file into ``TrainerSettings``: the keys that change what ``Trainer.train()`` allocates per step,
with the Trainer's own defaults for those not given (transformers/training_args.py:
``per_device_train_batch_size`` 8, ``gradient_accumulation_steps`` 1, ``max_grad_norm`` 1.0,
``optim`` ``adamw_torch_fused`` from torch 2.8 on). ``TrainerSettings.step_fields`` turns them
into ``StepOptions`` fields, the caller's explicit ones winning. What the Trainer's loop does with
them (transformers/trainer.py ``_inner_training_loop`` and ``training_step``): ``model.train()``,
``gradient_accumulation_steps`` micro-batches each divided by their number, clipping with
``max_grad_norm`` before ``optimizer.step()``, ``model.zero_grad()``, the outputs dropped when
``compute_loss`` returns and the running-loss scalar ``tr_loss``; with ``bf16`` / ``fp16`` the
model's forward as accelerate wraps it (autocast, ``convert_outputs_to_fp32``: the
``trainer_mixed_precision`` field); with ``torch_empty_cache_steps`` the cache emptied after
the loss in the steps it divides (``trainer_empty_cache_steps``); ``build_step`` records that.

Pure logic: no torch; transformers only to check a key's name against ``TrainingArguments``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from oomkit._files import refuse_special_file
from oomkit.errors import ConfigError

__all__ = [
    "OPTIM_NAMES",
    "TrainerSettings",
    "read_trainer_args",
    "trainer_step_options",
]

# transformers/training_args.py OptimizerNames -> (StepOptions.optimizer, optimizer_impl), as
# trainer_optimizer.py builds them: adamw_torch is torch.optim.AdamW with torch's default
# (foreach on CUDA), adamw_torch_fused adds fused=True; adamw_8bit is an alias of adamw_bnb_8bit
# (bnb.optim.AdamW with optim_bits=8); paged_adamw_8bit is bnb's paged AdamW 8-bit; adafactor is
# transformers' Adafactor with scale_parameter=False, relative_step=False; sgd is torch.optim.SGD.
OPTIM_NAMES: dict[str, tuple[str, str]] = {
    "adamw_torch": ("adamw", "foreach"),
    "adamw_torch_fused": ("adamw", "fused"),
    "adamw_8bit": ("adamw8bit", "foreach"),
    "adamw_bnb_8bit": ("adamw8bit", "foreach"),
    "paged_adamw_8bit": ("paged-adamw8bit", "foreach"),
    "adafactor": ("adafactor", "foreach"),
    "sgd": ("sgd", "foreach"),
}
# training_args.py: `default_optim = "adamw_torch_fused"` when torch >= 2.8, else "adamw_torch".
_DEFAULT_OPTIM = "adamw_torch_fused"
_DEFAULTS: dict[str, Any] = {
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "max_grad_norm": 1.0,
    "optim": _DEFAULT_OPTIM,
}
_CHECKPOINTING = ("activation_checkpointing", "gradient_checkpointing")
_CHECKPOINT_KWARGS = ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs")
_READ = frozenset(
    {
        *_DEFAULTS,
        *_CHECKPOINTING,
        *_CHECKPOINT_KWARGS,
        "bf16",
        "fp16",
        "optim_args",
        "max_seq_length",
        "max_length",
        "packing",
        "torch_empty_cache_steps",
    }
)
# Keys that change what a step allocates but that oomkit does not model, with what to do; each
# is refused when "on" (a truthy value; label_smoothing_factor above 0).
_REFUSED: dict[str, str] = {
    "deepspeed": "oomkit predicts one GPU without DeepSpeed; drop deepspeed",
    "fsdp": "for FSDP2 use a preset with --fsdp N; drop fsdp",
    "fsdp_config": "for FSDP2 use a preset with --fsdp N; drop fsdp_config",
    # accelerate/accelerator.py prepare_model: torch.compile(model, **dynamo_plugin.to_kwargs()).
    "torch_compile": "drop torch_compile and add --compile (the model's forward compiled, "
    "default Inductor mode, as accelerate's prepare_model compiles it)",
    "use_cpu": "oomkit predicts a GPU; drop use_cpu",
    "label_smoothing_factor": "the LabelSmoother's loss is not modelled; set it to 0",
    "use_liger_kernel": "Liger's fused kernels are not modelled; drop use_liger_kernel",
    "neftune_noise_alpha": "NEFTune's embedding noise is not modelled; drop it",
    "optim_target_modules": "GaLore / APOLLO optimizers are not modelled; drop it",
    "auto_find_batch_size": "use `oomkit fit` to find the batch that fits",
    "activation_offloading": "offloading activations to the CPU is not modelled; drop it",
    "padding_free": "padding-free batches (one flattened row) are not modelled; drop it",
    "model_init_kwargs": "the model is built from its config: set --precision instead",
}
# TRL SFTConfig keys beyond TrainingArguments' that do not change a step's memory.
_SFT_KEYS = frozenset(
    {
        "dataset_text_field",
        "dataset_kwargs",
        "dataset_num_proc",
        "dataset_batch_size",
        "completion_only_loss",
        "assistant_only_loss",
        "packing_strategy",
        "eos_token",
        "pad_token",
        "pad_to_multiple_of",
        "chat_template_path",
        "shuffle_dataset",
        "eval_packing",
    }
)
_CHECKPOINT_KWARG_KEYS = frozenset({"use_reentrant", "preserve_rng_state"})
MAX_FILE_BYTES = 1 << 20  # a TrainingArguments JSON is a few KiB


@dataclass(frozen=True)
class TrainerSettings:
    """What ``Trainer.train()`` is set to do each step, read from its arguments.

    Attributes:
        batch_size: ``per_device_train_batch_size``.
        grad_accum: ``gradient_accumulation_steps``.
        checkpointing: ``gradient_checkpointing`` (``activation_checkpointing`` in newer
            transformers).
        checkpoint_reentrant: its kwargs' ``use_reentrant`` (default ``False``, as
            ``_activation_checkpointing_enable`` sets it).
        mixed_precision: ``"bf16"`` / ``"fp16"`` (``bf16=True`` / ``fp16=True``: accelerate runs
            the forward under autocast), else ``None``.
        optim: the ``optim`` name.
        optimizer: its ``StepOptions.optimizer``.
        optimizer_impl: its ``StepOptions.optimizer_impl``.
        max_grad_norm: clipping norm; ``None`` when ``max_grad_norm`` is 0 (no clipping).
        seq_len: TRL's ``max_length`` (``max_seq_length`` in older TRL), else ``None``.
        empty_cache_steps: ``torch_empty_cache_steps`` (``None``: the cache is not emptied).
        ignored: given keys that do not change a step's memory, sorted.
        notes: where the mapping may differ from the Trainer, by key.
    """

    batch_size: int = 8
    grad_accum: int = 1
    checkpointing: bool = False
    checkpoint_reentrant: bool = False
    mixed_precision: str | None = None
    optim: str = _DEFAULT_OPTIM
    optimizer: str = "adamw"
    optimizer_impl: str = "fused"
    max_grad_norm: float | None = 1.0
    seq_len: int | None = None
    empty_cache_steps: int | None = None
    ignored: tuple[str, ...] = ()
    notes: tuple[tuple[str, str], ...] = ()

    def precision(self, model_precision: str | None) -> str | None:
        """``StepOptions.precision`` for a model whose own (weights') precision is
        ``model_precision`` (``None``: fp32).

        Without bf16/fp16 the Trainer trains in the model's own dtype (``None``: the model's).
        With them accelerate runs the forward under autocast: over fp32 weights that is
        ``bf16-mixed`` / ``fp16-mixed``; over weights already in that dtype, oomkit records the
        pure ``bf16`` / ``fp16`` step (matmuls are then in that dtype either way).
        """
        if self.mixed_precision is None:
            return model_precision
        if model_precision == self.mixed_precision:
            return model_precision
        return f"{self.mixed_precision}-mixed"

    def step_fields(
        self, explicit: Mapping[str, Any], model_precision: str | None
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """``StepOptions`` fields: these settings, overridden by the ``explicit`` ones.

        Args:
            explicit: fields the caller set (CLI flags, keyword arguments); they win.
            model_precision: the model's own precision (see :meth:`precision`).

        Returns:
            The fields, and assumptions to report (keys read, overrides, what was ignored).
        """
        mine: dict[str, Any] = {
            "batch_size": self.batch_size,
            "grad_accum": self.grad_accum,
            "checkpointing": self.checkpointing,
            "checkpoint_reentrant": self.checkpoint_reentrant,
            "optimizer": self.optimizer,
            "optimizer_impl": self.optimizer_impl,
            "max_grad_norm": self.max_grad_norm,
            "mode": "train",
            "trainer_mixed_precision": self._accelerator_precision(explicit.get("precision")),
        }
        if self.seq_len is not None:
            mine["seq_len"] = self.seq_len
        if self.empty_cache_steps is not None:
            mine["trainer_empty_cache_steps"] = self.empty_cache_steps
        precision = self.precision(model_precision)
        if precision is not None:
            mine["precision"] = precision
        notes = dict(self.notes)
        overridden = [
            f"{name}={explicit[name]!r} (not {value!r})"
            for name, value in mine.items()
            if name in explicit and explicit[name] != value
        ]
        if overridden:
            notes["trainer args overridden"] = "; ".join(overridden)
        if self.ignored:
            notes["trainer args ignored"] = (
                ", ".join(self.ignored) + " (they do not change a step's memory)"
            )
        notes["trainer args loop"] = (
            "recorded as Trainer.training_step runs it: model.train(), each micro-batch's "
            "outputs dropped when compute_loss returns (before backward), its loss / "
            "gradient_accumulation_steps added to the running-loss scalar tr_loss, "
            "clip_grad_norm_, optimizer.step(), zero_grad; not added: the micro-batches it "
            "prefetches (their token ids)"
        )
        accelerator = mine["trainer_mixed_precision"]
        if accelerator != "no":
            notes["trainer args outputs"] = (
                f"accelerate's mixed_precision={accelerator!r} forward (autocast, then "
                "convert_outputs_to_fp32: batch x seq x vocab x 4 bytes for a causal LM's "
                "logits, freed with the outputs) is recorded for a Hugging Face model (--hf), "
                "not added for a preset"
                if _accelerate_installed()
                else "accelerate is not installed: its fp32 copy of the model's outputs under "
                "autocast (convert_outputs_to_fp32: batch x seq x vocab x 4 bytes for a causal "
                "LM, freed with the outputs) is not added"
            )
        if accelerator != "no" and model_precision == accelerator and "precision" not in explicit:
            notes["trainer args precision"] = (
                f"{accelerator}=True over {model_precision} weights: recorded as pure "
                f"{model_precision} weights, gradients and optimizer states"
                + (
                    ", the forward under accelerate's autocast as the Trainer runs it"
                    if _accelerate_installed()
                    else " (autocast's fp32 ops are not added)"
                )
            )
        return {**mine, **explicit}, notes

    def _accelerator_precision(self, explicit_precision: Any) -> str:
        """The ``mixed_precision`` the Trainer's Accelerator gets (training_args.py
        ``__post_init__``: ``"fp16"`` for fp16, ``"bf16"`` for bf16, else ``"no"``), under an
        explicit ``precision``: ``X-mixed`` is X's; ``fp32`` is ``"no"``."""
        if isinstance(explicit_precision, str) and explicit_precision.endswith("-mixed"):
            return explicit_precision.removesuffix("-mixed")
        if explicit_precision == "fp32":
            return "no"
        return self.mixed_precision or "no"


def trainer_step_options(
    training_args: Any, *, model_precision: str | None = None, **explicit: Any
) -> tuple[Any, dict[str, str]]:
    """``StepOptions`` from the Trainer's arguments, with ``explicit`` fields winning.

    Args:
        training_args: a ``transformers.TrainingArguments`` (or TRL ``SFTConfig``), a mapping
            of its keys, or the path of a JSON file of them.
        model_precision: the model's own precision (for a Hugging Face model,
            ``config_precision(config)[0]``); ``None``: fp32 weights, or a config's dtype.
        explicit: ``StepOptions`` fields that override the arguments (``lora=``,
            ``quantize=``, ``seq_len=``...).

    Returns:
        The options and the assumptions to report.

    Raises:
        ConfigError: a bad file, an unknown key, a wrong type, an unknown ``optim``, or a
            setting that changes memory in a way oomkit does not model.
    """
    from oomkit.prediction.models.options import StepOptions

    settings = read_trainer_args(training_args)
    fields, notes = settings.step_fields(explicit, model_precision)
    try:
        return StepOptions(**fields), notes
    except ValueError as exc:
        raise ConfigError(f"the trainer arguments give options oomkit refuses: {exc}") from exc


def read_trainer_args(source: Any) -> TrainerSettings:
    """Read the Trainer's arguments (an object, a mapping, or a JSON file's path).

    Raises:
        ConfigError: see :func:`trainer_step_options`.
    """
    if isinstance(source, str | os.PathLike):
        return _read_given(_load_json(os.fspath(source)), explicit_only=True)
    if isinstance(source, Mapping):
        return _read_given(source, explicit_only=True)
    if dataclasses.is_dataclass(source) and not isinstance(source, type):
        values: dict[str, Any] = {}
        for f in dataclasses.fields(source):
            if not f.init or not hasattr(source, f.name):
                continue
            value = getattr(source, f.name)
            value = getattr(value, "value", value)  # OptimizerNames and other enums
            if f.name in _READ or value != _field_default(f):
                values[f.name] = value
        return _read_given(values, explicit_only=False)
    raise ConfigError(
        f"trainer arguments must be a transformers.TrainingArguments, a dict or a JSON file's "
        f"path; got a {type(source).__name__}"
    )


def _field_default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _load_json(path: str) -> Mapping[str, Any]:
    refuse_special_file(path, what="TrainingArguments JSON", error=ConfigError)
    try:
        size = os.path.getsize(path)
        if size > MAX_FILE_BYTES:
            raise ConfigError(
                f"{path} is {size} bytes; a TrainingArguments JSON is a few KiB (at most "
                f"{MAX_FILE_BYTES}). Pass the file written by training_args.to_json_string()"
            )
        with open(path, encoding="utf-8") as file:
            data = json.load(file)
    except OSError as exc:
        raise ConfigError(f"cannot read trainer arguments {path}: {exc.strerror or exc}") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(
            f"{path} is not valid JSON ({exc}); write it with "
            "`open('args.json', 'w').write(training_args.to_json_string())`"
        ) from exc
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path} must hold a JSON object of TrainingArguments keys, e.g. "
            '{"per_device_train_batch_size": 4}; got a JSON ' + type(data).__name__
        )
    return data


def _accelerate_installed() -> bool:
    """Whether accelerate (which the Trainer needs) can be imported, without importing it."""
    return importlib.util.find_spec("accelerate") is not None


def _known_keys() -> frozenset[str] | None:
    """TrainingArguments' field names, or ``None`` without transformers."""
    try:
        from transformers import TrainingArguments
    except ImportError:
        return None
    return frozenset(f.name for f in dataclasses.fields(TrainingArguments))


def _read_given(given: Mapping[str, Any], *, explicit_only: bool) -> TrainerSettings:
    known = _known_keys()
    ignored: list[str] = []
    for key, value in given.items():
        if not isinstance(key, str):
            raise ConfigError(f"trainer argument keys are names; got {key!r}")
        if key in _READ:
            continue
        if key in _REFUSED:
            if _on(value):
                raise ConfigError(
                    f"trainer argument {key}={_shown(value)} changes memory in a way oomkit "
                    f"does not model: {_REFUSED[key]}"
                )
            continue
        if explicit_only and key not in _SFT_KEYS and known is not None and key not in known:
            raise ConfigError(
                f"unknown trainer argument {key!r}: not a transformers.TrainingArguments (or "
                "TRL SFTConfig) key. Check its spelling, e.g. per_device_train_batch_size"
            )
        ignored.append(key)
    notes: dict[str, str] = {}
    batch = _positive_int(given, "per_device_train_batch_size")
    accumulate = _positive_int(given, "gradient_accumulation_steps")
    checkpointing = any(_bool(given, key, False) for key in _CHECKPOINTING)
    reentrant = _reentrant(given) if checkpointing else False
    bf16, fp16 = _bool(given, "bf16", False), _bool(given, "fp16", False)
    if bf16 and fp16:
        raise ConfigError("trainer arguments set both bf16 and fp16; choose one")
    optim = _optim(given)
    optimizer, impl = OPTIM_NAMES[optim]
    if optim == "sgd":
        notes["trainer args optim"] = _sgd_note(given.get("optim_args"))
    elif given.get("optim_args"):
        ignored.append("optim_args")
    if "optim" not in given:
        notes["trainer args optim"] = (
            f"optim not given: the Trainer's default {_DEFAULT_OPTIM} (torch >= 2.8)"
        )
    norm = _number(given, "max_grad_norm")
    seq_len = _seq_len(given, notes)
    empty_every = given.get("torch_empty_cache_steps")
    if empty_every is not None:
        if isinstance(empty_every, bool) or not isinstance(empty_every, int) or empty_every < 1:
            raise _type_error(
                "torch_empty_cache_steps", empty_every, "a positive integer or null", "4"
            )
        notes["trainer args torch_empty_cache_steps"] = (
            f"training_step empties the cache after the loss, before the backward, in the "
            f"optimizer steps {empty_every} divides (0, {empty_every}, ...); the recorded steps "
            "do so where one run's do"
        )
    return TrainerSettings(
        batch_size=batch,
        grad_accum=accumulate,
        checkpointing=checkpointing,
        checkpoint_reentrant=reentrant,
        mixed_precision="bf16" if bf16 else "fp16" if fp16 else None,
        optim=optim,
        optimizer=optimizer,
        optimizer_impl=impl,
        max_grad_norm=norm if norm > 0 else None,
        seq_len=seq_len,
        empty_cache_steps=empty_every,
        ignored=tuple(sorted(ignored)),
        notes=tuple(notes.items()),
    )


def _on(value: Any) -> bool:
    if isinstance(value, bool) or value is None:
        return bool(value)
    if isinstance(value, int | float):
        return value > 0
    return bool(value)


def _shown(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _type_error(key: str, value: Any, expected: str, example: str) -> ConfigError:
    return ConfigError(
        f"trainer argument {key} must be {expected}; got {_shown(value)}. Example: "
        f'"{key}": {example}'
    )


def _positive_int(given: Mapping[str, Any], key: str) -> int:
    value = given.get(key, _DEFAULTS[key])
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _type_error(key, value, "a positive integer", "4")
    return value


def _bool(given: Mapping[str, Any], key: str, default: bool) -> bool:
    value = given.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _type_error(key, value, "true or false", "true")
    return value


def _number(given: Mapping[str, Any], key: str) -> float:
    value = given.get(key, _DEFAULTS[key])
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise _type_error(key, value, "a number >= 0 (0: no clipping)", "1.0")
    return float(value)


def _reentrant(given: Mapping[str, Any]) -> bool:
    reentrant = False
    for key in _CHECKPOINT_KWARGS:
        kwargs = given.get(key)
        if isinstance(kwargs, str):  # TrainingArguments accepts a JSON string on the CLI
            try:
                kwargs = json.loads(kwargs)
            except json.JSONDecodeError:
                raise _type_error(key, kwargs, "an object", '{"use_reentrant": false}') from None
        if kwargs is None:
            continue
        if not isinstance(kwargs, Mapping):
            raise _type_error(key, kwargs, "an object", '{"use_reentrant": false}')
        unknown = sorted(set(kwargs) - _CHECKPOINT_KWARG_KEYS)
        if unknown:
            raise ConfigError(
                f"trainer argument {key} sets {', '.join(map(str, unknown))}, which oomkit does "
                "not model (every_n_layers, offload change what is kept); use_reentrant is read"
            )
        value = kwargs.get("use_reentrant", False)
        if not isinstance(value, bool):
            raise _type_error(f"{key}.use_reentrant", value, "true or false", "false")
        reentrant = reentrant or value
    return reentrant


def _optim(given: Mapping[str, Any]) -> str:
    optim = given.get("optim", _DEFAULT_OPTIM)
    if not isinstance(optim, str):
        raise _type_error("optim", optim, "an optimizer name", '"adamw_torch"')
    if optim not in OPTIM_NAMES:
        raise ConfigError(
            f"trainer argument optim={optim!r} is not modelled; oomkit models "
            f"{', '.join(OPTIM_NAMES)}"
        )
    return optim


def _sgd_note(optim_args: Any) -> str:
    # trainer_optimizer.py _get_sgd: torch.optim.SGD with the Trainer's lr, and momentum only
    # when optim_args names it; oomkit's sgd always keeps a momentum buffer.
    momentum = isinstance(optim_args, str) and "momentum=" in optim_args.replace(" ", "")
    if momentum:
        return "sgd with momentum (optim_args): one momentum buffer per trainable parameter"
    return (
        "sgd: the Trainer's SGD has no momentum unless optim_args sets it; oomkit's keeps a "
        "momentum buffer, so its optimizer state (4 bytes per fp32 trainable parameter) is "
        "an over-estimate"
    )


def _seq_len(given: Mapping[str, Any], notes: dict[str, str]) -> int | None:
    for key in ("max_length", "max_seq_length"):
        value = given.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise _type_error(key, value, "a positive integer", "2048")
        packing = _bool(given, "packing", False)
        notes["trainer args sequence"] = (
            f"{key} {value}: every sequence packed to it (packing)"
            if packing
            else f"{key} {value}: the longest a batch can be (padding to the batch's longest "
            "sequence makes shorter batches take less)"
        )
        return value
    return None

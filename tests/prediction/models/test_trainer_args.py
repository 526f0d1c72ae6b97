"""TrainingArguments (object, dict or JSON file) read into StepOptions, with clear refusals."""

from __future__ import annotations

import json

import pytest

from oomkit.errors import ConfigError
from oomkit.prediction.models import StepOptions
from oomkit.prediction.models.lora_options import LoraOptions
from oomkit.prediction.models.trainer_args import (
    MAX_FILE_BYTES,
    OPTIM_NAMES,
    TrainerSettings,
    read_trainer_args,
    trainer_step_options,
)


def test_absent_keys_take_the_trainers_own_defaults():
    """{} is TrainingArguments(): batch 8, no accumulation, clip 1.0, adamw_torch_fused."""
    settings = read_trainer_args({})
    assert (settings.batch_size, settings.grad_accum, settings.max_grad_norm) == (8, 1, 1.0)
    assert (settings.optim, settings.optimizer, settings.optimizer_impl) == (
        "adamw_torch_fused",
        "adamw",
        "fused",
    )
    assert not settings.checkpointing and settings.mixed_precision is None
    assert dict(settings.notes)["trainer args optim"].startswith("optim not given")


@pytest.mark.parametrize(
    ("optim", "optimizer", "impl"),
    [
        ("adamw_torch", "adamw", "foreach"),
        ("adamw_torch_fused", "adamw", "fused"),
        ("adamw_8bit", "adamw8bit", "foreach"),
        ("adamw_bnb_8bit", "adamw8bit", "foreach"),
        ("paged_adamw_8bit", "paged-adamw8bit", "foreach"),
        ("adafactor", "adafactor", "foreach"),
        ("sgd", "sgd", "foreach"),
    ],
)
def test_hf_optimizer_names_map_to_oomkits(optim, optimizer, impl):
    """Each modelled OptimizerNames value maps to the optimizer and kernels the Trainer builds."""
    settings = read_trainer_args({"optim": optim})
    assert (settings.optimizer, settings.optimizer_impl) == (optimizer, impl)
    options = StepOptions(optimizer=settings.optimizer, optimizer_impl=settings.optimizer_impl)  # type: ignore[arg-type]
    assert options.optimizer == optimizer


def test_an_unknown_optimizer_lists_the_supported_ones():
    """optim=lion_8bit: refused, naming every modelled optim."""
    with pytest.raises(ConfigError, match="optim='lion_8bit' is not modelled; oomkit models") as info:
        read_trainer_args({"optim": "lion_8bit"})
    assert all(name in str(info.value) for name in OPTIM_NAMES)


def test_sgd_says_its_momentum_buffer_is_an_over_estimate():
    """The Trainer's SGD has no momentum by default; the note says oomkit's keeps one."""
    assert "over-estimate" in dict(read_trainer_args({"optim": "sgd"}).notes)["trainer args optim"]
    with_momentum = read_trainer_args({"optim": "sgd", "optim_args": "momentum=0.9"})
    assert "momentum buffer per" in dict(with_momentum.notes)["trainer args optim"]


def test_a_training_arguments_object_is_read_field_by_field(tmp_path):
    """transformers.TrainingArguments: its values, and only non-default others as ignored."""
    transformers = pytest.importorskip("transformers")
    with pytest.warns(FutureWarning):  # gradient_checkpointing is a deprecated alias
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path),
            per_device_train_batch_size=2,
            gradient_accumulation_steps=4,
            gradient_checkpointing=True,
            optim="adafactor",
            max_grad_norm=0.5,
            learning_rate=3e-4,
            report_to="none",
        )
    settings = read_trainer_args(args)
    assert settings == TrainerSettings(
        batch_size=2,
        grad_accum=4,
        checkpointing=True,
        optim="adafactor",
        optimizer="adafactor",
        optimizer_impl="foreach",
        max_grad_norm=0.5,
        ignored=settings.ignored,
        notes=(),
    )
    assert {"learning_rate", "output_dir"} <= set(settings.ignored)
    assert "per_device_eval_batch_size" not in settings.ignored  # left at its default


def test_trainer_step_options_equal_the_same_options_given_by_hand():
    """TRL keys too: max_length -> seq_len; explicit fields (LoRA) are kept beside them."""
    options, notes = trainer_step_options(
        {
            "per_device_train_batch_size": 2,
            "gradient_accumulation_steps": 2,
            "gradient_checkpointing": True,
            "gradient_checkpointing_kwargs": {"use_reentrant": True},
            "optim": "adamw_8bit",
            "max_length": 512,
            "dataset_text_field": "text",
        },
        lora=LoraOptions(r=16),
    )
    assert options == StepOptions(
        batch_size=2,
        seq_len=512,
        grad_accum=2,
        checkpointing=True,
        checkpoint_reentrant=True,
        optimizer="adamw8bit",
        max_grad_norm=1.0,
        lora=LoraOptions(r=16),
        trainer_mixed_precision="no",
    )
    assert notes["trainer args ignored"].startswith("dataset_text_field")


def test_explicit_fields_override_the_file_and_the_conflict_is_reported():
    """batch_size=4 beats per_device_train_batch_size 8: the note names both values."""
    options, notes = trainer_step_options({"per_device_train_batch_size": 8}, batch_size=4)
    assert options.batch_size == 4
    assert notes["trainer args overridden"] == "batch_size=4 (not 8)"


@pytest.mark.parametrize(
    ("mixed", "model", "expected"),
    [
        (None, None, None),
        (None, "fp32", "fp32"),
        ("bf16", None, "bf16-mixed"),
        ("bf16", "fp32", "bf16-mixed"),
        ("bf16", "bf16", "bf16"),
        ("fp16", "fp32", "fp16-mixed"),
        ("fp16", "bf16", "fp16-mixed"),
    ],
)
def test_bf16_fp16_become_autocast_over_the_models_own_weights(mixed, model, expected):
    """bf16=True over fp32 weights is bf16-mixed; over bf16 weights, pure bf16."""
    assert TrainerSettings(mixed_precision=mixed).precision(model) == expected


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"per_device_train_batch_size": "4"}, "must be a positive integer; got '4'"),
        ({"gradient_accumulation_steps": 0}, "must be a positive integer; got 0"),
        ({"bf16": "yes"}, "bf16 must be true or false"),
        ({"max_grad_norm": -1}, "max_grad_norm must be a number >= 0"),
        ({"max_length": 0}, "max_length must be a positive integer"),
        ({"optim": 3}, "optim must be an optimizer name"),
        ({"bf16": True, "fp16": True}, "both bf16 and fp16"),
        ({"torch_empty_cache_steps": 0}, "torch_empty_cache_steps must be a positive integer"),
        ({"torch_empty_cache_steps": True}, "torch_empty_cache_steps must be a positive integer"),
        ({"per_device_batch_size": 4}, "unknown trainer argument 'per_device_batch_size'"),
        ({"deepspeed": "ds.json"}, "deepspeed='ds.json' changes memory"),
        ({"label_smoothing_factor": 0.1}, "LabelSmoother's loss is not modelled"),
        ({"fsdp": "full_shard"}, "use a preset with --fsdp N"),
        (
            {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"offload": True}},
            "sets offload, which oomkit does not model",
        ),
        (
            {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": "{bad"},
            "gradient_checkpointing_kwargs must be an object",
        ),
    ],
)
def test_bad_or_unmodelled_arguments_are_refused(given, message):
    """Wrong types, unknown keys and memory-changing settings oomkit does not model: refused."""
    with pytest.raises(ConfigError, match=message):
        read_trainer_args(given)


def test_settings_that_are_off_pass():
    """deepspeed null, label_smoothing_factor 0 and fsdp "" change nothing: accepted."""
    settings = read_trainer_args({"deepspeed": None, "label_smoothing_factor": 0.0, "fsdp": ""})
    assert settings.batch_size == 8 and settings.ignored == ()


def test_max_grad_norm_zero_turns_clipping_off():
    """max_grad_norm 0 is the Trainer's "no clipping": None in StepOptions."""
    options, _ = trainer_step_options({"max_grad_norm": 0})
    assert options.max_grad_norm is None


def test_json_files_are_read_and_bad_ones_refused(tmp_path):
    """A JSON object is read; invalid JSON, a list, a missing or huge file: ConfigError."""
    good = tmp_path / "args.json"
    good.write_text(json.dumps({"per_device_train_batch_size": 3, "fp16": True}))
    settings = read_trainer_args(good)
    assert (settings.batch_size, settings.mixed_precision) == (3, "fp16")
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        read_trainer_args(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must hold a JSON object"):
        read_trainer_args(bad)
    with pytest.raises(ConfigError, match="cannot read trainer arguments"):
        read_trainer_args(tmp_path / "missing.json")
    bad.write_text(" " * (MAX_FILE_BYTES + 1))
    with pytest.raises(ConfigError, match="a TrainingArguments JSON is a few KiB"):
        read_trainer_args(bad)


def test_other_objects_are_refused():
    """A list is neither TrainingArguments, a dict nor a path."""
    with pytest.raises(ConfigError, match="got a list"):
        read_trainer_args([1])

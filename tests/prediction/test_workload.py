"""WorkloadSpec: what a prediction recorded, saved as data and read back (old saves too)."""

from __future__ import annotations

import pytest

from oomkit.prediction.workload import (
    WorkloadSpec,
    workload_from_description,
    workload_from_json,
    workload_to_json,
)

PRESET = WorkloadSpec(
    "preset",
    "gpt2-124m",
    batch_size=8,
    seq_len=256,
    precision="fp32",
    optimizer="adamw",
    checkpointing="none",
    mode="train",
    new_tokens=128,
    steps=2,
)


def test_preset_saves_the_old_keys_and_the_new():
    """A preset keeps preset/options/steps/cudnn_version (older readers) and adds kind/name."""
    saved = workload_to_json(PRESET, cudnn_version=92000)
    assert saved == {
        "kind": "preset",
        "name": "gpt2-124m",
        "preset": "gpt2-124m",
        "options": {
            "batch_size": 8,
            "seq_len": 256,
            "image_size": None,
            "precision": "fp32",
            "optimizer": "adamw",
            "checkpointing": "none",
            "mode": "train",
            "new_tokens": 128,
        },
        "steps": 2,
        "cudnn_version": 92000,
    }
    assert workload_from_json({"workload": saved}) == PRESET


@pytest.mark.parametrize(
    ("saved", "read"),
    [(True, "full"), (False, "none"), ("selective-op", "selective-op"), (3, None)],
)
def test_checkpointing_reads_old_booleans_as_modes(saved, read):
    """Older saves kept checkpointing as a boolean: true is full, false none; junk is unknown."""
    data = workload_to_json(PRESET)
    data["options"]["checkpointing"] = saved
    assert workload_from_json({"workload": data}).checkpointing == read


def test_finetune_options_are_saved_only_when_set():
    """LoRA, quantization and a non-default optimizer_impl are saved; their defaults are not."""
    import dataclasses

    tuned = dataclasses.replace(
        PRESET, lora={"r": 16}, optimizer_impl="foreach", quantize="nf4", double_quant=False
    )
    options = workload_to_json(tuned)["options"]
    assert options["lora"] == {"r": 16} and options["quantize"] == "nf4"
    assert "optimizer_impl" not in options and "double_quant" not in options
    assert workload_from_json({"workload": workload_to_json(tuned)}) == dataclasses.replace(
        tuned, optimizer_impl=None, double_quant=None
    )


def test_a_function_has_no_preset_key_and_unknown_mode():
    """file.py:function saves the sizes it was called with; mode and optimizer stay unknown."""
    spec = WorkloadSpec("function", "train.py:build", batch_size=4, steps=3)
    saved = workload_to_json(spec)
    assert "preset" not in saved and "cudnn_version" not in saved
    back = workload_from_json({"workload": saved, "description": "train.py:build(batch_size=4)"})
    assert back == spec
    assert back.training is None and back.batch_size == 4


def test_an_old_preset_save_without_kind_is_a_preset():
    """{"preset", "options", "steps"} (oomkit before the record) reads as a preset."""
    old = {"preset": "bert-base", "options": {"batch_size": 16, "mode": "inference"}, "steps": 1}
    spec = workload_from_json({"workload": old})
    assert spec == WorkloadSpec("preset", "bert-base", batch_size=16, mode="inference", steps=1)
    assert spec.training is False


def test_no_workload_falls_back_to_the_description():
    """Documented fallback: batch N, the optimizer item and "train" are read from the text."""
    data = {"description": "GPT-2 124M, batch 8, seq 1024, fp32, adamw, train", "steps": 3}
    assert workload_from_json(data) == WorkloadSpec(
        "unknown",
        "GPT-2 124M, batch 8, seq 1024, fp32, adamw, train",
        batch_size=8,
        optimizer="adamw",
        mode="train",
        steps=3,
    )
    inference = workload_from_description("BERT base, batch 32, seq 128, fp32, inference")
    assert (inference.batch_size, inference.optimizer, inference.mode) == (32, None, None)
    assert workload_from_json({}) is None


def test_malformed_fields_are_unknown():
    """A saved field of the wrong type reads as not known, not as a crash."""
    data = {"workload": {"kind": "hf", "name": "gpt2", "options": {"batch_size": "8", "mode": 1}}}
    spec = workload_from_json(data)
    assert spec == WorkloadSpec("hf", "gpt2")


def test_the_torch_free_mirrors_match_step_options():
    """workload.py cannot import the presets (they need torch): its copies of their names match."""
    import dataclasses

    pytest.importorskip("torch")
    from oomkit.prediction import workload
    from oomkit.prediction.models.options import OPTIMIZERS, StepOptions

    assert tuple(workload._OPTION_TYPES) == tuple(f.name for f in dataclasses.fields(StepOptions))
    assert set(workload._OPTIMIZERS) == set(OPTIMIZERS)

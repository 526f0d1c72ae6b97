"""Defaults as people run (issue 35 item 1): bf16 weights for inference, generate and a LoRA
base; fp16 where the GPU has no bf16; one step for generate; each default named."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import oomkit  # noqa: E402
from oomkit.core.gpus import get_gpu  # noqa: E402
from oomkit.scenario import Scenario  # noqa: E402
from oomkit.scenario.options import default_steps, has_bf16, step_options  # noqa: E402


def _resolved(gpu: str, **sections):
    from oomkit.prediction.models import get_preset

    scenario = Scenario(**sections)
    preset = get_preset(scenario.model.preset)
    return step_options(scenario, None, preset, get_gpu(gpu))


@pytest.mark.parametrize(
    ("gpu", "sections", "precision", "words"),
    [
        ("l40s", {"step": {"mode": "generate"}}, "bf16",
         "bf16 weights, the default for generate; --precision fp32 to change"),
        ("h100", {"step": {"mode": "inference"}}, "bf16",
         "bf16 weights, the default for inference; --precision fp32 to change"),
        ("t4", {"step": {"mode": "inference"}}, "fp16",
         "fp16 weights, the default for inference (Tesla T4 has no bf16); --precision fp32 to "
         "change"),
        ("rtx4090", {"lora": {"rank": 16}}, "bf16",
         "bf16 base weights, the default for a LoRA base (as peft users load it); "
         "--precision bf16-mixed or fp32 to change"),
        ("rtx4090", {"lora": {"rank": 16}, "quantize": {"format": "nf4"}}, "bf16",
         "bf16 base weights, the default for a QLoRA base (as peft users load it); "
         "--precision bf16-mixed or fp32 to change"),
        ("t4", {}, "fp16-mixed",
         "fp16-mixed, the default on Tesla T4, which has no bf16 (bf16-mixed would run "
         "attention through math SDPA); --precision to change"),
    ],
)
def test_the_default_precision_and_its_words(gpu, sections, precision, words):
    """Each default is the one such a run uses, and it is named in words."""
    resolved = _resolved(gpu, model={"preset": "gpt2-124m"}, **sections)
    assert resolved.options.precision == precision
    assert resolved.defaults == {"precision": words.replace("Tesla T4", get_gpu(gpu).name)}


def test_a_given_precision_is_kept_and_no_default_is_named():
    """--precision given: no default is chosen, nothing named."""
    resolved = _resolved("t4", model={"preset": "gpt2-124m"}, step={"precision": "bf16-mixed"})
    assert (resolved.options.precision, dict(resolved.defaults)) == ("bf16-mixed", {})


def test_training_on_a_bf16_gpu_keeps_the_presets_default():
    """bf16-mixed for GPT-2 on an H100, fp32 for BERT: the preset's own, nothing named."""
    assert _resolved("h100", model={"preset": "gpt2-124m"}).options.precision == "bf16-mixed"
    assert _resolved("h100", model={"preset": "bert-base"}).options.precision == "fp32"
    assert not has_bf16(get_gpu("v100-16gb")) and has_bf16(get_gpu("a100-80gb"))


def test_generate_records_one_step_by_default():
    """generate: 1 step (each is a whole generation) unless --steps says otherwise."""
    generate = Scenario(model={"preset": "gpt2-124m"}, step={"mode": "generate"})
    assert default_steps(generate, "predict") == (
        1, "1 step, the default for generate (each is a whole generation); --steps N to change"
    )
    given = Scenario(model={"preset": "gpt2-124m"}, step={"mode": "generate"}, run={"steps": 2})
    assert default_steps(given, "predict") == (2, None)
    assert default_steps(Scenario(model={"preset": "gpt2-124m"}), "fit") == (2, None)


def test_the_prediction_names_its_defaults_and_equals_the_explicit_one():
    """gpt2-124m inference by default predicts, byte for byte, what --precision bf16 does, and
    its assumptions name the default."""
    default = oomkit.predict("gpt2-124m", mode="inference", batch=2, seq=64, gpu="h100")
    explicit = oomkit.predict(
        "gpt2-124m", mode="inference", batch=2, seq=64, gpu="h100", precision="bf16"
    )
    assert default.peak_reserved_bytes == explicit.peak_reserved_bytes
    assert default.peak_allocated_bytes == explicit.peak_allocated_bytes
    assert default.assumptions["default precision"] == (
        "bf16 weights, the default for inference; --precision fp32 to change"
    )
    assert "default precision" not in explicit.assumptions

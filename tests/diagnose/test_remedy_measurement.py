"""Tests for oomkit.diagnose.remedy_measurement: remedies measured by re-predicting, whether
each makes the step fit, ranked fitting first; and their rendering under predict's verdict."""

from __future__ import annotations

import dataclasses
import io

import pytest
from rich.console import Console

from oomkit.core.target import Target
from oomkit.diagnose.diagnosis import Remedy
from oomkit.diagnose.remedy_measurement import MeasuredRemedy, rank_measured

GiB = 2**30
MiB = 2**20


def _measured(title, saving, fits, peak, flag=None, **kwargs):
    return MeasuredRemedy(title, saving, "high", "", "why", estimate=False, fits=fits,
                          peak_reserved_bytes=peak, flag=flag, **kwargs)


def test_fitting_remedies_rank_first_then_by_saving_sharding_last_among_them():
    """Fitting first (same GPUs before --fsdp, then keep-training before LoRA, then saving);
    then what does not fit; estimates (fits unknown) after the measured that fit."""
    sgd = _measured("sgd", 50 * GiB, False, 110 * GiB, "--optimizer sgd")
    bf16 = _measured("pure bf16", 90 * GiB, True, 70 * GiB, "--precision bf16")
    fsdp = _measured("fsdp 2", 95 * GiB, True, 65 * GiB, "--fsdp 2")
    lora = _measured("lora", 110 * GiB, True, 50 * GiB, changes_training=True)
    estimate = Remedy("expandable segments", 3 * GiB, "medium", "", "why")
    ranked = rank_measured([sgd, estimate, lora, fsdp, bf16], deficit_bytes=89 * GiB)
    assert [r.title for r in ranked] == ["pure bf16", "lora", "fsdp 2", "sgd",
                                         "expandable segments"]


def test_render_remedies_prints_the_top_three_with_need_and_fit():
    """predict's remedy lines: title, the flag, what it needs, whether it fits, the saving."""
    pytest.importorskip("torch")
    from oomkit.interfaces.reports.prediction import remedy_line, render_remedies

    remedies = [
        _measured("pure bf16 weights, gradients and optimizer states", 91 * GiB, True,
                  int(76.5 * GiB), "--precision bf16"),
        _measured("LoRA adapters (peft, r8) instead of full fine-tuning", 110 * GiB, True,
                  57 * GiB),
        _measured("8-bit AdamW (bitsandbytes AdamW8bit)", 78 * GiB, False, 89 * GiB,
                  "--optimizer adamw8bit"),
        _measured("never shown", 1, False, 1),
    ]
    out = io.StringIO()
    render_remedies(remedies, Console(file=out, width=200, color_system=None))
    assert out.getvalue().splitlines() == [
        "What would make it fit (measured by re-predicting the step):",
        "  1. pure bf16 weights, gradients and optimizer states (--precision bf16) — needs "
        "76.50 GiB reserved, fits, saves 91.00 GiB",
        "  2. LoRA adapters (peft, r8) instead of full fine-tuning — needs 57.00 GiB reserved, "
        "fits, saves 110.00 GiB",
        "  3. 8-bit AdamW (bitsandbytes AdamW8bit) (--optimizer adamw8bit) — needs 89.00 GiB "
        "reserved, still does not fit, saves 78.00 GiB",
    ]
    estimate = Remedy("expandable segments", 3 * GiB, "medium", "", "why")
    assert remedy_line(4, estimate) == "4. expandable segments — saves ~3.00 GiB"


@pytest.fixture(scope="module")
def gpt2_on_3gib():
    """gpt2-124m, batch 8, seq 256, fp32, AdamW on a 3 GiB GPU (2 steps), with its workload."""
    pytest.importorskip("torch")
    from oomkit.prediction.models import StepOptions, build_preset_step
    from oomkit.prediction.predictor import predict
    from oomkit.prediction.workload import WorkloadSpec

    options = StepOptions(batch_size=8, seq_len=256, precision="fp32")
    built = build_preset_step("gpt2-124m", options)
    spec = WorkloadSpec("preset", "gpt2-124m", **dataclasses.asdict(built.options), steps=2)
    return predict(built.step_fn, target=Target.resolve("3GiB"), steps=2, track=built.track,
                   description=built.description, workload=spec)


def _required(**change):
    from oomkit.prediction.models import StepOptions, build_preset_step
    from oomkit.prediction.predictor import predict

    options = StepOptions(**({"batch_size": 8, "seq_len": 256, "precision": "fp32"} | change))
    built = build_preset_step("gpt2-124m", options)
    return predict(built.step_fn, target=Target.resolve("3GiB"), steps=2, track=built.track).required_bytes


def test_prediction_remedies_are_measured_and_fitting_first(gpt2_on_3gib):
    """For a Prediction that does not fit: the remedies that fit come first, each with the peak
    its re-prediction needs; pure bf16 (the largest saving that keeps the training) leads. On
    3 GiB four fit: pure bf16, batch 1 x 8 accumulation steps, then, as they train adapters,
    QLoRA and LoRA, each on a bf16 base (as peft users load one; the step's fp32 weights had
    left QLoRA 26 MiB short), whose flags give the step measured."""
    from oomkit.diagnose.remedy_measurement import prediction_remedies

    p = gpt2_on_3gib
    assert not p.fits
    every = prediction_remedies(p, top=None, fsdp_sizes=())
    top = every[:3]  # what top=3 returns (the ranked tuple's first three)
    assert len(top) == 3 and [r.fits for r in top] == [True, True, True]
    assert [r.flag for r in every[2:4]] == [
        "--lora 8 --quantize nf4 --precision bf16", "--lora 8 --precision bf16"
    ]
    from oomkit.prediction.models.lora_options import LoraOptions

    assert every[3].peak_reserved_bytes == _required(lora=LoraOptions(), precision="bf16")
    assert top[0].title == "pure bf16 weights, gradients and optimizer states"
    assert top[0].flag == "--precision bf16"
    assert top[0].peak_reserved_bytes == _required(precision="bf16")
    assert top[0].saving_bytes == p.required_bytes - top[0].peak_reserved_bytes
    assert "zero_grad(set_to_none=True)" not in {r.title for r in every}
    fitting = [r.fits for r in every]
    assert fitting == sorted(fitting, reverse=True)  # fits first


def test_a_prediction_that_fits_or_cannot_be_rebuilt_gets_none(gpt2_on_3gib):
    """No remedies for a step that fits, nor for one without a rebuildable workload."""
    from oomkit.diagnose.remedy_measurement import prediction_remedies

    assert prediction_remedies(dataclasses.replace(gpt2_on_3gib, workload=None)) == ()
    assert prediction_remedies(dataclasses.replace(gpt2_on_3gib, fits=True)) == ()


def test_zero_grad_is_offered_only_where_it_can_help():
    """zero_grad(set_to_none=True) is never listed for a preset or --hf step (they set it), at
    step 1 (no earlier step's gradients exist) or outside the forward pass."""
    from oomkit.diagnose._model_remedies import estimated_model_remedies
    from oomkit.diagnose.prediction_diagnosis import _zero_grad_applies
    from oomkit.prediction.workload import WorkloadSpec

    function = WorkloadSpec("function", "train.py:step")
    assert not _zero_grad_applies(WorkloadSpec("preset", "llama-8b"), {"step": 3, "phase": "forward"})
    assert not _zero_grad_applies(function, {"step": 1, "phase": "forward"})
    assert not _zero_grad_applies(function, {"step": 2, "phase": "optimizer"})
    assert _zero_grad_applies(function, {"step": 2, "phase": "forward"})
    categories = {"activation": GiB, "gradient": GiB, "parameter": GiB}
    offered = {r.title for r in estimated_model_remedies(categories)}
    assert "zero_grad(set_to_none=True)" in offered
    offered = {r.title for r in estimated_model_remedies(categories, zero_grad_applies=False)}
    assert "zero_grad(set_to_none=True)" not in offered


def test_explain_headline_and_json_carry_fits():
    """explain's headline says whether a measured remedy fits; --json has fits, the peak and
    the flag for every remedy (None where not measured)."""
    from oomkit.interfaces.reports.diagnosis import remedy_headline, remedy_to_json

    bf16 = _measured("pure bf16", 91 * GiB, True, 70 * GiB, "--precision bf16")
    assert remedy_headline(1, bf16) == "1. pure bf16 — saves 91.00 GiB, fits (high confidence)"
    sgd = _measured("sgd", 50 * GiB, False, 110 * GiB)
    assert remedy_headline(2, sgd) == "2. sgd — saves 50.00 GiB, still does not fit (high confidence)"
    saved = remedy_to_json(bf16)
    assert (saved["fits"], saved["peak_reserved_bytes"], saved["flag"]) == (
        True, 70 * GiB, "--precision bf16")
    plain = remedy_to_json(Remedy("expandable segments", 3 * GiB, "medium", "", "why"))
    assert (plain["fits"], plain["peak_reserved_bytes"], plain["flag"]) == (None, None, None)

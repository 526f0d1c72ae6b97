"""expected_state_bytes: arithmetic from the config equals what the tracer records."""

from __future__ import annotations

import pytest

from oomkit.prediction.models import StepOptions, build_preset_step, expected_state_bytes
from oomkit.prediction.tracing import trace_step

CASES = [
    ("gpt2-124m", StepOptions(batch_size=1, seq_len=8)),
    ("llama-1b", StepOptions(batch_size=1, seq_len=8, precision="bf16-mixed", optimizer="adam")),
    ("resnet50", StepOptions(batch_size=2, image_size=32, precision="bf16", optimizer="sgd")),
    ("bert-base", StepOptions(batch_size=1, seq_len=8, mode="inference")),
]


def test_gpt2_124m_fp32_adamw_exact_bytes():
    """GPT-2 124M fp32 AdamW: 4 bytes per parameter, as many for gradients, twice for states."""
    params = 124_439_808
    assert expected_state_bytes("gpt2-124m", StepOptions()) == {
        "parameter": 4 * params,
        "buffer": 0,
        "gradient": 4 * params,
        "optimizer_state": 8 * params,
    }


def test_pure_bf16_halves_everything_and_sgd_keeps_one_state():
    """Pure bf16 stores 2 bytes per parameter; SGD with momentum keeps one buffer each."""
    params = 8_030_261_248
    got = expected_state_bytes("llama-8b", StepOptions(precision="bf16", optimizer="sgd"))
    assert got == {
        "parameter": 2 * params,
        "buffer": 2 * 64,  # RoPE inv_freq, head_dim / 2, cast with the model
        "gradient": 2 * params,
        "optimizer_state": 2 * params,
    }


def test_resnet50_buffers():
    """ResNet-50's BatchNorms keep 53120 fp32 running statistics and 53 int64 counters."""
    assert expected_state_bytes("resnet50", StepOptions())["buffer"] == 53120 * 4 + 53 * 8


@pytest.mark.parametrize(("name", "options"), CASES, ids=[c[0] for c in CASES])
def test_expected_bytes_equal_traced_bytes(name, options):
    """Parameter, buffer, per-step gradient and optimizer-state bytes equal the recording's."""
    built = build_preset_step(name, options)
    recording = trace_step(built.step_fn, *built.track, steps=2)
    expected = expected_state_bytes(name, options)
    assert recording.allocated_bytes("parameter") == expected["parameter"]
    assert recording.allocated_bytes("buffer") == expected["buffer"]
    for step in (0, 1):  # gradients are freed by zero_grad(set_to_none=True) and made again
        assert recording.allocated_bytes("gradient", step=step) == expected["gradient"]
    # Optimizer states are created in the first step and kept.
    assert recording.allocated_bytes("optimizer_state", step=0) == expected["optimizer_state"]
    assert recording.allocated_bytes("optimizer_state", step=1) == 0

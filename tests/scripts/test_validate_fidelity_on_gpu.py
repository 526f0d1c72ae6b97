"""Tests for scripts/validate_fidelity_on_gpu.py: its pure comparisons and its meta-side probes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "validate_fidelity_on_gpu.py"
_spec = importlib.util.spec_from_file_location("validate_fidelity_on_gpu", _PATH)
fidelity = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("validate_fidelity_on_gpu", fidelity)
_spec.loader.exec_module(fidelity)

MiB = 2**20


def test_compare_peak_signed_error_and_exactness():
    """The error is (predicted - measured) / measured, and exact only for equal bytes."""
    r = fidelity.compare_peak("p", 200 * MiB, 210 * MiB)
    assert r["relative_error"] == pytest.approx(0.05)
    assert r["difference_bytes"] == 10 * MiB and r["exact"] is False
    assert fidelity.compare_peak("p", 5, 5)["exact"] is True
    assert fidelity.compare_peak("p", 0, 5)["relative_error"] is None


def test_compare_context_checks_the_assumed_range():
    """A measured context inside [low, high] is within range; the point's error is signed."""
    assumed = {"low_bytes": 256 * MiB, "expected_bytes": 500 * MiB, "high_bytes": 1300 * MiB}
    inside = fidelity.compare_context("context-lazy", 520 * MiB, assumed)
    assert inside["within_range"] is True and inside["error_of_point_bytes"] == -20 * MiB
    assert fidelity.compare_context("context-lazy", 1400 * MiB, assumed)["within_range"] is False


def test_output_path_names_the_gpu_and_torch():
    """validation/fidelity-<gpu>-torch<version>.json, without the local version."""
    path = fidelity.output_path(Path("/r"), "NVIDIA H100 80GB HBM3", "2.13.0+cu130")
    assert path == Path("/r/validation/fidelity-nvidia-h100-80gb-hbm3-torch2.13.0.json")


def _predicted(name: str) -> int:
    from oomkit import predict

    step, args = fidelity.PEAK_PROBES[name]("meta")
    return predict(step, *args, steps=1).peak_allocated_bytes


def test_meta_side_inference_mode_keeps_no_autocast_cache():
    """Under inference_mode one layer's bf16 cast is alive at most; under no_grad all 8 are.
    Both run addmm, so both hold the 32 MiB cuBLAS workspace (sm90; inference_mode's linear is
    decomposed as on CUDA)."""
    params = 8 * (4096 * 4096 + 4096) * 4
    cast = 4096 * 4096 * 2 + 4096 * 2  # a weight and bias in bf16
    workspace = 32 * 2**20
    inference = _predicted("inference-mode-autocast")
    no_grad = _predicted("no-grad-autocast")
    assert params + cast + workspace < inference < params + 2 * cast + workspace
    assert no_grad - inference >= 7 * cast


def test_meta_side_cross_entropy_backward_holds_four_logits():
    """Logits, saved log-probs, nll's zeroed grad and log_softmax's grad: 4 logits at the peak."""
    logits = 8192 * 50257 * 4
    target = 8192 * 8
    # + the loss and nll_loss's saved total_weight, one 512-byte block each.
    assert _predicted("cross-entropy-backward") == 4 * logits + target + 2 * 512


def _probe(name: str, torch_version: str = "2.13.0+cu130") -> tuple[int, list[list]]:
    """(peak allocated, recorded events) of probe ``name`` as the GPU run predicts it."""
    from oomkit import predict

    target = fidelity.probe_target(torch_version)
    step, args = fidelity.PEAK_PROBES[name]("meta")
    peak = predict(step, *args, steps=1, target=target).peak_allocated_bytes
    return peak, fidelity.predicted_events(name, target)


def test_meta_side_layer_norm_two_pass_holds_the_partial_sums_and_a_sums_staging():
    """100,000 x 768 fp32: input, output, the ones gradient and dX (307.2 MB each), mean and rstd
    (400,000 bytes, 400,384 as blocks), weight and bias, the first dgamma and dbeta, 1,365 rows
    of partial sums for each, the new dgamma and dgamma's .sum(0) staging and semaphores."""
    peak, events = _probe("layer-norm-two-pass")
    assert peak == (
        4 * 307_200_000 + 2 * 400_384 + 2 * 3072 + 2 * 3072 + 2 * 1365 * 768 * 4 + 3072
        + 8_650_752 + 512
    )
    assert events[5:10] == [
        ["alloc", 3072], ["alloc", 3072], ["alloc", 1365 * 768 * 4], ["alloc", 1365 * 768 * 4],
        ["alloc", 3072],
    ]
    # torch 2.7 reduces in one pass: no partial sums.
    assert ["alloc", 1365 * 768 * 4] not in _probe("layer-norm-two-pass", "2.7.1")[1]


def test_meta_side_rms_norm_is_the_fused_kernel_with_a_two_pass_weight_gradient():
    """100,000 x 1,024 bf16: input, output, ones and dX (204.8 MB each, each the whole of its
    196 MiB segment: 720,896 bytes more, too few to split off), an fp32 rstd, weight, first
    dgamma, 1,024 rows of partial sums, the new dgamma and its sum's staging."""
    peak, events = _probe("rms-norm-fused")
    assert peak == (
        4 * (204_800_000 + 720_896) + 400_384 + 3 * 2048 + 1024 * 1024 * 2 + 8_388_608 + 512
    )
    assert events[:3] == [["alloc", 204_800_000], ["alloc", 400_000], ["alloc", 204_800_000]]


def test_meta_side_transposed_layer_norm_copies_its_input_in_both_directions():
    """[197, 8, 768] seen transposed: the forward's input copy, then in backward the input's and
    the expanded gradient's copies beside dX: four 4,841,472-byte blocks at the peak with x."""
    peak, events = _probe("layer-norm-transposed")
    block = 4_841_472
    assert peak == 4 * block + 2 * 6656 + 2 * 3072 + 2 * 3072 + 2 * 512
    assert events[:5] == [
        ["alloc", block], ["alloc", block], ["alloc", 6304], ["alloc", 6304],
        ["free_completed", block],
    ]


def test_meta_side_clip_grad_norm_stages_one_partial_norm_per_chunk():
    """8 gradients of 4096 x 4096 fp32 (256 chunks of 65,536 each): 8 x 256 fp32 partials
    (8,192 bytes) before the 8 norms, freed after them; the weights and gradients are there
    before the step."""
    peak, events = _probe("clip-grad-norm")
    assert peak == 16 * 4096 * 4096 * 4 + 8192 + 8 * 512
    assert events[:10] == [["alloc", 8192]] + [["alloc", 4]] * 8 + [["free_completed", 8192]]


def test_meta_side_amax_over_the_tokens_stages_in_bf16():
    """The gradient (448 MiB), the [1, 14336] bf16 result, 69,730,304 bytes of staging and the
    semaphores (448 bytes, a 512-byte block)."""
    peak, events = _probe("amax-columns")
    assert peak == 16384 * 14336 * 2 + 14336 * 2 + 69_730_304 + 512
    assert events[:3] == [["alloc", 28_672], ["alloc", 69_730_304], ["alloc", 448]]


def test_a_peak_probes_record_carries_both_request_sequences(monkeypatch):
    """The child's glue, with the CUDA calls stood in for (the step runs on the CPU): the
    GPU's peak and requests as the allocator's snapshot gives them, the prediction for the
    installed torch, and its recorded requests beside them."""
    import torch

    probe = fidelity.PEAK_PROBES["clip-grad-norm"]
    monkeypatch.setitem(
        fidelity.PEAK_PROBES, "clip-grad-norm",
        lambda device: probe("cpu" if device == "cuda" else device),
    )
    trace = [
        {"action": "alloc", "size": 8192}, {"action": "free_requested", "size": 8192},
        {"action": "free_completed", "size": 8192},
    ]
    for name, value in {
        "synchronize": lambda: None,
        "reset_peak_memory_stats": lambda: None,
        "max_memory_allocated": lambda: 1_073_754_112,
    }.items():
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: {"device_traces": [trace]})
    record = fidelity._peak_child("clip-grad-norm")
    assert record["measured_peak_allocated_bytes"] == 1_073_754_112
    assert record["exact"] is (record["predicted_peak_allocated_bytes"] == 1_073_754_112)
    assert record["measured_events"] == [["alloc", 8192], ["free_completed", 8192]]
    target = fidelity.probe_target(torch.__version__)
    assert record["predicted_events"] == fidelity.predicted_events("clip-grad-norm", target)
    assert record["predicted_events"][0] == ["alloc", 8192]

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

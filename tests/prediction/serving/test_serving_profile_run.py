"""The profile run recorded on meta: forward, then the dummy sampler; the fallback estimate."""

from __future__ import annotations

import pytest
from _serving_configs import tiny_llama

from oomkit.core.gpus import get_gpu
from oomkit.prediction.serving import rank_model, read_serving_model, trace_profile_run
from oomkit.prediction.serving.profile_run import (
    SORT_WORKSPACE_BYTES_PER_ELEMENT,
    _estimated_profile,
)
from oomkit.prediction.tracing.emulations import cublas_workspace_bytes


@pytest.fixture
def built(write_config):
    return rank_model(read_serving_model(write_config(tiny_llama())), 1, "bfloat16")


def test_the_sampler_peak_is_the_sorted_logits_and_their_workspace(built):
    """With 512 rows of a 1024-token vocabulary the sampler dominates: at its sort, bf16 logits
    (2 B), the fp32 copy (4), the sorted values (4) and int64 indices (8) and the sort's
    workspace are live, plus the forward's 64 x 256 bf16 hidden states and the cuBLAS
    workspace."""
    peak = trace_profile_run(built, num_tokens=512, num_logit_rows=512, gpu=get_gpu("h100"))
    elements = 512 * 1024
    at_sort = elements * (2 + 4 + 4 + 8 + SORT_WORKSPACE_BYTES_PER_ELEMENT)
    workspace = cublas_workspace_bytes(get_gpu("h100"), {})
    assert peak.sampler_peak_bytes >= at_sort + workspace
    assert peak.peak_bytes == max(peak.forward_peak_bytes, peak.sampler_peak_bytes)
    assert peak.sampler_peak_bytes < at_sort + workspace + 512 * 256 * 2 + 4 * elements


def test_forward_only_has_no_sampler(built):
    """0 rows: a CUDA graph's forward, no sampler."""
    peak = trace_profile_run(built, num_tokens=64, num_logit_rows=0, gpu=get_gpu("h100"))
    assert peak.sampler_peak_bytes == 0 and peak.peak_bytes == peak.forward_peak_bytes > 0


def test_more_tokens_never_need_less(built):
    """The forward's peak grows with the dummy batch."""
    gpu = get_gpu("h100")
    small = trace_profile_run(built, num_tokens=64, num_logit_rows=0, gpu=gpu)
    large = trace_profile_run(built, num_tokens=256, num_logit_rows=0, gpu=gpu)
    assert large.forward_peak_bytes > small.forward_peak_bytes


def test_a_forward_that_cannot_run_on_meta_is_estimated(built):
    """The fallback: tokens x (4 x hidden + 3 x intermediate) bf16 for the forward, the sampler
    recorded alone, and a warning saying so."""
    head = built.get_output_embeddings()
    peak = _estimated_profile(built, head, 128, 16, get_gpu("h100"), True, reason="because")
    assert peak.forward_peak_bytes == 128 * (4 * 256 + 3 * 512) * 2
    assert peak.sampler_peak_bytes >= 16 * 1024 * (2 + 4 + 4 + 8 + SORT_WORKSPACE_BYTES_PER_ELEMENT)
    assert "could not be recorded on meta (because)" in peak.warnings[0]


def test_vllms_dense_forward_peaks_at_the_mlp(built):
    """vLLM's Llama layer peaks in the MLP: residual and hidden states (2 x 256), the fused
    gate-up output (2 x 512) and SiluAndMul's (512), bf16: 4096 bytes a token, exactly; plus
    the cuBLAS workspace its first matmul makes (no matmul runs before vLLM's profile run; the
    linears under inference_mode run addmm/mm as on CUDA)."""
    assert type(built).__name__ == "DecoderLM"
    workspace = cublas_workspace_bytes(get_gpu("h100"), {})
    for tokens in (64, 512):
        peak = trace_profile_run(built, num_tokens=tokens, num_logit_rows=0, gpu=get_gpu("h100"))
        assert peak.forward_peak_bytes == tokens * (2 * 256 + 2 * 512 + 512) * 2 + workspace

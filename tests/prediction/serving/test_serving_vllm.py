"""vLLM's start-up walked GPU-free, per modelled release, against vLLM's own logged figures.

The figures pinned come from vLLM's start-up logs on one H100 (79.18 GiB, utilization 0.9,
max-model-len 16000) collected in llm-d/llm-d-benchmark
config_explorer/empirical-vllm-memory-results.md (the 0.11+ accounting: weights, peak activation,
non-torch memory, "Available KV cache memory").
"""

from __future__ import annotations

import json

import pytest
from _serving_configs import LLAMA_31_8B, LLAMA_33_70B_FP8, QWEN3_06B, tiny_llama
from hypothesis import given, settings
from hypothesis import strategies as st

from oomkit.core.gpus import get_gpu
from oomkit.prediction.serving import (
    RankRecorder,
    ServingConfigError,
    VllmRequest,
    predict_vllm,
    rank_model,
    read_serving_model,
    vllm_rules,
)
from oomkit.prediction.serving.vllm import NON_TORCH_BYTES

GiB = 1 << 30
MiB = 1 << 20


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama8b")
    (folder / "config.json").write_text(json.dumps(LLAMA_31_8B))
    return str(folder)


@pytest.fixture(scope="module")
def llama_recorder(llama_dir):
    model = read_serving_model(llama_dir)
    return RankRecorder(rank_model(model, 1, "bfloat16"), get_gpu("h100"))


def _llama(llama_dir, recorder, **flags):
    return predict_vllm(VllmRequest(model=llama_dir, gpu="h100", max_model_len=16000, **flags),
                        recorder=recorder)


def test_llama_31_8b_on_h100_matches_vllms_log(llama_dir, llama_recorder):
    """Weights 14.99, peak activation 4.76, non-torch 0.13, available KV 51.38 GiB: within 5%."""
    s = _llama(llama_dir, llama_recorder)
    assert s.rules.version == "0.13"
    assert (s.max_num_batched_tokens, s.max_num_seqs) == (8192, 1024)  # >= 70 GiB, not A100
    assert s.requested_bytes == int(s.total_memory_bytes * 0.9)
    assert s.weights.total_bytes / GiB == pytest.approx(14.99, rel=0.01)
    assert s.profile.peak_bytes / GiB == pytest.approx(4.76, rel=0.05)
    assert s.profile.num_logit_rows == 1024 and s.profile.num_tokens == 8192
    assert s.available_kv_bytes / GiB == pytest.approx(51.38, rel=0.05)
    # 0.13: requested - (weights + torch peak increase + non-torch increase).
    assert s.available_kv_bytes == s.requested_bytes - (
        s.weights.total_bytes + s.profile.peak_bytes + NON_TORCH_BYTES[1])
    assert s.num_blocks == s.available_kv_bytes // (2 * MiB)
    assert s.kv_cache_tokens == s.num_blocks * 16
    assert s.max_concurrency == s.num_blocks / 1000
    assert s.verdict.starts and s.verdict.stage == "ready"


def test_the_highest_utilization_is_a_boundary(llama_dir, llama_recorder):
    """The highest utilization reported starts; 0.01 more does not (graphs or warm-up OOM)."""
    s = _llama(llama_dir, llama_recorder)
    high = s.max_gpu_memory_utilization
    assert high is not None and 0.9 < high < 1
    assert _llama(llama_dir, llama_recorder, gpu_memory_utilization=high).verdict.starts
    above = _llama(llama_dir, llama_recorder, gpu_memory_utilization=round(high + 0.01, 2))
    assert not above.verdict.starts
    assert above.verdict.stage in {"init", "cuda_graph_capture", "sampler_warmup"}
    assert above.verdict.knobs[0].flag == "--gpu-memory-utilization"
    assert above.verdict.knobs[0].direction == "lower"


def test_too_low_a_utilization_leaves_no_cache_blocks(llama_dir, llama_recorder):
    """At 0.2 the weights and the peak exceed what is requested: raise the utilization."""
    s = _llama(llama_dir, llama_recorder, gpu_memory_utilization=0.2)
    assert not s.verdict.starts and s.verdict.stage == "kv_cache"
    assert s.num_blocks == 0
    assert (s.verdict.knobs[0].flag, s.verdict.knobs[0].direction) == (
        "--gpu-memory-utilization", "raise")
    assert s.min_gpu_memory_utilization is not None
    low = _llama(llama_dir, llama_recorder, gpu_memory_utilization=s.min_gpu_memory_utilization)
    assert low.available_kv_bytes >= 1000 * 2 * MiB


def test_0_13_refuses_more_than_the_free_memory_at_start(llama_dir, llama_recorder):
    """0.13 init_device: total x utilization above the free memory stops start-up; 0.8 has no
    such check and budgets the CUDA context instead."""
    s = _llama(llama_dir, llama_recorder, gpu_memory_utilization=1.0)
    assert s.verdict.stage == "init" and "at most 0.99" in s.verdict.knobs[0].why
    old = _llama(llama_dir, llama_recorder, gpu_memory_utilization=1.0, vllm_version="0.8")
    assert old.verdict.stage != "init"


def test_0_8_budgets_the_context_and_the_runner_buffers(llama_dir, llama_recorder):
    """0.8: total x utilization - (allocated peak incl. weights and buffers + all non-torch)."""
    s = _llama(llama_dir, llama_recorder, vllm_version="0.8", max_num_seqs=1024)
    assert (s.max_num_batched_tokens, s.max_num_seqs) == (8192, 1024)
    assert s.available_kv_bytes == s.requested_bytes - (
        s.weights.total_bytes + s.persistent_buffer_bytes + s.profile.peak_bytes
        + s.cuda_context_bytes + NON_TORCH_BYTES[1])
    assert s.graphs.modes == 1 and s.graphs.sizes[-1] == 512


def test_kv_cache_memory_skips_the_budget(llama_dir, llama_recorder):
    """--kv-cache-memory 10GiB: exactly 5120 blocks of 2 MiB, whatever the utilization."""
    s = _llama(llama_dir, llama_recorder, kv_cache_memory_bytes=10 * GiB,
               gpu_memory_utilization=0.3)
    assert s.available_kv_bytes == 10 * GiB and s.num_blocks == 5120
    with pytest.raises(ServingConfigError, match="--kv-cache-memory does not exist in vLLM 0.8"):
        _llama(llama_dir, llama_recorder, kv_cache_memory_bytes=GiB, vllm_version="0.8")


def test_kv_cache_memory_for_a_concurrency(llama_dir, llama_recorder):
    """4 requests of 16000 tokens: 4 x 1000 blocks and the null block, 2 MiB each."""
    s = _llama(llama_dir, llama_recorder, concurrency=4)
    assert s.kv_cache_memory_for_concurrency_bytes == (4 * 1000 + 1) * 2 * MiB


def test_eager_captures_no_graphs(llama_dir, llama_recorder):
    """--enforce-eager: no CUDA graphs after the KV cache."""
    s = _llama(llama_dir, llama_recorder, enforce_eager=True)
    assert s.graphs.total_bytes == 0 and s.graphs.sizes == ()


def test_a_small_gpu_cannot_hold_the_full_context(llama_dir, llama_recorder):
    """A10G (22 GiB) with the 131072-token context: fails at max_model_len, naming the longest."""
    s = predict_vllm(VllmRequest(model=llama_dir, gpu="a10g"), recorder=llama_recorder)
    assert (s.max_num_batched_tokens, s.max_num_seqs) == (2048, 256)
    assert s.verdict.stage == "max_model_len"
    longest = s.layout.longest_request(s.available_kv_bytes, 131072, 2048)
    assert s.verdict.knobs[0].flag == "--max-model-len"
    assert s.verdict.knobs[0].why == f"at most {longest}"
    assert longest == s.num_blocks * 16


def test_capture_sizes_follow_each_release():
    """0.13: up to min(2 x seqs, 512, tokens), 8-steps below 256, 16-steps from 256; 0.8: 8-steps."""
    sizes = vllm_rules("0.13").capture_sizes(1024, 8192)
    assert sizes[:5] == (1, 2, 4, 8, 16) and sizes[-3:] == (480, 496, 512) and len(sizes) == 51
    assert vllm_rules("0.13").capture_sizes(8, 8192)[-1] == 16
    assert vllm_rules("0.8").capture_sizes(256, 8192)[-1] == 512
    with pytest.raises(ServingConfigError, match="--vllm-version '0.5' is not modelled"):
        vllm_rules("0.5")
    assert vllm_rules("v0.13.1").version == "0.13"


def test_qwen3_06b_matches_vllms_log(write_config):
    """Qwen3-0.6B: weights 1.12, peak activation 5.56 (a 151936-row vocabulary's sampler),
    available KV 64.45 GiB, within 5%."""
    s = predict_vllm(VllmRequest(model=write_config(QWEN3_06B), gpu="h100", max_model_len=16000))
    assert s.weights.total_bytes / GiB == pytest.approx(1.12, rel=0.05)
    assert s.profile.peak_bytes / GiB == pytest.approx(5.56, rel=0.05)
    assert s.available_kv_bytes / GiB == pytest.approx(64.45, rel=0.05)


def test_llama_33_70b_fp8_needs_two_gpus(write_config):
    """tp=1: 'No available memory for the cache blocks' as vLLM logged; tp=2 starts with ~32 GiB."""
    folder = write_config(LLAMA_33_70B_FP8)
    one = predict_vllm(VllmRequest(model=folder, gpu="h100", max_model_len=16000))
    assert not one.verdict.starts and one.verdict.stage == "kv_cache"
    two = predict_vllm(VllmRequest(model=folder, gpu="h100", max_model_len=16000,
                                   tensor_parallel_size=2))
    assert two.weights.total_bytes / GiB == pytest.approx(33.88, rel=0.05)
    assert two.available_kv_bytes / GiB == pytest.approx(32.0, rel=0.05)
    assert two.verdict.starts


def test_bad_flags_are_refused(write_config):
    """Out-of-range flags and impossible combinations name the flag."""
    with pytest.raises(ServingConfigError, match=r"--gpu-memory-utilization must be in \(0, 1\]"):
        VllmRequest(model="x", gpu_memory_utilization=1.5)
    with pytest.raises(ServingConfigError, match="--max-num-seqs must be at least 1"):
        VllmRequest(model="x", max_num_seqs=0)
    folder = write_config(tiny_llama())
    with pytest.raises(ServingConfigError, match="above the model's 4096 positions"):
        predict_vllm(VllmRequest(model=folder, max_model_len=8192))
    with pytest.raises(ServingConfigError, match=r"must be at least --max-num-seqs \(256\)"):
        predict_vllm(VllmRequest(model=folder, max_num_batched_tokens=128, max_num_seqs=256))
    with pytest.raises(ServingConfigError, match="Bfloat16 is only supported"):
        predict_vllm(VllmRequest(model=folder, gpu="t4"))


@settings(max_examples=30, deadline=None)
@given(block_size=st.integers(1, 512), version=st.sampled_from(["0.8", "0.13"]))
def test_block_size_is_one_of_the_releases_choices(block_size, version):
    """vLLM's --block-size takes its BlockSize literal's values (argparse choices): 1, 8...128
    in 0.8.5, 256 too in 0.13.0 (read from their sdists); anything else is refused by name
    before the model is read, as vLLM exits at argument parsing."""
    choices = {"0.8": (1, 8, 16, 32, 64, 128), "0.13": (1, 8, 16, 32, 64, 128, 256)}[version]
    request = VllmRequest(model="no-such-model-dir", block_size=block_size, vllm_version=version)
    with pytest.raises(ServingConfigError) as raised:
        predict_vllm(request)
    if block_size in choices:  # past the flag check: the missing model is what stops it
        assert "no config.json at 'no-such-model-dir'" in str(raised.value)
    else:
        assert str(raised.value) == (
            f"--block-size {block_size}: vLLM {version} takes one of "
            f"{', '.join(map(str, choices))} (its BlockSize choices); use one of them"
        )


def test_an_mla_model_starts_with_latent_pages(write_config):
    """A DeepSeek-V3-shaped model (MLA, MoE) is built and recorded on meta; its KV page is one
    latent of (64 + 16) x 2 bytes a token a layer, not split by tp."""
    from _serving_configs import TINY_DEEPSEEK_V3

    s = predict_vllm(VllmRequest(model=write_config(TINY_DEEPSEEK_V3), max_model_len=4096))
    assert s.layout.page_size_bytes == 16 * (64 + 16) * 2
    assert s.kv_bytes_per_token == 3 * (64 + 16) * 2
    assert s.profile.forward_peak_bytes > 0 and s.verdict.starts


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    (folder / "config.json").write_text(json.dumps(tiny_llama()))
    return str(folder)


@pytest.fixture(scope="module")
def tiny_recorder(tiny_dir):
    return RankRecorder(rank_model(read_serving_model(tiny_dir), 1, "bfloat16"), get_gpu("l4"))


def test_the_cache_for_a_concurrency_says_whether_it_fits(tiny_dir, tiny_recorder):
    """1 request fits on an L4; 10,000 requests of 4096 tokens (80 GiB) do not."""
    one = predict_vllm(VllmRequest(model=tiny_dir, gpu="l4"), recorder=tiny_recorder)
    assert one.concurrency == 1 and one.kv_cache_memory_for_concurrency_fits
    many = predict_vllm(VllmRequest(model=tiny_dir, gpu="l4", concurrency=10_000),
                        recorder=tiny_recorder)
    assert not many.kv_cache_memory_for_concurrency_fits


@settings(max_examples=25, deadline=None)
@given(util=st.integers(1, 100))
def test_utilization_invariants(tiny_dir, tiny_recorder, util):
    """Blocks never exceed what is available; a utilization that starts is at most the highest
    reported; more utilization never means less KV cache."""
    u = util / 100
    s = predict_vllm(VllmRequest(model=tiny_dir, gpu="l4", gpu_memory_utilization=u),
                     recorder=tiny_recorder)
    assert s.kv_cache_bytes <= max(s.available_kv_bytes, 0)
    if s.verdict.starts:
        assert s.max_gpu_memory_utilization is not None and u <= s.max_gpu_memory_utilization
    if util < 100:
        more = predict_vllm(VllmRequest(model=tiny_dir, gpu="l4",
                                        gpu_memory_utilization=(util + 1) / 100),
                            recorder=tiny_recorder)
        assert more.available_kv_bytes >= s.available_kv_bytes


def test_a_llama_preset_is_served_as_its_published_config(llama_dir, llama_recorder):
    """`oomkit serve vllm llama-8b`: the preset is Llama-3.1-8B's config.json (its shape, dtype
    and context), so weights, activation peak, KV cache and verdict are the file's to the byte;
    a preset vLLM does not serve as Llama is a ServingConfigError naming the ones it does."""
    preset = read_serving_model("llama-8b")
    published = read_serving_model(llama_dir)
    assert (preset.num_layers, preset.num_kv_heads, preset.head_dim, preset.vocab_size) == (
        published.num_layers, published.num_kv_heads, published.head_dim, published.vocab_size
    )
    assert (preset.max_position_embeddings, preset.config_dtype) == (131072, "bfloat16")
    # Its own model and profile run, recorded from the preset's config (not the file's).
    own = RankRecorder(rank_model(preset, 1, "bfloat16"), get_gpu("h100"))
    by_name = predict_vllm(VllmRequest(model="llama-8b", gpu="h100", max_model_len=16000),
                           recorder=own)
    by_file = _llama(llama_dir, llama_recorder)
    assert by_name.weights.total_bytes == by_file.weights.total_bytes
    assert by_name.profile.peak_bytes == by_file.profile.peak_bytes
    assert (by_name.available_kv_bytes, by_name.num_blocks) == (
        by_file.available_kv_bytes, by_file.num_blocks
    )
    assert by_name.verdict.stage == by_file.verdict.stage
    with pytest.raises(ServingConfigError, match=r"'gpt2-124m' \(GPT-2 124M\) is not a model "
                       r"oomkit serve takes by name: it takes the Llama presets \(llama-1b,"):
        read_serving_model("gpt2-124m")

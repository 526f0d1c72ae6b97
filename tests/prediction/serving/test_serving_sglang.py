"""SGLang's start-up: its default mem_fraction_static, its KV pool, and the OOMs on either side."""

from __future__ import annotations

import json

import pytest
from _serving_configs import DEEPSEEK_V3_ATTENTION, LLAMA_31_8B

from oomkit.core.gpus import get_gpu
from oomkit.prediction.serving import (
    RankRecorder,
    ServingConfigError,
    SglangRequest,
    default_sglang_settings,
    predict_sglang,
    rank_model,
    read_serving_model,
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
def recorder(llama_dir):
    return RankRecorder(rank_model(read_serving_model(llama_dir), 1, "bfloat16"), get_gpu("h100"))


def test_0_5_default_fraction_on_an_h100():
    """server_args.py _handle_gpu_memory_settings: H100 (< 90 GiB): chunk 8192, graph batch 256;
    reserved max(512 + 8192 x 1.5 + 256 x 2 + 1/8 x 1024, 10 GiB) = 13440 MB."""
    gpu = get_gpu("h100")
    gpu_mem = gpu.total_memory_bytes / MiB
    fraction, chunk, bs = default_sglang_settings("0.5", gpu, 1, None, None)
    assert (chunk, bs) == (8192, 256)
    assert fraction == round((gpu_mem - 13440) / gpu_mem, 3) == 0.834


def test_0_5_default_fraction_on_an_a100_40gb_and_tp8():
    """A 40 GB device (< 60 GiB): chunk 4096, graph batch 32, no 10 GiB floor; tp 8: batch 160
    and one more GiB reserved."""
    gpu = get_gpu("a100-40gb")
    gpu_mem = gpu.total_memory_bytes / MiB
    fraction, chunk, bs = default_sglang_settings("0.5", gpu, 1, None, None)
    assert (chunk, bs) == (4096, 32)
    assert fraction == round((gpu_mem - (512 + 4096 * 1.5 + 32 * 2 + 128)) / gpu_mem, 3)
    fraction8, _, bs8 = default_sglang_settings("0.5", gpu, 8, None, None)
    assert bs8 == 160
    assert fraction8 == round((gpu_mem - (512 + 4096 * 1.5 + 160 * 2 + 1024)) / gpu_mem, 3)


def test_0_4_default_fraction_by_tp():
    """0.4 ServerArgs.__post_init__: 0.88, 0.87 (tp 2), 0.85 (4), 0.81 (8), 0.79 (16)."""
    gpu = get_gpu("h100")
    assert [default_sglang_settings("0.4", gpu, tp, None, None)[0] for tp in (1, 2, 4, 8, 16)] \
        == [0.88, 0.87, 0.85, 0.81, 0.79]
    assert default_sglang_settings("0.4", gpu, 1, None, None)[1:] == (8192, 160)
    assert default_sglang_settings("0.4", get_gpu("a10g"), 1, None, None)[1:] == (2048, 8)


def test_kv_pool_is_the_fraction_less_the_weights(llama_dir, recorder):
    """rest = free after load - free before load x (1 - f); tokens = rest // cell size."""
    s = predict_sglang(SglangRequest(model=llama_dir, gpu="h100"), recorder=recorder)
    before = s.total_memory_bytes - s.cuda_context_bytes
    after = before - s.weights.total_bytes - NON_TORCH_BYTES[1]
    rest = after - before * (1 - 0.834)
    assert s.cell_size_bytes == 131072
    assert s.max_total_num_tokens == int(rest // 131072)
    assert s.kv_pool_bytes == (s.max_total_num_tokens + 1) * 131072
    # min(max(int(tokens / 131072 x 512), 2048), 4096) requests of 131072 + 4 int32 slots.
    assert s.max_running_requests == 2048
    assert s.req_to_token_bytes == 2049 * 131076 * 4
    assert s.verdict.starts


def test_too_low_a_fraction_fails_at_init_raise_it(llama_dir, recorder):
    """Below the weights' share there is no pool: 'Not enough memory', raise the fraction."""
    s = predict_sglang(SglangRequest(model=llama_dir, mem_fraction_static=0.15), recorder=recorder)
    assert not s.verdict.starts and s.verdict.stage == "kv_cache"
    assert s.max_total_num_tokens == 0
    knob = s.verdict.knobs[0]
    assert (knob.flag, knob.direction) == ("--mem-fraction-static", "raise")
    assert 0.15 < s.min_mem_fraction_static < 0.2
    ok = predict_sglang(SglangRequest(model=llama_dir, mem_fraction_static=round(
        s.min_mem_fraction_static + 0.001, 3)), recorder=recorder)
    assert ok.max_total_num_tokens > 0


def test_too_high_a_fraction_fails_at_run_time_lower_it(llama_dir, recorder):
    """At 0.97 the rest cannot hold the request table, graphs and a prefill: lower it."""
    s = predict_sglang(SglangRequest(model=llama_dir, mem_fraction_static=0.97), recorder=recorder)
    assert not s.verdict.starts and s.verdict.stage == "runtime"
    knob = s.verdict.knobs[0]
    assert (knob.flag, knob.direction) == ("--mem-fraction-static", "lower")
    assert s.max_mem_fraction_static < 0.97
    at_max = predict_sglang(SglangRequest(model=llama_dir, mem_fraction_static=round(
        s.max_mem_fraction_static - 0.001, 3)), recorder=recorder)
    assert at_max.verdict.starts


def test_mla_cell_size(write_config):
    """DeepSeek-V3's pool cell: (512 + 64) x 61 layers x 2 bytes."""
    model = read_serving_model(write_config(DEEPSEEK_V3_ATTENTION))
    assert model.kv_bytes_per_token(2, tp=8) == 70272


def test_bad_sglang_flags_are_refused():
    """A fraction outside (0, 1) or an unmodelled release names the flag."""
    with pytest.raises(ServingConfigError, match=r"--mem-fraction-static must be in \(0, 1\)"):
        SglangRequest(model="x", mem_fraction_static=1.2)
    with pytest.raises(ServingConfigError, match="--sglang-version '0.3' is not modelled"):
        SglangRequest(model="x", sglang_version="0.3")

"""Weights a rank loads, priced from the config built on meta, against vLLM's logged figures."""

from __future__ import annotations

import pytest
from _serving_configs import LLAMA_31_8B, LLAMA_33_70B_FP8, QWEN3_06B, tiny_llama

from oomkit.prediction.serving import (
    ServingConfigError,
    linear_bits,
    rank_model,
    read_serving_model,
    weight_bytes,
)

GiB = 1 << 30
# Llama-3.1-8B: 8,030,261,248 parameters; the two 128256 x 4096 embeddings, 65 norms of 4096.
LINEAR_PARAMS = 8_030_261_248 - 2 * 128256 * 4096 - 65 * 4096
ROPE_CACHE_BYTES = 131072 * 128 * 2  # max_position x rotary_dim, bf16


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    (folder / "config.json").write_text(__import__("json").dumps(LLAMA_31_8B))
    model = read_serving_model(str(folder))
    return model, rank_model(model, 1, "bfloat16")


def test_llama_31_8b_bf16_is_vllms_14_99_gib(llama):
    """Every parameter in bf16 plus the RoPE cache: 16,094,076,928 bytes, the 14.99 GiB vLLM logs
    as "Model loading took 14.99 GiB" (llm-d-benchmark empirical-vllm-memory-results.md)."""
    model, built = llama
    weights = weight_bytes(model, built, tp=1, dtype="bfloat16", quantization=None)
    assert weights.total_bytes == 8_030_261_248 * 2 + ROPE_CACHE_BYTES == 16_094_076_928
    assert round(weights.total_bytes / GiB, 2) == 14.99
    assert weights.rope_cache_bytes == ROPE_CACHE_BYTES


def test_fp8_stores_the_linears_in_one_byte_and_keeps_embeddings(llama):
    """--quantization fp8: linear weights 1 byte; embeddings, LM head and norms stay bf16."""
    model, built = llama
    weights = weight_bytes(model, built, tp=1, dtype="bfloat16", quantization="fp8")
    assert weights.linear_bytes == LINEAR_PARAMS
    assert weights.embedding_bytes == 2 * 128256 * 4096 * 2
    assert weights.total_bytes == LINEAR_PARAMS + 2 * 128256 * 4096 * 2 + 65 * 4096 * 2 \
        + ROPE_CACHE_BYTES
    assert weights.quantization == "fp8" and weights.bits_per_linear_weight == 8.0


def test_tp2_halves_linears_and_vocab_rows(write_config):
    """tp=2: the linears and the (64-padded) vocabulary rows split in two; norms replicate."""
    model = read_serving_model(write_config(tiny_llama(vocab_size=1000)))
    one = weight_bytes(model, rank_model(model, 1, "bfloat16"), tp=1, dtype="bfloat16",
                       quantization=None)
    two = weight_bytes(model, rank_model(model, 2, "bfloat16"), tp=2, dtype="bfloat16",
                       quantization=None)
    assert two.linear_bytes * 2 == one.linear_bytes
    # 1000 rows pad to 1024 (DEFAULT_VOCAB_PADDING_SIZE 64), 512 a rank, two embeddings.
    assert one.embedding_bytes == 2 * 1024 * 256 * 2
    assert two.embedding_bytes == 2 * 512 * 256 * 2
    assert two.other_bytes == one.other_bytes


def test_qwen3_06b_matches_vllms_1_12_gib(write_config):
    """Qwen3-0.6B (tied embeddings): vLLM logged "Model loading took 1.12 GiB"."""
    model = read_serving_model(write_config(QWEN3_06B))
    weights = weight_bytes(model, rank_model(model, 1, "bfloat16"), tp=1, dtype="bfloat16",
                           quantization=None)
    assert weights.total_bytes / GiB == pytest.approx(1.12, rel=0.05)


def test_llama_33_70b_fp8_checkpoint_on_two_ranks(write_config):
    """The checkpoint's own compressed-tensors config (8-bit, LM head ignored) at tp=2: vLLM
    logged 33.88 GiB a rank (llm-d-benchmark empirical-vllm-memory-results.md)."""
    model = read_serving_model(write_config(LLAMA_33_70B_FP8))
    assert linear_bits(model, None, "bfloat16") == ("compressed-tensors", 8)
    weights = weight_bytes(model, rank_model(model, 2, "bfloat16"), tp=2, dtype="bfloat16",
                           quantization=None)
    assert weights.total_bytes / GiB == pytest.approx(33.88, rel=0.05)


def test_four_bit_formats_count_their_scales(write_config):
    """GPTQ 4-bit, group 128: 4 + (16 + 4) / 128 bits; MXFP4: 4 + 8 / 32."""
    gptq = read_serving_model(write_config(tiny_llama(quantization_config={
        "quant_method": "gptq", "bits": 4, "group_size": 128}), "gptq"))
    assert linear_bits(gptq, None, "bfloat16") == ("gptq", 4 + 20 / 128)
    mx = read_serving_model(write_config(tiny_llama(quantization_config={
        "quant_method": "mxfp4"}), "mx"))
    assert linear_bits(mx, None, "bfloat16") == ("mxfp4", 4.25)


def test_unmodelled_quantization_and_bad_tp_are_refused(write_config):
    """An unknown method and a tp that does not divide the heads are refused, naming the fix."""
    model = read_serving_model(write_config(tiny_llama()))
    with pytest.raises(ServingConfigError, match="quantization 'hqq' is not modelled"):
        linear_bits(model, "hqq", "bfloat16")
    with pytest.raises(ServingConfigError, match="does not divide the 4 attention heads"):
        rank_model(model, 3, "bfloat16")


@pytest.mark.parametrize("overrides", [
    {},
    {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "tie_word_embeddings": True},
    {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]},
])
def test_vllms_dense_decoder_holds_the_same_weights_as_transformers(write_config, monkeypatch,
                                                                     overrides):
    """Llama/Qwen2/Qwen3 built as vLLM builds them (fused QKV and gate-up) hold, per rank, the
    bytes transformers' modules hold (tp 1 and 2)."""
    from oomkit.prediction.serving import weights as weights_module

    model = read_serving_model(write_config(tiny_llama(**overrides)))
    for tp in (1, 2):
        dense = rank_model(model, tp, "bfloat16")
        assert type(dense).__name__ == "DecoderLM"
        with monkeypatch.context() as patch:
            patch.setattr(weights_module, "dense_decoder", lambda *args: None)
            hf = rank_model(model, tp, "bfloat16")
        assert type(hf).__name__ != "DecoderLM"
        assert weight_bytes(model, dense, tp=tp, dtype="bfloat16", quantization=None) == \
            weight_bytes(model, hf, tp=tp, dtype="bfloat16", quantization=None)

"""KV bytes per token and the config fields the engines read, on real models' configs."""

from __future__ import annotations

import json

import pytest
from _serving_configs import DEEPSEEK_V3_ATTENTION, LLAMA_31_8B, MISTRAL_7B_V01, tiny_llama
from hypothesis import given, settings
from hypothesis import strategies as st

from oomkit.prediction.serving import (
    ServingConfigError,
    dtype_bytes,
    kv_dtype_bytes,
    read_serving_model,
)


def test_llama_31_8b_kv_bytes_per_token(write_config):
    """Llama-3.1-8B in bf16: 2 (K,V) x 32 layers x 8 KV heads x 128 x 2 bytes = 131072 bytes."""
    model = read_serving_model(write_config(LLAMA_31_8B))
    assert model.kv_bytes_per_token(kv_dtype_bytes("auto", "bfloat16")) == 2 * 32 * 8 * 128 * 2
    # fp8 KV cache: one byte an element, half the bytes.
    assert model.kv_bytes_per_token(kv_dtype_bytes("fp8", "bfloat16")) == 65536
    assert model.max_position_embeddings == 131072
    assert model.config_dtype == "bfloat16"
    assert not model.is_mla and model.sliding_window is None


def test_tp_splits_kv_heads_and_replicates_past_their_count(write_config):
    """tp=2 holds 4 of the 8 KV heads a rank; tp=16 still holds one (vLLM replicates them)."""
    model = read_serving_model(write_config(LLAMA_31_8B))
    assert model.kv_bytes_per_token(2, tp=2) == 65536
    assert model.kv_heads_per_rank(16) == 1
    assert model.kv_bytes_per_token(2, tp=16) == 2 * 32 * 1 * 128 * 2


def test_deepseek_v3_mla_caches_one_latent_a_token(write_config):
    """MLA: (kv_lora_rank 512 + qk_rope_head_dim 64) x 61 layers x 2 bytes = 70272, for any tp
    (vLLM MLAAttentionSpec; SGLang profile_max_num_token's MLA cell size)."""
    model = read_serving_model(write_config(DEEPSEEK_V3_ATTENTION))
    assert model.is_mla
    assert model.kv_bytes_per_token(2) == (512 + 64) * 61 * 2 == 70272
    assert model.kv_bytes_per_token(2, tp=8) == 70272


def test_sliding_window_layers_are_read_from_three_spellings(write_config):
    """Mistral's sliding_window, Gemma-3's sliding_window_pattern and a layer_types list."""
    mistral = read_serving_model(write_config(MISTRAL_7B_V01, "mistral"))
    assert mistral.sliding_window == 4096 and mistral.num_sliding_layers == 32
    pattern = read_serving_model(
        write_config(tiny_llama(num_hidden_layers=6, sliding_window=512,
                                sliding_window_pattern=3), "pattern"))
    assert pattern.layer_kinds == ("sliding", "sliding", "full", "sliding", "sliding", "full")
    typed = read_serving_model(write_config(tiny_llama(
        sliding_window=128, layer_types=["sliding_attention", "full_attention"]), "typed"))
    assert typed.layer_kinds == ("sliding", "full") and typed.sliding_window == 128
    off = read_serving_model(write_config(tiny_llama(sliding_window=128, use_sliding_window=False),
                                          "off"))
    assert off.num_sliding_layers == 0 and off.sliding_window is None


def test_config_json_path_and_text_config_are_read(tmp_path):
    """A config.json file path works; a multimodal config's text_config is the language model."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llava", "text_config": dict(LLAMA_31_8B)}))
    model = read_serving_model(str(path))
    assert model.num_layers == 32 and model.model_type == "llama"


def test_a_hub_name_not_in_the_cache_says_how_to_get_the_config(monkeypatch, tmp_path):
    """No network: a hub name outside the local cache is refused with the download command."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ServingConfigError, match="huggingface-cli download meta-llama/X config.json"):
        read_serving_model("meta-llama/X")


def test_a_hub_name_in_the_local_cache_is_read(monkeypatch, tmp_path):
    """A hub name resolves to its newest cached snapshot's config.json."""
    snapshot = tmp_path / "models--org--m" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(LLAMA_31_8B))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    assert read_serving_model("org/m").num_layers == 32


def test_a_config_without_layers_is_refused(write_config):
    """A config lacking num_hidden_layers names the field."""
    config = dict(LLAMA_31_8B)
    del config["num_hidden_layers"]
    with pytest.raises(ServingConfigError, match="num_hidden_layers must be a positive integer"):
        read_serving_model(write_config(config))


def test_unknown_dtypes_are_refused():
    """A dtype the engines do not take is refused, naming the ones they do."""
    with pytest.raises(ServingConfigError, match="unknown dtype 'int3'"):
        dtype_bytes("int3")
    assert dtype_bytes("torch.float16") == 2 and kv_dtype_bytes("fp8_e5m2", "bfloat16") == 1


@settings(max_examples=40, deadline=None)
@given(layers=st.integers(1, 128), kv_heads=st.sampled_from([1, 2, 4, 8, 16, 32]),
       head_dim=st.sampled_from([64, 80, 128, 256]), tp=st.sampled_from([1, 2, 4, 8, 16]),
       kv_bytes=st.sampled_from([1, 2, 4]))
def test_kv_bytes_per_token_is_layers_times_per_layer(tmp_path_factory, layers, kv_heads,
                                                      head_dim, tp, kv_bytes):
    """Per token = layers x per layer; never below one KV head a rank; never grows with tp."""
    folder = tmp_path_factory.mktemp("m")
    (folder / "config.json").write_text(json.dumps(tiny_llama(
        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=kv_heads,
        head_dim=head_dim)))
    model = read_serving_model(str(folder))
    per_token = model.kv_bytes_per_token(kv_bytes, tp)
    assert per_token == layers * model.kv_bytes_per_token_per_layer(kv_bytes, tp)
    assert per_token >= layers * 2 * head_dim * kv_bytes
    assert per_token <= model.kv_bytes_per_token(kv_bytes, 1)

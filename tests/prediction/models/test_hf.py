"""build_hf_step: transformers models from configs built in code, on meta, traced."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from oomkit.errors import OomkitError  # noqa: E402
from oomkit.prediction.models import StepOptions, build_hf_step  # noqa: E402
from oomkit.prediction.tracing import trace_step  # noqa: E402


def _gpt2_config():
    return transformers.GPT2Config(
        n_embd=64,
        n_layer=2,
        n_head=4,
        vocab_size=1000,
        n_positions=128,
        bos_token_id=0,
        eos_token_id=0,
    )


def _llama_config():
    return transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=0,
    )


def _gpt2_params(h: int = 64, layers: int = 2, vocab: int = 1000, positions: int = 128) -> int:
    per_layer = 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + 2 * h + (h * 4 * h + 4 * h)
    per_layer += 4 * h * h + h
    return vocab * h + positions * h + layers * per_layer + 2 * h  # tied head


def _llama_params(h=64, inter=128, layers=2, kv=32, vocab=1000) -> int:
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * inter + 2 * h
    return 2 * vocab * h + layers * per_layer + h  # untied head by default


def test_gpt2_config_parameter_bytes_and_train_trace():
    """A small GPT2Config builds GPT2LMHeadModel with the arithmetic parameter count and trains."""
    built = build_hf_step(_gpt2_config(), StepOptions(batch_size=2, seq_len=32))
    assert built.parameter_count == _gpt2_params()
    assert built.description.startswith("GPT2LMHeadModel 0.2M (Hugging Face gpt2), batch 2")
    recording = trace_step(built.step_fn, *built.track, steps=2)
    assert recording.allocated_bytes("parameter") == 4 * _gpt2_params()
    assert recording.allocated_bytes("gradient", step=1) == 4 * _gpt2_params()
    assert recording.allocated_bytes("optimizer_state") == 8 * _gpt2_params()


def test_llama_config_gqa_bf16_train_trace():
    """A small GQA LlamaConfig in pure bf16 with SGD: 2-byte parameters, gradients, momentum."""
    options = StepOptions(batch_size=2, seq_len=16, precision="bf16", optimizer="sgd")
    built = build_hf_step(_llama_config(), options)
    params = _llama_params()
    assert built.parameter_count == params
    recording = trace_step(built.step_fn, *built.track)
    assert recording.allocated_bytes("parameter") == 2 * params
    assert recording.allocated_bytes("gradient") == 2 * params
    assert recording.allocated_bytes("optimizer_state") == 2 * params


def test_llama_generate_uses_dynamic_cache():
    """Generation with HF's DynamicCache grows K and V by cat: 2 layers x 2 decode forwards."""
    options = StepOptions(batch_size=1, seq_len=8, mode="generate", new_tokens=3)
    built = build_hf_step(_llama_config(), options)
    recording = trace_step(built.step_fn, *built.track)
    per_token = 1 * 2 * 16 * 4  # batch * kv_heads * head_dim * fp32 bytes
    cat_sizes = [
        e.size
        for e in recording.events
        if e.action == "alloc"
        and dict(e.tags).get("op") == "aten.cat.default"
        and e.size % per_token == 0
        and e.size // per_token in (9, 10)
    ]
    assert sorted(cat_sizes) == [9 * per_token] * 4 + [10 * per_token] * 4


def test_bert_config_builds_masked_lm():
    """An encoder config (not is_decoder) builds the masked-LM class, not BertLMHeadModel."""
    config = transformers.BertConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=1000,
    )
    built = build_hf_step(config, StepOptions(batch_size=1, seq_len=16, mode="inference"))
    assert type(built.track[0]).__name__ == "BertForMaskedLM"


def test_local_directory_with_config_json(tmp_path):
    """A directory saved with save_pretrained() builds the same model as its config."""
    _gpt2_config().save_pretrained(tmp_path)
    built = build_hf_step(tmp_path, StepOptions(batch_size=1, seq_len=8, mode="inference"))
    assert built.parameter_count == _gpt2_params()
    assert built.description.startswith(f"{tmp_path} (Hugging Face)")


def test_directory_without_config_json(tmp_path):
    """A directory without config.json says what to point at."""
    with pytest.raises(OomkitError, match="without config.json"):
        build_hf_step(tmp_path, StepOptions())


def test_unreachable_hub_name_is_a_clear_error():
    """A hub name that cannot be fetched raises OomkitError suggesting a local config."""
    with pytest.raises(OomkitError, match="Without network access, pass a local directory"):
        build_hf_step("oomkit-tests/no-such-model", StepOptions(), local_files_only=True)


def test_offline_hub_name_fails_at_once_without_network_retries(monkeypatch):
    """Not cached and the hub's host does not resolve: one cache lookup, then a clear error."""
    import socket

    import transformers

    calls = []

    def from_pretrained(name, local_files_only=False, **kwargs):
        calls.append(local_files_only)
        raise OSError("not in the cache")

    def no_dns(host, port, *args, **kwargs):
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", from_pretrained)
    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.example.org")
    with pytest.raises(OomkitError, match="hub.example.org cannot be reached"):
        build_hf_step("oomkit-tests/no-such-model", StepOptions())
    assert calls == [True]  # the local cache only: no online attempt, so no retries

"""build_hf_step: transformers models from configs built in code, on meta, traced."""

from __future__ import annotations

import pytest
from _tiny_hf import tiny_gpt2_config, tiny_llama_config

transformers = pytest.importorskip("transformers")

from oomkit.errors import OomkitError  # noqa: E402
from oomkit.prediction.models import StepOptions, build_hf_step  # noqa: E402
from oomkit.prediction.tracing import trace_step  # noqa: E402


def _gpt2_config():
    return tiny_gpt2_config()


def _llama_config():
    return tiny_llama_config(bos_token_id=0, eos_token_id=0)


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
    with pytest.raises(OomkitError, match="hub.example.org cannot be reached") as refused:
        build_hf_step("oomkit-tests/no-such-model", StepOptions())
    assert calls == [True]  # the local cache only: no online attempt, so no retries
    assert "preset" not in str(refused.value)
    # A hub model a preset was shaped from: the error names the preset (case ignored).
    with pytest.raises(OomkitError) as refused:
        build_hf_step("Meta-Llama/Llama-3.1-8B", StepOptions())
    assert str(refused.value).endswith(
        "; a preset has its shapes: `oomkit predict llama-8b` or `oomkit predict llama3-8b`"
    )


# --- --hf does what transformers does (issue 22 item 7) -------------------------------------


def _saved_llama(path, **extra):
    """A small Llama config saved with save_pretrained(), as a model directory holds it."""
    config = _llama_config()
    for key, value in extra.items():
        setattr(config, key, value)
    config.save_pretrained(path)
    return path


def _users_loop(config_dir, batch, seq, *, build_dtype=None, autocast=None, gpu="rtx4090"):
    """The same model in a user's own loop, through oomkit.predict: from_config, AdamW
    (foreach, as on CUDA), `outputs = model(input_ids=..., labels=...)`, backward, step."""
    import torch

    import oomkit

    config = transformers.AutoConfig.from_pretrained(config_dir)
    kwargs = {} if build_dtype is None else {"dtype": build_dtype}
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, **kwargs)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        ids = torch.randint(config.vocab_size, (batch, seq))
        labels = ids.clone()

    def step(model, optimizer, ids, labels):
        if autocast is None:
            outputs = model(input_ids=ids, labels=labels)
        else:
            with torch.autocast("cuda", dtype=autocast):
                outputs = model(input_ids=ids, labels=labels)
        outputs.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return oomkit.predict(step, model, optimizer, ids, labels, gpu=gpu)


def _hf(config_dir, options, gpu="rtx4090"):
    import oomkit

    built = build_hf_step(config_dir, options)
    return built, oomkit.predict(built.step_fn, track=built.track, gpu=gpu)


def _figures(p):
    return (
        p.peak_allocated_bytes,
        p.peak_reserved_bytes,
        [(s.peak_allocated_bytes, s.peak_reserved_bytes) for s in p.step_peaks],
        dict(p.by_category_bytes),
        p.events,
    )


def test_bf16_config_builds_in_bf16_and_equals_the_users_loop(tmp_path):
    """No precision: the config's torch_dtype (bf16), said so; bytes equal a user's own loop."""
    import torch

    path = _saved_llama(tmp_path, dtype="bfloat16")
    built, hf = _hf(path, StepOptions(batch_size=2, seq_len=32))
    assert built.options.precision == "bf16"
    assert built.precision_source == "from the config's torch_dtype"
    assert ", bf16 (from the config's torch_dtype), adamw, train" in built.description
    assert {p.dtype for p in built.track[0].parameters()} == {torch.bfloat16}
    assert _figures(hf) == _figures(_users_loop(path, 2, 32))


def test_config_without_dtype_is_fp32_and_equals_the_users_loop(tmp_path):
    """GPT-2's config names no dtype: fp32 (the default, said so), equal to a user's loop."""
    _gpt2_config().save_pretrained(tmp_path)
    built, hf = _hf(tmp_path, StepOptions(batch_size=2, seq_len=32))
    assert (built.options.precision, built.precision_source) == (
        "fp32",
        "the default: the config names no torch_dtype",
    )
    assert _figures(hf) == _figures(_users_loop(tmp_path, 2, 32))


def test_bf16_mixed_given_equals_the_users_autocast_loop(tmp_path):
    """--precision bf16-mixed: fp32 weights (from_config dtype=float32), forward under autocast."""
    import torch

    path = _saved_llama(tmp_path, dtype="bfloat16")
    built, hf = _hf(path, StepOptions(batch_size=2, seq_len=32, precision="bf16-mixed"))
    assert built.precision_source is None
    user = _users_loop(path, 2, 32, build_dtype=torch.float32, autocast=torch.bfloat16)
    assert _figures(hf) == _figures(user)


def test_loss_upcasts_the_logits_to_fp32_as_transformers_does():
    """Pure bf16: ForCausalLMLoss copies the logits to fp32 (2 x 32 x 1000 x 4 bytes), and the
    outputs' bf16 logits stay alive through the optimizer step, as in a training loop."""
    built = build_hf_step(_llama_config(), StepOptions(batch_size=2, seq_len=32, precision="bf16"))
    events = trace_step(built.step_fn, *built.track, steps=2).events
    upcasts = [
        e
        for e in events
        if e.action == "alloc"
        and e.size == 2 * 32 * 1000 * 4
        and dict(e.tags).get("op") == "aten._to_copy.default"
    ]
    assert len(upcasts) == 2  # one a step
    last_logits = [
        e
        for e in events
        if e.action == "alloc"
        and e.size == 2 * 32 * 1000 * 2
        and dict(e.tags).get("module") == "lm_head"
        and dict(e.tags).get("category") == "activation"
    ][-1]
    freed_at = next(
        i
        for i, e in enumerate(events)
        if e.action == "free_completed" and e.address == last_logits.address
    )
    last_optimizer_alloc = max(
        i
        for i, e in enumerate(events)
        if e.action == "alloc" and dict(e.tags).get("phase") == "optimizer"
    )
    assert freed_at > last_optimizer_alloc


def test_float16_config_trains_in_pure_fp16(tmp_path):
    """A float16 config (older configs' torch_dtype key) builds fp16 parameters, states too."""
    import json

    path = _saved_llama(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data.pop("dtype", None)
    data["torch_dtype"] = "float16"
    (tmp_path / "config.json").write_text(json.dumps(data))
    built = build_hf_step(path, StepOptions(batch_size=1, seq_len=16))
    assert (built.options.precision, built.precision_source) == (
        "fp16",
        "from the config's torch_dtype",
    )
    recording = trace_step(built.step_fn, *built.track, steps=2)
    params = _llama_params()
    assert recording.allocated_bytes("parameter") == 2 * params
    assert recording.allocated_bytes("optimizer_state") == 2 * 2 * params


def test_given_precision_leaves_the_callers_config_alone():
    """Building at a given precision does not change the caller's config object's dtype."""
    import torch

    config = _llama_config()
    config.dtype = torch.bfloat16
    built = build_hf_step(config, StepOptions(batch_size=1, seq_len=8, precision="fp32"))
    assert config.dtype == torch.bfloat16
    assert next(built.track[0].parameters()).dtype == torch.float32


def test_cli_verdict_names_the_precision_and_its_source(tmp_path, capsys):
    """`oomkit predict --hf DIR` without --precision: the JSON and verdict say bf16, from where."""
    import json

    from oomkit.interfaces.cli import main

    path = _saved_llama(tmp_path, dtype="bfloat16")
    code = main(["predict", "--hf", str(path), "--batch", "1", "--seq", "16", "--steps", "1",
                 "--gpu", "rtx4090", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert out["workload"]["options"]["precision"] == "bf16"
    assert out["workload"]["precision_source"] == "from the config's torch_dtype"
    assert out["verdict"].startswith(
        "fits on RTX 4090 (bf16, from the config's torch_dtype): peak reserved "
    )


def test_given_bf16_on_a_config_without_dtype_builds_bf16_parameters():
    """GPT-2's config names no dtype; --precision bf16 still builds bf16 (from_config dtype=)."""
    import torch

    built = build_hf_step(_gpt2_config(), StepOptions(batch_size=1, seq_len=8, precision="bf16"))
    assert {p.dtype for p in built.track[0].parameters()} == {torch.bfloat16}
    assert built.precision_source is None
    recording = trace_step(built.step_fn, *built.track)
    assert recording.allocated_bytes("parameter") == 2 * _gpt2_params()


def test_config_dtype_the_recorder_does_not_model_is_built_in_fp32():
    """A float64 config gets fp32, and the source says the config's dtype was not modelled."""
    import torch

    from oomkit.prediction.models.hf import config_precision

    config = _llama_config()
    config.dtype = torch.float64
    assert config_precision(config) == (
        "fp32",
        "the default: the config's torch_dtype torch.float64 is not modelled",
    )
    built = build_hf_step(config, StepOptions(batch_size=1, seq_len=8, mode="inference"))
    assert {p.dtype for p in built.track[0].parameters()} == {torch.float32}
    assert config.dtype == torch.float64


def test_importing_transformers_keeps_torchaos_import_log_lines_out_of_the_terminal(
    tmp_path, monkeypatch, caplog
):
    """transformers' quantizers import torchao where it is installed, when a model class first
    loads, and torchao logs "Failed to load ..._C_*.so" at WARNING without its CUDA kernels:
    every --hf prediction printed those lines. _transformers() imports the quantizers with
    torchao's loggers quiet (a stand-in package that logs as torchao does; levels restored)."""
    import logging
    import sys

    from oomkit.prediction.models.hf import _transformers

    package = tmp_path / "transformers"
    (package / "quantizers").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "quantizers" / "__init__.py").write_text(
        "import logging\n"
        "logging.getLogger('torchao').warning('Failed to load _C_mxfp8.so')\n"
        "logging.getLogger('torch.utils._pytree').warning('register_constant is deprecated')\n"
        "logging.getLogger('torchao').error('a real error')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [n for n in sys.modules if n == "transformers" or n.startswith("transformers.")]:
        monkeypatch.delitem(sys.modules, name)
    before = logging.getLogger("torchao").level
    with caplog.at_level(logging.WARNING):
        module = _transformers()
    assert module.__file__ == str(package / "__init__.py")
    assert [r.getMessage() for r in caplog.records] == ["a real error"]
    assert logging.getLogger("torchao").level == before

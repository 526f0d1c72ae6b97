"""``oomkit serve vllm|sglang``: flags as the engines spell them, exit codes, JSON, one-line errors.

``serve`` is not yet listed in ``cli/__init__.py``, so these tests build a parser of their own with
``serve.add_parser`` and call ``run``, as ``main`` would.
"""

from __future__ import annotations

import argparse
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oomkit.interfaces.cli import serve

# A two-layer Llama: fast to build and trace, same code path as a real one.
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024,
    "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
}

VLLM_FLAGS = [
    "--block-size", "--concurrency", "--context-overhead", "--cuda-graph-sizes",
    "--cudagraph-capture-sizes", "--dtype", "--enforce-eager", "--gpu",
    "--gpu-memory-utilization", "--json", "--kv-cache-dtype", "--kv-cache-memory",
    "--kv-cache-memory-bytes",
    "--max-model-len", "--max-num-batched-tokens", "--max-num-seqs", "--quantization",
    "--tensor-parallel-size", "--vllm-version",
]
SGLANG_FLAGS = [
    "--chunked-prefill-size", "--context-length", "--context-overhead", "--cuda-graph-max-bs", "--disable-cuda-graph",
    "--dtype", "--gpu", "--json", "--kv-cache-dtype", "--max-running-requests",
    "--max-total-tokens", "--mem-fraction-static", "--page-size", "--quantization",
    "--sglang-version", "--tp-size",
]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="oomkit")
    serve.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def _run(argv: list[str]) -> int:
    args = _parser().parse_args(["serve", *argv])
    return args.run(args)


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(tmp_path)


def _long_flags(parser: argparse.ArgumentParser) -> list[str]:
    return sorted(
        option
        for action in parser._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    )


def test_the_flags_are_the_engines_spellings():
    """A new flag is a deliberate change: vLLM's and SGLang's names, plus --gpu and --json."""
    parser = _parser()
    serve_parser = parser._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    engines = serve_parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert _long_flags(engines["vllm"]) == VLLM_FLAGS
    assert _long_flags(engines["sglang"]) == sorted(SGLANG_FLAGS + ["--tp"])


def test_vllm_that_starts_exits_0_and_prints_the_budget(model_dir, capsys):
    """The table names each step; the verdict and the utilization bound follow."""
    assert _run(["vllm", model_dir, "--gpu", "h100"]) == serve.EXIT_STARTS
    out = capsys.readouterr().out
    assert "vLLM 0.13" in out and "Available KV cache memory" in out
    assert "Verdict: starts" in out
    assert "Highest --gpu-memory-utilization that starts and survives warm-up: 0.9" in out


def test_vllm_json_has_every_figure_and_the_request(model_dir, capsys):
    """--json: the request, weights, activation peak, non-torch, KV, blocks, graphs, bounds."""
    assert _run(["vllm", model_dir, "--json", "--max-model-len", "2048",
                 "--vllm-version", "0.8"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["engine"] == "vllm" and data["vllm_version"] == "0.8"
    assert data["request"]["max_model_len"] == 2048
    for key in ("requested_bytes", "non_torch_bytes", "available_kv_bytes", "num_blocks",
                "kv_cache_tokens", "max_concurrency", "max_gpu_memory_utilization",
                "kv_cache_memory_for_concurrency_bytes", "free_after_kv_bytes"):
        assert key in data
    assert data["weights"]["total_bytes"] > 0 and data["profile"]["peak_bytes"] > 0
    assert data["layout"]["bytes_per_block"] == 16 * 2 * 2 * 64 * 2 * 2
    assert data["verdict"]["starts"] is True


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_device_is_read_as_predict_reads_it(engine, model_dir, capsys):
    """--gpu resolves through Target.resolve, as predict's does: the same CUDA context; and
    --context-overhead replaces it, to the byte, in every figure built on it."""
    from oomkit.core.target import Target

    assert _run([engine, model_dir, "--gpu", "l40s", "--json"]) == 0
    default = json.loads(capsys.readouterr().out)
    target = Target.resolve("l40s")
    assert default["gpu"]["context_overhead_bytes"] == target.gpu.context_overhead_bytes
    assert default["cuda_context_bytes"] == target.gpu.context_overhead_bytes
    assert any(target.context_description in e for e in default["estimates"])
    assert _run([engine, model_dir, "--gpu", "l40s", "--context-overhead", "1GiB", "--json"]) == 0
    given = json.loads(capsys.readouterr().out)
    assert given["cuda_context_bytes"] == 1 << 30
    assert any("given by the caller" in e for e in given["estimates"])
    free = "init_free_bytes" if engine == "vllm" else "free_before_load_bytes"
    assert given[free] == default[free] - ((1 << 30) - target.gpu.context_overhead_bytes)


def test_a_context_as_large_as_the_device_is_one_line(model_dir, capsys):
    """--context-overhead at the device's total: exit 2, the message says what to change."""
    assert _run(["vllm", model_dir, "--gpu", "24GiB", "--context-overhead", "24GiB"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("oomkit: error:") and err.count("\n") == 1


def test_vllm_that_does_not_start_exits_1_with_the_knob(model_dir, capsys):
    """Utilization 0.999 on an H100 asks for more than is free at start: lower it."""
    assert _run(["vllm", model_dir, "--gpu-memory-utilization", "0.999"]) == serve.EXIT_FAILS
    out = capsys.readouterr().out
    assert "does not start (fails at: init)" in out
    assert "--gpu-memory-utilization lower: at most 0.99" in out


def test_sglang_prints_the_fraction_bounds(model_dir, capsys):
    """SGLang: the default fraction, the pool, and both directions."""
    assert _run(["sglang", model_dir, "--tp", "1"]) == 0
    out = capsys.readouterr().out
    assert "mem_fraction_static=0.834 (default 0.834)" in out
    assert "(init fails below: raise it)" in out and "(OOM above: lower it)" in out


def test_bad_input_is_one_line_and_exit_2(model_dir, capsys, monkeypatch, tmp_path):
    """An unmodelled release, or a hub name not cached: exit 2, one line on stderr."""
    assert _run(["vllm", model_dir, "--vllm-version", "0.5"]) == serve.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("oomkit: error: --vllm-version '0.5' is not modelled")
    assert err.count("\n") == 1
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    assert _run(["vllm", "meta-llama/Llama-3.1-8B-Instruct"]) == serve.EXIT_USAGE
    assert "not in the local Hugging Face cache" in capsys.readouterr().err


def test_abbreviated_flags_are_refused(model_dir, capsys):
    """`--gpu-mem 0.5` is not a shortened --gpu-memory-utilization: a usage error."""
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(["serve", "vllm", model_dir, "--gpu-mem", "0.5"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --gpu-mem" in capsys.readouterr().err


def test_capture_sizes_take_vllm_013s_spelling_and_are_deduplicated(model_dir, capsys):
    """vLLM 0.13 has --cudagraph-capture-sizes (no --cuda-graph-sizes, the spelling of the
    releases between; both are taken) and de-duplicates the sizes (vllm/config/vllm.py
    _set_cudagraph_sizes): 8 8 16 captures two graphs, as 8 16 does."""
    def graphs(*flags: str) -> object:
        assert _run(["vllm", model_dir, "--gpu", "h100", "--max-model-len", "1024", "--json",
                     *flags]) == 0
        return json.loads(capsys.readouterr().out)["graphs"]

    once = graphs("--cudagraph-capture-sizes", "8", "16")
    assert once["sizes"] == [8, 16]
    assert graphs("--cudagraph-capture-sizes", "8", "8", "16", "16") == once
    assert graphs("--cuda-graph-sizes", "16", "8") == once


@settings(max_examples=60, deadline=None)
@given(whole=st.integers(0, 10**6), tenths=st.integers(0, 9), suffix=st.sampled_from("kmgtKMGT"),
       decimal=st.booleans())
def test_counts_read_as_vllm_reads_them(whole, tenths, suffix, decimal):
    """vLLM 0.13's human_readable_int (--max-model-len, --max-num-batched-tokens,
    --kv-cache-memory-bytes): k m g t are powers of 1,000 (25.6k = 25,600), K M G T powers of
    1,024 and take no decimals; oomkit had refused 32k, and read --kv-cache-memory 8G as 8e9."""
    scale = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
             "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[suffix]
    text = f"{whole}.{tenths}{suffix}" if decimal else f"{whole}{suffix}"
    if decimal and suffix.isupper():
        with pytest.raises(argparse.ArgumentTypeError, match="refuses decimals"):
            serve._vllm_int(text)
    elif decimal:
        assert serve._vllm_int(text) == int(float(f"{whole}.{tenths}") * scale)
    else:
        assert serve._vllm_int(text) == whole * scale
    assert serve._vllm_int(str(whole)) == whole


def test_kv_cache_memory_takes_vllms_spelling_and_reading(model_dir, capsys):
    """--kv-cache-memory-bytes 8G is 8 GiB as in vLLM; 8g is 8e9; oomkit's 8GiB still works."""
    def kv(*flags: str) -> int:
        assert _run(["vllm", model_dir, "--gpu", "h100", "--max-model-len", "1K", "--json",
                     *flags]) in (0, 1)
        return json.loads(capsys.readouterr().out)["request"]["kv_cache_memory_bytes"]

    assert kv("--kv-cache-memory-bytes", "8G") == kv("--kv-cache-memory", "8GiB") == 8 * 2**30
    assert kv("--kv-cache-memory", "8g") == 8 * 10**9

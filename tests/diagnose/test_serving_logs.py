"""vLLM's and SGLang's start-up logs and OOM messages, read into figures and the knob to turn."""

from __future__ import annotations

from oomkit.diagnose.serving_logs import diagnose_serving_log, is_serving_log

# A vLLM 0.8.1 start-up (the engine line as kserve/kserve#4368 quotes it) with the figures
# vLLM logs for Llama-3.1-8B on an H100 (llm-d-benchmark empirical-vllm-memory-results.md).
VLLM_STARTUP = """\
INFO 04-07 06:07:16 [core.py:53] Initializing a V1 LLM engine (v0.8.1) with config: model='meta-llama/Llama-3.1-8B-Instruct'
INFO 04-07 06:07:40 [gpu_model_runner.py:1174] Model loading took 14.99 GiB and 31.46 seconds
INFO 04-07 06:07:52 [gpu_worker.py:242] Available KV cache memory: 51.38 GiB
INFO 04-07 06:07:52 [kv_cache_utils.py:581] GPU KV cache size: 420,896 tokens
INFO 04-07 06:07:52 [kv_cache_utils.py:585] Maximum concurrency for 16,000 tokens per request: 26.31x
INFO 04-07 06:08:10 [gpu_model_runner.py:1534] Graph capturing finished in 18 secs, took 0.53 GiB
"""


def test_vllm_startup_figures():
    """Weights, available KV cache, tokens, concurrency and graph memory are read as printed."""
    d = diagnose_serving_log(VLLM_STARTUP)
    assert d is not None and d.engine == "vllm" and d.version == "0.8.1"
    assert d.figures == {
        "weights_gib": 14.99, "available_kv_cache_gib": 51.38, "kv_cache_tokens": 420896.0,
        "max_model_len": 16000.0, "max_concurrency": 26.31, "cuda_graph_gib": 0.53,
    }
    assert d.failure is None and d.knobs == ()


def test_v0_profile_summary_is_read():
    """The V0 worker's summary: 'the rest of the memory reserved for KV Cache is X GiB'."""
    text = ("Memory profiling takes 5.1 seconds\ntotal_gpu_memory (79.19GiB) x "
            "gpu_memory_utilization (0.90) = 71.27GiB\nmodel weights take 14.99GiB; non_torch_memory "
            "takes 0.13GiB; PyTorch activation peak memory takes 1.23GiB; the rest of the memory "
            "reserved for KV Cache is 54.92GiB.")
    d = diagnose_serving_log(text)
    assert d is not None and d.figures["kv_cache_rest_gib"] == 54.92
    assert d.figures["activation_peak_gib"] == 1.23 and d.figures["gpu_memory_utilization"] == 0.9


def test_no_cache_blocks_wants_a_higher_utilization():
    """'No available memory for the cache blocks': raise --gpu-memory-utilization first."""
    d = diagnose_serving_log(
        "ValueError: No available memory for the cache blocks. Try increasing "
        "`gpu_memory_utilization` when initializing the engine.")
    assert d is not None and d.failure == "no_kv_cache"
    assert (d.knobs[0].flag, d.knobs[0].direction) == ("--gpu-memory-utilization", "raise")


def test_free_memory_at_start_wants_a_lower_utilization():
    """0.13's start check: at most free / total, floored to 0.01."""
    d = diagnose_serving_log(
        "ValueError: Free memory on device (70.1/79.19 GiB) on startup is less than desired GPU "
        "memory utilization (0.95, 75.23 GiB). Decrease GPU memory utilization or reduce GPU "
        "memory used by other processes.")
    assert d is not None and d.failure == "free_memory_at_start"
    assert d.knobs[0].why == "at most 0.88"


def test_max_model_len_names_the_longest_that_fits():
    """The estimated maximum model length becomes the --max-model-len to pass."""
    d = diagnose_serving_log(
        "ValueError: To serve at least one request with the models's max seq len (131072), "
        "(16.00 GiB KV cache is needed, which is larger than the available KV cache memory "
        "(3.56 GiB). Based on the available memory, the estimated maximum model length is "
        "29120. Try increasing `gpu_memory_utilization` or decreasing `max_model_len`")
    assert d is not None and d.failure == "max_model_len"
    assert (d.knobs[0].flag, d.knobs[0].why) == ("--max-model-len", "at most 29120")


def test_vllm_graph_capture_oom_wants_a_lower_utilization():
    """An OOM while capturing CUDA graphs (after the KV cache): lower the utilization."""
    d = diagnose_serving_log(
        "INFO [gpu_model_runner.py] Capturing CUDA graph shapes: 40%\n"
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.20 GiB. GPU 0 has a total "
        "capacity of 79.19 GiB of which 600.00 MiB is free. (vllm)")
    assert d is not None and d.failure == "cuda_graph_oom"
    assert (d.knobs[0].flag, d.knobs[0].direction) == ("--gpu-memory-utilization", "lower")
    assert d.knobs[1].flag == "--enforce-eager"


def test_sglang_not_enough_memory_wants_a_higher_fraction():
    """SGLang at init: raise --mem-fraction-static."""
    d = diagnose_serving_log(
        "[2025-05-01 10:00:00 TP0] Load weight end. type=LlamaForCausalLM, dtype=torch.bfloat16, "
        "avail mem=63.50 GB, mem usage=15.01 GB.\n"
        "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static.")
    assert d is not None and d.engine == "sglang" and d.failure == "not_enough_memory"
    assert d.figures["load_weight_avail_gb"] == 63.5
    assert (d.knobs[0].flag, d.knobs[0].direction) == ("--mem-fraction-static", "raise")


def test_sglang_graph_capture_oom_wants_a_lower_fraction():
    """SGLang's run-time side (graph capture): the opposite direction, and the graph knobs."""
    d = diagnose_serving_log(
        "[2025-05-01 10:00:05 TP0] max_total_num_tokens=413842, chunked_prefill_size=8192, "
        "max_prefill_tokens=16384, max_running_requests=2048, context_len=131072\n"
        "Exception: Capture cuda graph failed: CUDA out of memory. Tried to allocate 2.00 GiB")
    assert d is not None and d.failure == "cuda_graph_oom"
    assert d.figures["max_total_num_tokens"] == 413842 and d.figures["max_running_requests"] == 2048
    assert [(k.flag, k.direction) for k in d.knobs[:3]] == [
        ("--mem-fraction-static", "lower"), ("--cuda-graph-max-bs", "lower"),
        ("--disable-cuda-graph", "set")]


def test_other_text_is_not_a_serving_log():
    """A plain PyTorch OOM without an engine's words is left to the OOM-text reader."""
    text = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB"
    assert not is_serving_log(text) and diagnose_serving_log(text) is None


_PYTORCH_OOM = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB"


def test_a_pytorch_oom_that_only_mentions_an_engine_is_left_to_the_oom_reader():
    """A training log naming vLLM or SGLang in passing (a package list, a run name) holds no
    engine line: its OOM is PyTorch's, explained from the OOM text (found by a generated log
    line 'VLLM' in tests/robustness/test_oom_text_input.py)."""
    for mention in ("VLLM", "pip install vllm==0.8.1 sglang", "run: sglang-baseline"):
        assert diagnose_serving_log(f"{mention}\n{_PYTORCH_OOM}\n") is None


def test_an_oom_raised_inside_the_engine_is_the_engines():
    """The engine's modules in the traceback (or its logger) make the OOM a runtime OOM of that
    engine, with its knobs, though no figure was logged."""
    vllm = ('  File "/opt/venv/lib/python3.12/site-packages/vllm/worker/model_runner.py", line 9\n'
            + _PYTORCH_OOM)
    sglang = "[TP0] Scheduler hit an exception\n" + _PYTORCH_OOM
    for text, engine, flag in ((vllm, "vllm", "--gpu-memory-utilization"),
                               (sglang, "sglang", "--mem-fraction-static")):
        d = diagnose_serving_log(text)
        assert d is not None and (d.engine, d.failure) == (engine, "runtime_oom")
        assert d.knobs[0].flag == flag


def test_the_report_renders_the_failure_and_knobs():
    """reports/serving.py: the failure, its line and the knobs, and the same as JSON."""
    from rich.console import Console

    from oomkit.interfaces.reports.serving import render_serving_log, serving_log_to_json

    d = diagnose_serving_log("ValueError: No available memory for the cache blocks. Try "
                             "increasing `gpu_memory_utilization` when initializing the engine.")
    assert d is not None
    console = Console(width=200, record=True, color_system=None)
    render_serving_log(d, console)
    text = console.export_text()
    assert "Failed: no_kv_cache" in text
    assert "--gpu-memory-utilization raise: the KV cache gets what it leaves" in text
    data = serving_log_to_json(d)
    assert data["failure"] == "no_kv_cache" and data["knobs"][0]["direction"] == "raise"

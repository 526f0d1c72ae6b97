"""Rendering of serving start-ups (``oomkit serve vllm|sglang``): a rich table and JSON."""

from __future__ import annotations

import dataclasses
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from oomkit.diagnose.serving_logs import ServingLogDiagnosis
from oomkit.prediction.serving import SglangStartup, Verdict, VllmStartup
from oomkit.units import format_bytes

__all__ = [
    "render_serving_log",
    "render_sglang_startup",
    "serving_log_to_json",
    "render_vllm_startup",
    "sglang_startup_to_json",
    "vllm_startup_to_json",
]


def _verdict_lines(verdict: Verdict, console: Console) -> None:
    head = "[bold green]starts[/]" if verdict.starts else "[bold red]does not start[/]"
    where = "" if verdict.starts else f" (fails at: {verdict.stage})"
    console.print(f"Verdict: {head}{where}: {escape(verdict.reason)}")
    for knob in verdict.knobs:
        console.print(f"  {escape(knob.flag)} {escape(knob.direction)}: {escape(knob.why)}")


def _table(title: str, rows: list[tuple[str, str, str]]) -> Table:
    table = Table(title=title)
    table.add_column("step", no_wrap=True)
    table.add_column("bytes", justify="right", no_wrap=True)
    table.add_column("how", overflow="fold")
    for step, value, how in rows:
        table.add_row(escape(step), value, escape(how))
    return table


def render_vllm_startup(startup: VllmStartup, console: Console) -> None:
    """Print vLLM's start-up figures, the verdict and the utilization bounds."""
    s = startup
    r = s.request
    console.print(
        f"vLLM {s.rules.version}: {escape(s.model.name)} ({escape(s.model.model_type)}, "
        f"{s.dtype}) on {escape(s.gpu.name)}, tp={r.tensor_parallel_size}, per rank"
    )
    console.print(
        f"max_model_len={s.max_model_len} max_num_seqs={s.max_num_seqs} "
        f"max_num_batched_tokens={s.max_num_batched_tokens} "
        f"gpu_memory_utilization={r.gpu_memory_utilization} block_size={s.layout.block_size}"
    )
    rows = [
        ("total memory", format_bytes(s.total_memory_bytes), "torch total_memory (core/gpus)"),
        ("free at start", format_bytes(s.init_free_bytes), "total less the CUDA context (estimate)"),
        ("requested", format_bytes(s.requested_bytes), "total x gpu_memory_utilization"),
        ("weights", format_bytes(s.weights.total_bytes),
         f"{s.weights.quantization or s.dtype} linears, padded vocab, RoPE cache"),
        ("activation peak", format_bytes(s.profile.peak_bytes),
         f"profile run: {s.profile.num_tokens} tokens, sampler over {s.profile.num_logit_rows} rows (recorded)"),
        ("non-torch", format_bytes(s.non_torch_bytes), "growth after the start snapshot (estimate)"),
        ("non-KV budget", format_bytes(s.budget_non_kv_bytes), "what vLLM subtracts"),
        ("KV cache available", format_bytes(s.available_kv_bytes), "'Available KV cache memory'"),
        ("KV cache allocated", format_bytes(s.kv_cache_bytes),
         f"{s.num_blocks} blocks x {format_bytes(s.layout.bytes_per_block)}"),
        ("CUDA graphs", format_bytes(s.graphs.total_bytes),
         f"{len(s.graphs.sizes)} sizes x {s.graphs.modes} modes, after the KV cache (estimate)"),
        ("sampler warm-up", format_bytes(s.warmup.peak_bytes),
         f"{s.warmup.num_logit_rows} rows, after the KV cache (recorded)"),
        ("free after KV", format_bytes(s.free_after_kv_bytes), "before graphs and warm-up"),
    ]
    console.print(_table("Start-up, in the order vLLM runs it", rows))
    console.print(
        f"KV cache: {s.kv_bytes_per_token} bytes a token, {s.kv_cache_tokens:,} tokens, "
        f"maximum concurrency {s.max_concurrency:.2f}x at {s.max_model_len:,} tokens"
    )
    _verdict_lines(s.verdict, console)
    high = s.max_gpu_memory_utilization
    low = s.min_gpu_memory_utilization
    console.print(
        "Highest --gpu-memory-utilization that starts and survives warm-up: "
        + ("none" if high is None else f"{high:.2f}")
        + "; lowest that serves one max_model_len request: "
        + ("none" if low is None else f"{low:.2f}")
    )
    console.print(
        f"--kv-cache-memory for {s.concurrency} concurrent {s.max_model_len}-token requests: "
        f"{s.kv_cache_memory_for_concurrency_bytes} ({format_bytes(s.kv_cache_memory_for_concurrency_bytes)})"
        + ("" if s.kv_cache_memory_for_concurrency_fits else ": more than this GPU holds")
    )
    if s.rules.has_kv_cache_memory_flag:
        console.print(
            "vLLM's own suggestion after warm-up: --kv-cache-memory="
            f"{s.suggested_kv_cache_memory_requested_bytes} to fit the requested memory, or "
            f"{s.suggested_kv_cache_memory_gpu_bytes} to use the whole GPU (CUDA graphs counted)"
        )
    console.print("Estimates: " + "; ".join(escape(e) for e in s.estimates))
    for warning in s.warnings:
        console.print(f"[yellow]note:[/] {escape(warning)}")


def render_sglang_startup(startup: SglangStartup, console: Console) -> None:
    """Print SGLang's start-up figures, the verdict and the fraction bounds."""
    s = startup
    console.print(
        f"SGLang {s.request.sglang_version}: {escape(s.model.name)} ({s.dtype}) on "
        f"{escape(s.gpu.name)}, tp={s.request.tp}, per rank"
    )
    console.print(
        f"mem_fraction_static={s.mem_fraction_static} (default {s.default_mem_fraction_static}) "
        f"chunked_prefill_size={s.chunked_prefill_size} cuda_graph_max_bs={s.cuda_graph_max_bs} "
        f"context_len={s.context_len}"
    )
    rows = [
        ("free before load", format_bytes(s.free_before_load_bytes), "total less the CUDA context"),
        ("weights", format_bytes(s.weights.total_bytes), s.weights.quantization or s.dtype),
        ("free after load", format_bytes(s.free_after_load_bytes), "less non-torch (estimate)"),
        ("KV pool", format_bytes(s.kv_pool_bytes),
         f"{s.max_total_num_tokens:,} tokens x {s.cell_size_bytes} bytes"),
        ("request table", format_bytes(s.req_to_token_bytes),
         f"{s.max_running_requests} requests x {s.context_len + 4} int32"),
        ("prefill activation", format_bytes(s.prefill.peak_bytes),
         f"{s.chunked_prefill_size} tokens (recorded)"),
        ("decode logits", format_bytes(s.decode_logits_bytes), "estimate"),
        ("CUDA graphs", format_bytes(s.graphs.total_bytes),
         f"{len(s.graphs.sizes)} sizes (estimate)"),
        ("outside the pool", format_bytes(s.reserve_bytes), "what the run has"),
        ("run needs", format_bytes(s.runtime_need_bytes), "table + graphs + larger of prefill/decode"),
    ]
    console.print(_table("Start-up and run time, one rank", rows))
    _verdict_lines(s.verdict, console)
    console.print(
        f"--mem-fraction-static: at least {s.min_mem_fraction_static:.3f} for any KV pool "
        f"(init fails below: raise it), {s.min_mem_fraction_for_context:.3f} for one "
        f"{s.context_len}-token request; at most {s.max_mem_fraction_static:.3f} to survive run "
        "time (OOM above: lower it)"
    )
    console.print("Estimates: " + "; ".join(escape(e) for e in s.estimates))
    for warning in s.warnings:
        console.print(f"[yellow]note:[/] {escape(warning)}")


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)
                if f.name != "raw"}
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def _gpu_json(startup: Any) -> dict[str, Any]:
    gpu = startup.gpu
    return {"name": gpu.name, "total_memory_bytes": gpu.total_memory_bytes,
            "context_overhead_bytes": gpu.context_overhead_bytes}


def vllm_startup_to_json(startup: VllmStartup) -> dict[str, Any]:
    """Every figure of ``startup``, bytes as ints, with the request that made it."""
    s = startup
    out = {f.name: _plain(getattr(s, f.name)) for f in dataclasses.fields(s)
           if f.name not in {"gpu", "model", "rules"}}
    out["engine"] = "vllm"
    out["vllm_version"] = s.rules.version
    out["gpu"] = _gpu_json(s)
    out["model"] = {k: v for k, v in _plain(s.model).items() if k != "quantization"}
    out["weights"]["total_bytes"] = s.weights.total_bytes
    out["graphs"]["total_bytes"] = s.graphs.total_bytes
    out["layout"]["bytes_per_block"] = s.layout.bytes_per_block
    out["kv_cache_tokens"] = s.kv_cache_tokens
    return out


def sglang_startup_to_json(startup: SglangStartup) -> dict[str, Any]:
    """Every figure of ``startup``, bytes as ints, with the request that made it."""
    s = startup
    out = {f.name: _plain(getattr(s, f.name)) for f in dataclasses.fields(s)
           if f.name not in {"gpu", "model"}}
    out["engine"] = "sglang"
    out["gpu"] = _gpu_json(s)
    out["model"] = {k: v for k, v in _plain(s.model).items() if k != "quantization"}
    out["weights"]["total_bytes"] = s.weights.total_bytes
    out["graphs"]["total_bytes"] = s.graphs.total_bytes
    return out


def render_serving_log(diagnosis: ServingLogDiagnosis, console: Console) -> None:
    """Print what a vLLM / SGLang log says: its figures, its failure and the knobs."""
    d = diagnosis
    engine = {"vllm": "vLLM", "sglang": "SGLang"}[d.engine]
    console.print(f"{engine} log" + (f" (v{escape(d.version)})" if d.version else ""))
    for name, value in d.figures.items():
        console.print(f"  {escape(name)}: {value:g}")
    if d.failure is None:
        console.print("No start-up failure found.")
        return
    console.print(f"[bold red]Failed:[/] {escape(d.failure)}: {escape(d.explanation)}")
    if d.message:
        console.print(f"  {escape(d.message)}")
    for knob in d.knobs:
        console.print(f"  {escape(knob.flag)} {escape(knob.direction)}: {escape(knob.why)}")


def serving_log_to_json(diagnosis: ServingLogDiagnosis) -> dict[str, Any]:
    """The log's figures, failure and knobs as JSON."""
    out: dict[str, Any] = _plain(diagnosis)
    return out

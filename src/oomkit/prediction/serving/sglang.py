"""SGLang's start-up, GPU-free: its static memory fraction, its KV pool, and the OOMs on each side.

SGLang fixes the KV pool from one knob, ``--mem-fraction-static`` (``f``): after the weights load,
``model_runner.py`` ``ModelRunner.profile_max_num_token`` keeps ``rest = free_after_load -
free_before_load * (1 - f)`` (GiB, ``get_available_gpu_memory``) for the pool and sizes it in
tokens, ``int(rest * 2**30 // cell_size)`` (``cell_size``: ``model_spec.ServingModel
.kv_bytes_per_token``), aligned down to ``page_size``; ``init_memory_pool`` raises "Not enough
memory. Please try to increase --mem-fraction-static." when that is not positive. Everything
else (activations of a ``chunked_prefill_size`` prefill, the CUDA graphs up to
``cuda_graph_max_bs``, the request-to-token table) must fit in the ``1 - f`` left over, so a
too-high ``f`` fails at run time and the fix is the opposite: lower ``f``.

Defaults, as read (``python/sglang/srt/server_args.py``):

- ``0.4``: ``ServerArgs.__post_init__``: ``f`` by tp (0.88; 0.87 from tp 2; 0.85 from 4; 0.81
  from 8; 0.79 from 16); ``chunked_prefill_size`` 2048 below 25,000 MB of GPU memory, else 8192;
  ``cuda_graph_max_bs`` 8 below 25,000 MB, else 160.
- ``0.5``: ``ServerArgs._handle_gpu_memory_settings`` (sgl-project/sglang#10975): the chunk and
  the graph batch by memory bucket, then ``reserved = 512 + max(chunk, 2048) * 1.5 +
  cuda_graph_max_bs * 2 + tp * pp / 8 * 1024`` MB, at least 10 GiB above 60 GiB of memory, and
  ``f = round((gpu_mem - reserved) / gpu_mem, 3)``; captured batch sizes
  ``_generate_cuda_graph_batch_sizes``.

``max_running_requests`` by default: ``min(max(int(max_total_num_tokens / context_len * 512),
2048), 4096)`` rows of ``ReqToTokenPool`` (``model_runner.py`` ``init_memory_pool``), each of
``context_len + 4`` int32 slots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from oomkit.core.gpus import GpuSpec
from oomkit.core.target import Target
from oomkit.prediction.serving.cuda_graph import GraphEstimate, estimate_graphs
from oomkit.prediction.serving.model_spec import (
    ServingConfigError,
    ServingModel,
    kv_dtype_bytes,
    read_serving_model,
)
from oomkit.prediction.serving.profile_run import ProfilePeak, RankRecorder
from oomkit.prediction.serving.verdict import Knob, Verdict
from oomkit.prediction.serving.vllm import NON_TORCH_BYTES, model_dtype
from oomkit.prediction.serving.weights import WeightBytes, rank_model, weight_bytes

__all__ = [
    "DEFAULT_SGLANG_VERSION",
    "SGLANG_VERSIONS",
    "SglangRequest",
    "SglangStartup",
    "default_sglang_settings",
    "predict_sglang",
]

MiB = 1 << 20
GiB = 1 << 30
SGLANG_VERSIONS = ("0.4", "0.5")
DEFAULT_SGLANG_VERSION = "0.5"
# Bytes a decode row's logits take at run time: bf16 logits, their fp32 copy and the
# probabilities SGLang samples from (sampler.py: logits.float(), softmax). An estimate.
_DECODE_LOGIT_BYTES_PER_ELEMENT = 2 + 4 + 4


@dataclass(frozen=True)
class SglangRequest:
    """``python -m sglang.launch_server --model-path MODEL`` with its memory flags (``None``:
    SGLang's default).

    Raises:
        ServingConfigError: a flag out of range.
    """

    model: str
    gpu: str = "h100"
    tp: int = 1
    mem_fraction_static: float | None = None
    max_running_requests: int | None = None
    chunked_prefill_size: int | None = None
    cuda_graph_max_bs: int | None = None
    max_total_tokens: int | None = None
    context_length: int | None = None
    kv_cache_dtype: str = "auto"
    dtype: str = "auto"
    quantization: str | None = None
    disable_cuda_graph: bool = False
    page_size: int = 1
    sglang_version: str = DEFAULT_SGLANG_VERSION
    # Memory outside PyTorch on the device (the CUDA context); None: the figure oomkit.core.target
    # models for this GPU and CUDA build, as predict --gpu uses (Target.resolve).
    context_overhead_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ServingConfigError(
                f"--mem-fraction-static must be in (0, 1); got {self.mem_fraction_static}"
            )
        for name in ("tp", "max_running_requests", "chunked_prefill_size", "cuda_graph_max_bs",
                     "max_total_tokens", "context_length", "page_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ServingConfigError(f"--{name.replace('_', '-')} must be at least 1; got {value}")
        if self.sglang_version not in SGLANG_VERSIONS:
            raise ServingConfigError(
                f"--sglang-version {self.sglang_version!r} is not modelled; oomkit models SGLang "
                f"{', '.join(SGLANG_VERSIONS)}"
            )


@dataclass(frozen=True)
class SglangStartup:
    """One SGLang rank's start-up and its run-time headroom, bytes on one rank."""

    request: SglangRequest
    gpu: GpuSpec
    model: ServingModel
    dtype: str
    context_len: int
    mem_fraction_static: float
    default_mem_fraction_static: float
    chunked_prefill_size: int
    cuda_graph_max_bs: int
    total_memory_bytes: int
    cuda_context_bytes: int
    free_before_load_bytes: int
    weights: WeightBytes
    non_torch_bytes: int
    free_after_load_bytes: int
    rest_bytes: int
    cell_size_bytes: int
    max_total_num_tokens: int
    kv_pool_bytes: int
    max_running_requests: int
    req_to_token_bytes: int
    reserve_bytes: int
    prefill: ProfilePeak
    decode_logits_bytes: int
    graphs: GraphEstimate
    runtime_need_bytes: int
    min_mem_fraction_static: float
    min_mem_fraction_for_context: float
    max_mem_fraction_static: float
    verdict: Verdict
    estimates: tuple[str, ...] = field(default=())
    warnings: tuple[str, ...] = field(default=())


def _buckets(gpu_mem_mb: float, tp: int) -> tuple[int, int]:
    """0.5 ``_handle_gpu_memory_settings``: (chunked_prefill_size, cuda_graph_max_bs) by memory."""
    if gpu_mem_mb < 20 * 1024:
        return 2048, 8
    if gpu_mem_mb < 35 * 1024:
        return 2048, 24 if tp < 4 else 80
    if gpu_mem_mb < 60 * 1024:
        return 4096, 32 if tp < 4 else 160
    if gpu_mem_mb < 160 * 1024:
        return 8192, 256 if tp < 4 else 512
    return 16384, 512


def default_sglang_settings(
    version: str, gpu: GpuSpec, tp: int, chunked_prefill_size: int | None,
    cuda_graph_max_bs: int | None,
) -> tuple[float, int, int]:
    """SGLang's defaults: ``(mem_fraction_static, chunked_prefill_size, cuda_graph_max_bs)``.

    ``gpu_mem`` is SGLang's device capacity in MB (``get_nvgpu_memory_capacity``: nvidia-smi's
    total); oomkit uses the catalog's ``total_memory`` (a few hundred MiB lower on an H100: the
    fraction moves by under 0.001).
    """
    gpu_mem = gpu.total_memory_bytes / MiB
    if version == "0.4":
        fraction = 0.79 if tp >= 16 else 0.81 if tp >= 8 else 0.85 if tp >= 4 else (
            0.87 if tp >= 2 else 0.88)
        chunk = chunked_prefill_size or (2048 if gpu_mem < 25_000 else 8192)
        bs = cuda_graph_max_bs or (8 if gpu_mem < 25_000 else 160)
        return fraction, chunk, bs
    default_chunk, default_bs = _buckets(gpu_mem, tp)
    chunk = chunked_prefill_size or default_chunk
    bs = cuda_graph_max_bs or default_bs
    reserved = 512 + max(chunk, 2048) * 1.5 + bs * 2 + tp * 1 / 8 * 1024
    if gpu_mem > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    return round((gpu_mem - reserved) / gpu_mem, 3), chunk, bs


def _capture_sizes(version: str, max_bs: int) -> tuple[int, ...]:
    """The decode batch sizes SGLang captures graphs for (0.5 ``_generate_cuda_graph_batch_sizes``;
    0.4 ``cuda_graph_runner.py``: 1, 2, 4, then multiples of 8)."""
    if version == "0.4":
        sizes = [1, 2, 4, *range(8, max(max_bs, 8) + 1, 8)]
    else:
        sizes = [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 512, 16),
                 *range(512, max_bs + 1, 32)]
    return tuple(s for s in sizes if s <= max_bs)


def predict_sglang(request: SglangRequest, *, recorder: RankRecorder | None = None) -> SglangStartup:
    """Walk SGLang's start-up for ``request``: KV pool, defaults, and the fractions that work.

    Raises:
        ServingConfigError: the config or a flag cannot be used.
    """
    target = Target.resolve(request.gpu, context_overhead_bytes=request.context_overhead_bytes)
    gpu = target.gpu
    model = read_serving_model(request.model)
    tp = request.tp
    dtype = model_dtype(model, request.dtype, gpu)
    version = request.sglang_version
    default_fraction, chunk, max_bs = default_sglang_settings(
        version, gpu, tp, request.chunked_prefill_size, request.cuda_graph_max_bs
    )
    fraction = request.mem_fraction_static or default_fraction
    context_len = request.context_length or model.max_position_embeddings
    if recorder is None:
        recorder = RankRecorder(rank_model(model, tp, dtype), gpu)
    weights = weight_bytes(model, recorder.built, tp=tp, dtype=dtype,
                           quantization=request.quantization)
    cell = model.kv_bytes_per_token(kv_dtype_bytes(request.kv_cache_dtype, dtype), tp)
    context = gpu.context_overhead_bytes
    total = gpu.total_memory_bytes
    non_torch = NON_TORCH_BYTES[1] if tp == 1 else NON_TORCH_BYTES[2]
    before = total - context
    after = before - weights.total_bytes - non_torch
    # profile_max_num_token: rest = available_after_load - total_before_load * (1 - f).
    rest = after - before * (1 - fraction)
    tokens = max(0, int(rest // cell)) if rest > 0 else 0
    if request.max_total_tokens is not None:
        tokens = min(tokens, request.max_total_tokens)
    tokens = tokens // request.page_size * request.page_size
    running = request.max_running_requests or min(
        max(int(tokens / context_len * 512), 2048), 4096
    )
    req_to_token = (running + 1) * (context_len + 4) * 4
    # MHATokenToKVPool: size + page_size slots (slot 0 pads).
    kv_pool = (tokens + request.page_size) * cell if tokens else 0
    prefill = recorder.peak(chunk, 0)
    # The largest decode batch: every running request, each holding at least one token.
    decode_logits = min(running, max(tokens, 1)) * model.vocab_size * _DECODE_LOGIT_BYTES_PER_ELEMENT
    sizes = () if request.disable_cuda_graph else _capture_sizes(version, max_bs)
    graphs = estimate_graphs(
        sizes, pool_peak=recorder.peak(max(sizes), 0) if sizes else None,
        num_layers=model.num_layers, modes=1,
    )
    runtime_need = req_to_token + graphs.total_bytes + max(prefill.peak_bytes, decode_logits)
    reserve = before - weights.total_bytes - non_torch - kv_pool
    # The fractions: tokens > 0 needs rest > 0; a whole-context request needs rest >= one
    # context of cells; the run needs before * (1 - f) >= runtime_need (+ what non-torch took).
    min_fraction = 1 - after / before
    min_context = 1 - (after - context_len * cell) / before
    max_fraction = 1 - runtime_need / before
    if tokens <= 0:
        verdict = Verdict(
            starts=False, stage="kv_cache",
            reason=(f"--mem-fraction-static {fraction} leaves no KV pool: after the weights "
                    f"({weights.total_bytes / GiB:.2f} GiB) {after / GiB:.2f} GiB is free and "
                    f"{(before * (1 - fraction)) / GiB:.2f} GiB must stay out of it ('Not enough "
                    "memory. Please try to increase --mem-fraction-static.')"),
            knobs=(Knob("--mem-fraction-static", "raise", f"at least {math.ceil(min_fraction * 1000) / 1000:.3f}"),
                   Knob("--tp", "raise", "weights split over more GPUs"),
                   Knob("--quantization", "fp8", "weights in one byte")),
        )
    elif reserve < runtime_need:
        verdict = Verdict(
            starts=False, stage="runtime",
            reason=(f"the {reserve / GiB:.2f} GiB outside the KV pool is less than the "
                    f"{runtime_need / GiB:.2f} GiB the run needs (request table, CUDA graphs, "
                    f"a {chunk}-token prefill or {running} decode rows): CUDA out of memory at "
                    "graph capture or under load"),
            knobs=(Knob("--mem-fraction-static", "lower", f"at most {math.floor(max_fraction * 1000) / 1000:.3f}"),
                   Knob("--chunked-prefill-size", "lower", "a smaller prefill activation"),
                   Knob("--cuda-graph-max-bs", "lower", "fewer, smaller graphs"),
                   Knob("--max-running-requests", "lower", "a smaller request table and decode batch")),
        )
    else:
        verdict = Verdict(
            starts=True, stage="ready",
            reason=(f"{tokens} tokens of KV pool; {(reserve - runtime_need) / GiB:.2f} GiB spare "
                    "outside it at peak"),
        )
    warnings = list(prefill.warnings)
    if 0 < tokens < context_len:
        warnings.append(
            f"the pool holds {tokens} tokens, fewer than the context length {context_len}: "
            "SGLang caps a request's input at max_total_num_tokens - 1"
        )
    return SglangStartup(
        request=request, gpu=gpu, model=model, dtype=dtype, context_len=context_len,
        mem_fraction_static=fraction, default_mem_fraction_static=default_fraction,
        chunked_prefill_size=chunk, cuda_graph_max_bs=max_bs, total_memory_bytes=total,
        cuda_context_bytes=context, free_before_load_bytes=before, weights=weights,
        non_torch_bytes=non_torch, free_after_load_bytes=after, rest_bytes=int(rest),
        cell_size_bytes=cell, max_total_num_tokens=tokens, kv_pool_bytes=kv_pool,
        max_running_requests=running, req_to_token_bytes=req_to_token, reserve_bytes=reserve,
        prefill=prefill, decode_logits_bytes=decode_logits, graphs=graphs,
        runtime_need_bytes=runtime_need, min_mem_fraction_static=min_fraction,
        min_mem_fraction_for_context=min_context, max_mem_fraction_static=max_fraction,
        verdict=verdict,
        estimates=(
            f"CUDA context {context / GiB:.2f} GiB: {target.context_description}",
            f"non-torch memory {non_torch / GiB:.2f} GiB (from vLLM logs; SGLang's is alike)",
            f"CUDA graphs {graphs.total_bytes / GiB:.2f} GiB (oomkit's estimate)",
            f"decode logits {decode_logits / GiB:.2f} GiB ({running} rows)",
        ),
        warnings=tuple(warnings),
    )

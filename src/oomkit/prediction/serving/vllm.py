"""vLLM's start-up, GPU-free: its KV-cache budget, its blocks, and whether it survives warm-up.

``predict_vllm(VllmRequest(model=..., gpu="h100", ...))`` walks a vLLM worker's start-up
(``vllm/v1/worker/gpu_worker.py``: ``init_device`` -> ``load_model`` ->
``determine_available_memory`` -> ``initialize_from_config`` -> ``compile_or_warm_up_model``) with
the figures oomkit can know before the engine runs: the weights priced from the config, the
profile run recorded on meta (``profile_run.trace_profile_run``), the CUDA context from
``oomkit.core.gpus`` (``GpuSpec.context_overhead_bytes``, an estimate per architecture). The
release's own rules are in ``vllm_versions``; the KV block rules in ``vllm_kv_cache``.

What vLLM does not budget, oomkit estimates, and the record says which figures are estimates:
the memory held outside torch's allocator after start (``NON_TORCH_BYTES``), the CUDA graphs
(``cuda_graph.py``), the runner's persistent input buffers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from oomkit.core.gpus import GpuSpec
from oomkit.core.target import Target
from oomkit.prediction.serving.cuda_graph import GraphEstimate, estimate_graphs
from oomkit.prediction.serving.model_spec import (
    ServingConfigError,
    ServingModel,
    dtype_bytes,
    kv_dtype_bytes,
    read_serving_model,
)
from oomkit.prediction.serving.profile_run import ProfilePeak, RankRecorder
from oomkit.prediction.serving.verdict import Knob, Verdict
from oomkit.prediction.serving.vllm_kv_cache import KvLayout, kv_layout
from oomkit.prediction.serving.vllm_versions import DEFAULT_VLLM_VERSION, VllmRules, vllm_rules
from oomkit.prediction.serving.weights import WeightBytes, rank_model, weight_bytes

__all__ = [
    "NON_TORCH_BYTES",
    "REDUNDANCY_BUFFER_BYTES",
    "VllmRequest",
    "VllmStartup",
    "model_dtype",
    "predict_vllm",
]

MiB = 1 << 20
GiB = 1 << 30
# Memory outside torch's allocator that appears after vLLM's start-up snapshot (kernel modules
# loaded, NCCL/custom all-reduce buffers). An estimate from vLLM's own logs of it: 0.13 GiB on
# one H100 for gpt-oss-20b, Llama-3.1-8B and Qwen3-0.6B, 0.55 GiB a rank at tp=2
# (llm-d/llm-d-benchmark config_explorer/empirical-vllm-memory-results.md).
NON_TORCH_BYTES = {1: int(0.13 * GiB), 2: int(0.55 * GiB)}
# gpu_worker.py compile_or_warm_up_model: "leave a small buffer (=150MiB) to avoid OOM" in the
# --kv-cache-memory it suggests.
REDUNDANCY_BUFFER_BYTES = 150 * MiB


@dataclass(frozen=True)
class VllmRequest:
    """``vllm serve MODEL`` with its memory flags, as vLLM spells them (``None``: vLLM's default).

    Raises:
        ServingConfigError: a flag out of range (utilization outside (0, 1], sizes below 1).
    """

    model: str
    gpu: str = "h100"
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"
    dtype: str = "auto"
    quantization: str | None = None
    enforce_eager: bool = False
    cuda_graph_sizes: tuple[int, ...] | None = None
    kv_cache_memory_bytes: int | None = None
    block_size: int = 16
    vllm_version: str = DEFAULT_VLLM_VERSION
    concurrency: int | None = None
    # Memory outside PyTorch on the device (the CUDA context); None: the figure oomkit.core.target
    # models for this GPU and CUDA build, as predict --gpu uses (Target.resolve).
    context_overhead_bytes: int | None = None

    def __post_init__(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ServingConfigError(
                f"--gpu-memory-utilization must be in (0, 1]; got {self.gpu_memory_utilization}"
            )
        for name in ("tensor_parallel_size", "max_model_len", "max_num_seqs",
                     "max_num_batched_tokens", "block_size", "concurrency"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ServingConfigError(
                    f"--{name.replace('_', '-')} must be at least 1; got {value}"
                )
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ServingConfigError(
                f"--kv-cache-memory must be positive; got {self.kv_cache_memory_bytes}"
            )
        if self.cuda_graph_sizes is not None and any(s < 1 for s in self.cuda_graph_sizes):
            raise ServingConfigError("--cudagraph-capture-sizes must be positive batch sizes")


@dataclass(frozen=True)
class VllmStartup:
    """One vLLM worker's start-up, as that release computes it, and what follows it.

    Every figure is bytes on one tensor-parallel rank. ``estimates`` names the figures vLLM
    measures and oomkit can only estimate.
    """

    request: VllmRequest
    rules: VllmRules
    gpu: GpuSpec
    model: ServingModel
    dtype: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    total_memory_bytes: int
    cuda_context_bytes: int
    init_free_bytes: int
    requested_bytes: int
    weights: WeightBytes
    profile: ProfilePeak
    warmup: ProfilePeak
    non_torch_bytes: int
    persistent_buffer_bytes: int
    budget_non_kv_bytes: int
    available_kv_bytes: int
    layout: KvLayout
    num_blocks: int
    kv_cache_bytes: int
    kv_cache_tokens: int
    max_concurrency: float
    kv_bytes_per_token: int
    graphs: GraphEstimate
    free_after_kv_bytes: int
    verdict: Verdict
    max_gpu_memory_utilization: float | None
    min_gpu_memory_utilization: float | None
    concurrency: int
    kv_cache_memory_for_concurrency_bytes: int
    kv_cache_memory_for_concurrency_fits: bool
    suggested_kv_cache_memory_requested_bytes: int
    suggested_kv_cache_memory_gpu_bytes: int
    estimates: tuple[str, ...] = field(default=())
    warnings: tuple[str, ...] = field(default=())


def model_dtype(model: ServingModel, dtype: str, gpu: GpuSpec) -> str:
    """The dtype vLLM runs in: ``--dtype``, or for ``auto`` the config's, where an fp32 config
    runs in bf16 (fp16 below compute capability 8.0) (``vllm/config`` ``_get_and_verify_dtype``).

    Raises:
        ServingConfigError: bf16 on a GPU below compute capability 8.0 (``gpu_worker.py``
            ``_check_if_gpu_supports_dtype``: "Bfloat16 is only supported on GPUs with compute
            capability of at least 8.0").
    """
    chosen = dtype.lower()
    major = gpu.kernel_compute_capability[0]
    if chosen == "auto":
        chosen = model.config_dtype
        if chosen in {"float32", "float"}:
            chosen = "bfloat16" if major >= 8 else "float16"
    chosen = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(
        chosen, chosen
    )
    dtype_bytes(chosen)
    if chosen == "bfloat16" and major < 8:
        raise ServingConfigError(
            f"Bfloat16 is only supported on GPUs with compute capability of at least 8.0; the "
            f"{gpu.name} has {major}.{gpu.kernel_compute_capability[1]}: pass --dtype half"
        )
    return chosen


def _non_torch_bytes(tp: int) -> int:
    return NON_TORCH_BYTES[1] if tp == 1 else NON_TORCH_BYTES[2]


def _persistent_buffers(model: ServingModel, element: int, tokens: int, seqs: int, mml: int,
                        block_size: int) -> int:
    """The runner's input buffers made before the profile run (``GPUModelRunner.__init__``):
    token ids (int32), positions (int64) and input embeddings of ``max_num_batched_tokens`` rows,
    and the block table (int32, ``max_num_seqs x cdiv(max_model_len, block_size)``). An
    estimate: the exact set differs across releases and models."""
    return tokens * (4 + 8 + model.hidden_size * element) + seqs * -(-mml // block_size) * 4


def predict_vllm(request: VllmRequest, *, recorder: RankRecorder | None = None) -> VllmStartup:
    """Walk vLLM's start-up for ``request`` and say whether it starts, and with what.

    Args:
        request: the model and flags.
        recorder: a rank recorder to reuse (a search over flags records each run once).

    Raises:
        ServingConfigError: the config or a flag cannot be used (the message says which).
    """
    rules = vllm_rules(request.vllm_version)
    if request.kv_cache_memory_bytes is not None and not rules.has_kv_cache_memory_flag:
        raise ServingConfigError(
            f"--kv-cache-memory does not exist in vLLM {rules.version}; it came with later "
            "releases. Use --vllm-version 0.13, or size the cache with --gpu-memory-utilization"
        )
    if request.block_size not in rules.block_sizes:  # argparse's choices: vLLM exits 2
        raise ServingConfigError(
            f"--block-size {request.block_size}: vLLM {rules.version} takes one of "
            f"{', '.join(map(str, rules.block_sizes))} (its BlockSize choices); use one of them"
        )
    target = Target.resolve(request.gpu, context_overhead_bytes=request.context_overhead_bytes)
    gpu = target.gpu
    model = read_serving_model(request.model)
    tp = request.tensor_parallel_size
    dtype = model_dtype(model, request.dtype, gpu)
    element = dtype_bytes(dtype)
    default_tokens, default_seqs = rules.default_batch(gpu.total_memory_bytes, gpu.name)
    mml = request.max_model_len or model.max_position_embeddings
    if mml > model.max_position_embeddings:
        raise ServingConfigError(
            f"--max-model-len {mml} is above the model's {model.max_position_embeddings} "
            "positions; vLLM refuses it unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. Pass at most "
            f"{model.max_position_embeddings}"
        )
    seqs = request.max_num_seqs or default_seqs
    tokens = request.max_num_batched_tokens or default_tokens
    if tokens < seqs:
        raise ServingConfigError(
            f"--max-num-batched-tokens ({tokens}) must be at least --max-num-seqs ({seqs}); "
            "vLLM's SchedulerConfig refuses it"
        )
    if recorder is None:
        recorder = RankRecorder(rank_model(model, tp, dtype), gpu, inplace_sampler=rules.inplace_sampler)
    weights = weight_bytes(model, recorder.built, tp=tp, dtype=dtype,
                           quantization=request.quantization)
    rows = min(seqs, tokens)
    # GPUModelRunner.profile_run: _dummy_run(max_num_tokens) then _dummy_sampler_run.
    profile = recorder.peak(tokens, rows)
    # compile_or_warm_up_model: _dummy_run(min(max_num_seqs, max_num_batched_tokens)) and the
    # sampler over as many rows, after the KV cache and the graphs are allocated.
    warmup = recorder.peak(rows, rows)
    sizes = request.cuda_graph_sizes or rules.capture_sizes(seqs, tokens)
    # vllm/config/vllm.py _set_cudagraph_sizes (0.13): the sizes given, de-duplicated, those up
    # to max_num_batched_tokens, ascending (0.8's init_with_cudagraph_sizes de-duplicates too).
    sizes = tuple(sorted({s for s in sizes if s <= tokens}))
    graphs = estimate_graphs(
        (() if request.enforce_eager else sizes),
        pool_peak=(recorder.peak(max(sizes), 0) if sizes and not request.enforce_eager else None),
        num_layers=model.num_layers,
        modes=rules.graph_modes,
    )
    kv_bytes = kv_dtype_bytes(request.kv_cache_dtype, dtype)
    layout = kv_layout(model, kv_bytes=kv_bytes, tp=tp, block_size=request.block_size)
    inputs = _Inputs(
        request=request, rules=rules, gpu=gpu, model=model, dtype=dtype, max_model_len=mml,
        max_num_seqs=seqs, max_num_batched_tokens=tokens, weights=weights, profile=profile,
        warmup=warmup, graphs=graphs, layout=layout, context=gpu.context_overhead_bytes,
        context_source=target.context_description,
        non_torch=_non_torch_bytes(tp),
        buffers=_persistent_buffers(model, element, tokens, seqs, mml, request.block_size),
        kv_per_token=model.kv_bytes_per_token(kv_bytes, tp),
    )
    startup = _account(request.gpu_memory_utilization, inputs)
    grid = [u / 100 for u in range(1, 101)]
    starting = [u for u in grid if _account(u, inputs).verdict.starts]
    serving_one = [u for u in grid if _account(u, inputs).available_kv_bytes
                   >= layout.bytes_per_request(mml, tokens)]
    return replace(
        startup,
        max_gpu_memory_utilization=max(starting) if starting else None,
        min_gpu_memory_utilization=min(serving_one) if serving_one else None,
    )


@dataclass(frozen=True)
class _Inputs:
    """What does not change with the utilization: one recording, many budgets."""

    request: VllmRequest
    rules: VllmRules
    gpu: GpuSpec
    model: ServingModel
    dtype: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    weights: WeightBytes
    profile: ProfilePeak
    warmup: ProfilePeak
    graphs: GraphEstimate
    layout: KvLayout
    context: int
    context_source: str
    non_torch: int
    buffers: int
    kv_per_token: int


def _account(util: float, inputs: _Inputs) -> VllmStartup:
    """The start-up at one ``gpu_memory_utilization``."""
    request, rules, gpu, model = inputs.request, inputs.rules, inputs.gpu, inputs.model
    dtype, max_model_len, max_num_seqs = inputs.dtype, inputs.max_model_len, inputs.max_num_seqs
    max_num_batched_tokens, weights = inputs.max_num_batched_tokens, inputs.weights
    profile, warmup, graphs, layout = inputs.profile, inputs.warmup, inputs.graphs, inputs.layout
    context, non_torch, buffers = inputs.context, inputs.non_torch, inputs.buffers
    kv_per_token = inputs.kv_per_token
    total = gpu.total_memory_bytes
    init_free = total - context
    requested = int(total * util)
    w = weights.total_bytes
    peak = profile.peak_bytes
    if rules.budget_counts_context:
        # 0.8: allocated peak (weights and buffers included) plus all memory outside torch.
        non_kv = w + buffers + peak + context + non_torch
    else:
        # 0.13 memory_profiling: non_kv_cache_memory = weights + torch peak increase + the
        # non-torch growth since the start-up snapshot.
        non_kv = w + peak + non_torch
    given = request.kv_cache_memory_bytes
    available = given if given is not None else requested - non_kv
    num_blocks = layout.num_blocks(available)
    kv_alloc = num_blocks * layout.bytes_per_block
    tokens = max_num_batched_tokens
    free_after_kv = init_free - w - buffers - non_torch - kv_alloc
    after_kv_need = graphs.total_bytes + warmup.peak_bytes
    one_request = layout.bytes_per_request(max_model_len, tokens)
    if rules.checks_free_memory_at_start and given is None and init_free < requested:
        verdict = Verdict(
            starts=False, stage="init",
            reason=(f"the free memory at start-up ({init_free / GiB:.2f}/{total / GiB:.2f} GiB) "
                    f"is less than --gpu-memory-utilization {util} asks for "
                    f"({requested / GiB:.2f} GiB): 'Free memory on device ... is less than "
                    "desired GPU memory utilization'"),
            knobs=(Knob("--gpu-memory-utilization", "lower",
                        f"at most {math.floor(init_free / total * 100) / 100:.2f}"),),
        )
    elif available <= 0:
        verdict = Verdict(
            starts=False, stage="kv_cache",
            reason=("nothing is left for the KV cache: weights, activation peak and non-torch "
                    f"memory take {non_kv / GiB:.2f} GiB of the {requested / GiB:.2f} GiB "
                    "requested ('No available memory for the cache blocks')"),
            knobs=_kv_knobs(rules),
        )
    elif one_request > available:
        longest = layout.longest_request(available, max_model_len, tokens)
        verdict = Verdict(
            starts=False, stage="max_model_len",
            reason=(f"one request of max_model_len {max_model_len} needs "
                    f"{one_request / GiB:.2f} GiB of KV cache but {available / GiB:.2f} GiB is "
                    f"available; the longest that fits is {longest} tokens"),
            knobs=(Knob("--max-model-len", "lower", f"at most {longest}"),
                   *_kv_knobs(rules)),
        )
    elif kv_alloc + w + buffers + non_torch + context > total:
        verdict = Verdict(
            starts=False, stage="kv_cache",
            reason=("the KV cache given by --kv-cache-memory does not fit next to the "
                    "weights on the device"),
            knobs=(Knob("--kv-cache-memory", "lower", "the device holds less"),),
        )
    elif after_kv_need > free_after_kv:
        stage = "cuda_graph_capture" if graphs.total_bytes > free_after_kv else "sampler_warmup"
        verdict = Verdict(
            starts=False, stage=stage,
            reason=(f"after the KV cache {free_after_kv / GiB:.2f} GiB is free, but CUDA graphs "
                    f"(~{graphs.total_bytes / GiB:.2f} GiB, outside vLLM's budget) and the "
                    f"sampler warm-up ({warmup.peak_bytes / GiB:.2f} GiB) need "
                    f"{after_kv_need / GiB:.2f} GiB: CUDA out of memory during "
                    + ("graph capture" if stage == "cuda_graph_capture" else "warm-up")),
            knobs=(Knob("--gpu-memory-utilization", "lower",
                        "leaves room for what comes after the KV cache"),
                   Knob("--enforce-eager", "set", "no CUDA graphs at all"),
                   Knob("--max-num-seqs", "lower", "fewer graph sizes and sampler rows")),
        )
    else:
        verdict = Verdict(
            starts=True, stage="ready",
            reason=(f"{num_blocks} blocks of {layout.block_size} tokens; "
                    f"{(free_after_kv - after_kv_need) / GiB:.2f} GiB stays free after graphs "
                    "and warm-up"),
            knobs=(),
        )
    concurrency = request.concurrency or 1
    # BlockPool keeps one null block out of use (v1/core/block_pool.py), hence the + 1.
    for_concurrency = (concurrency * layout.blocks_per_request(max_model_len, tokens) + 1) \
        * layout.bytes_per_block
    graph_bytes = 0 if request.enforce_eager else graphs.total_bytes
    # That cache next to everything else the device holds once warmed up.
    fits = (context + w + buffers + non_torch + for_concurrency + graph_bytes
            + warmup.peak_bytes) <= total
    suggest_requested = requested - (w + peak + non_torch + graph_bytes) - REDUNDANCY_BUFFER_BYTES
    suggest_gpu = init_free - (w + peak + non_torch + graph_bytes) - REDUNDANCY_BUFFER_BYTES
    estimates = (
        f"CUDA context {context / GiB:.2f} GiB: {inputs.context_source}",
        f"non-torch growth {non_torch / GiB:.2f} GiB (from vLLM logs)",
        f"CUDA graphs {graphs.total_bytes / GiB:.2f} GiB (oomkit's estimate; vLLM "
        f"{rules.version} does not budget them)",
        f"runner input buffers {buffers / GiB:.2f} GiB",
    )
    return VllmStartup(
        request=request, rules=rules, gpu=gpu, model=model, dtype=dtype,
        max_model_len=max_model_len, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=tokens, total_memory_bytes=total,
        cuda_context_bytes=context, init_free_bytes=init_free, requested_bytes=requested,
        weights=weights, profile=profile, warmup=warmup, non_torch_bytes=non_torch,
        persistent_buffer_bytes=buffers, budget_non_kv_bytes=non_kv,
        available_kv_bytes=available, layout=layout, num_blocks=num_blocks,
        kv_cache_bytes=kv_alloc, kv_cache_tokens=layout.tokens(num_blocks),
        max_concurrency=layout.max_concurrency(num_blocks, max_model_len, tokens),
        kv_bytes_per_token=kv_per_token, graphs=graphs, free_after_kv_bytes=free_after_kv,
        verdict=verdict, max_gpu_memory_utilization=None, min_gpu_memory_utilization=None,
        concurrency=concurrency, kv_cache_memory_for_concurrency_bytes=for_concurrency,
        kv_cache_memory_for_concurrency_fits=fits,
        suggested_kv_cache_memory_requested_bytes=suggest_requested,
        suggested_kv_cache_memory_gpu_bytes=suggest_gpu,
        estimates=estimates, warnings=profile.warnings,
    )


def _kv_knobs(rules: VllmRules) -> tuple[Knob, ...]:
    return (
        Knob("--gpu-memory-utilization", "raise", "more of the device for the KV cache"),
        Knob("--max-num-batched-tokens", "lower", "a smaller profile run, a smaller peak"),
        Knob("--max-num-seqs", "lower", "fewer sampler rows in the profile run"),
        Knob("--tensor-parallel-size", "raise", "weights split over more GPUs"),
        Knob("--quantization", "fp8", "weights in one byte"),
    )

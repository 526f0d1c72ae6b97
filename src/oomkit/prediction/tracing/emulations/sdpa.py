"""``scaled_dot_product_attention`` as CUDA runs it: the chosen fused kernel, not the math path.

On the meta device ``scaled_dot_product_attention`` takes the math path (attention.cpp
``scaled_dot_product_attention``: only devices with a ``_fused_sdp_choice_stub`` pick a fused
kernel), which materialises the ``L x S`` attention matrix. This hook, run by the tracer's
TorchFunctionMode in place of the Python function, picks the backend CUDA would pick on the
target GPU (``sdpa_backend.select_sdp_backend``) and then does what the CUDA branch of the
composite does, calling the same aten op, whose meta kernel allocates exactly the kernel's
outputs (output, fp32 logsumexp, philox seed/offset or rng_state). Autograd saves those outputs
and backward calls the matching ``*_backward`` op, as on CUDA.

Backward temporaries are added by dispatch-level hooks: the flash backward's (flash_api.cpp
``mha_bwd``) and the memory-efficient backward's (attention_backward.cu
``_efficient_attention_backward``: the ``grad_out`` copy, the fp32 ``delta`` and the cutlass
kernel's workspace, sized for the kernel ``dispatch_cutlassB`` launches on the target GPU by
``mem_efficient_backward.py``; where that kernel cannot be named -- it hinges on a shared-memory
fit oomkit does not compute, or the batch is chunked -- the workspace is a warning). cuDNN
attention's outputs (output, fp32 softmax stats ``[B, H, L, 1]``; dq, dk, dv) are what meta
records; its backward adds the cuDNN frontend's fp32 dQ accumulator (the graph workspace
cudnn/MHA.cpp allocates) and, where cuDNN needs it, a copy of grad_out. Whatever workspace the
cuDNN engine itself adds to ``mha_graph->get_workspace_size()`` is chosen by cuDNN at run time
and stays a warning.

A call made from inside another torch function (``nn.MultiheadAttention`` calls it from
``F.multi_head_attention_forward``) runs with the mode popped; it is still seen because the
recorder swaps ``torch.nn.functional.scaled_dot_product_attention`` for a wrapper that re-enters
the mode (``_modes.DivergenceFunctionMode.reach_backward``). A caller holding its own reference
to the original function (``from torch.nn.functional import scaled_dot_product_attention`` at
import time) and calling it from inside another torch function is not seen.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from oomkit.prediction.tracing.autocast import emulated_autocast_dtype
from oomkit.prediction.tracing.emulations.cudnn_builds import (
    cudnn_version_text,
    installed_cudnn_build,
)
from oomkit.prediction.tracing.emulations.inplace_adds import in_place_adds
from oomkit.prediction.tracing.emulations.mem_efficient_backward import (
    EfficientBackwardConfig,
    UnresolvedKernel,
    efficient_backward_config,
)
from oomkit.prediction.tracing.emulations.sdpa_backend import (
    SdpaCall,
    SdpaSettings,
    SdpBackend,
    cudnn_version_decides,
    current_sdpa_settings,
    select_sdp_backend,
)
from oomkit.prediction.tracing.fake_storages import host_tensor, stands_for_cuda

if TYPE_CHECKING:
    from oomkit.prediction.tracing.emulation import EmulationContext, EmulationRegistry

__all__ = [
    "CUDNN_BACKWARD_OP",
    "CUDNN_FORWARD_OP",
    "EFFICIENT_BACKWARD_OP",
    "EFFICIENT_FORWARD_OP",
    "FLASH_BACKWARD_OP",
    "SDPA_FUNCTION",
    "register_sdpa",
    "sdpa_backend_for",
]

SDPA_FUNCTION = "torch.nn.functional.scaled_dot_product_attention"
FLASH_BACKWARD_OP = "aten._scaled_dot_product_flash_attention_backward.default"
EFFICIENT_FORWARD_OP = "aten._scaled_dot_product_efficient_attention.default"
EFFICIENT_BACKWARD_OP = "aten._scaled_dot_product_efficient_attention_backward.default"
CUDNN_FORWARD_OP = "aten._scaled_dot_product_cudnn_attention.default"
CUDNN_BACKWARD_OP = "aten._scaled_dot_product_cudnn_attention_backward.default"
_EFFICIENT_WORKSPACE_WHAT = (
    "the mem-efficient backward kernel's workspace (fp32 gradient accumulators sized by the "
    "cutlass kernel chosen, kernel_backward.h workspace_size)"
)
# attention_backward.cu _scaled_dot_product_efficient_attention_backward_cuda MAX_BATCH_SIZE:
# larger batches run in chunks of (1 << 16) - 1.
_EFFICIENT_MAX_BATCH = (1 << 16) - 1
_CUDNN_WORKSPACE_WHAT = (
    "any workspace the cuDNN attention engine asks for (sized by cuDNN at run time)"
)
_CUDNN_BACKWARD_WORKSPACE_WHAT = (
    "any workspace the cuDNN attention engine asks for beyond the frontend's fp32 dQ accumulator "
    "and softmax sum (sized by cuDNN at run time; measured only on sm90)"
)
# The cuDNN engine's own workspace, beside the frontend's tensors, as measured on an H200 (sm90,
# cuDNN 9.19.0, torch 2.11; scripts/probe_sdpa_on_gpu.py, validation/sdpa-probe-h200-torch2.11.0.json:
# 16 calls, every size exact): 256 bytes for each forward and backward graph, and for grouped-query
# attention (fewer key/value heads than query heads) the key and value gradients at full query
# heads in the inputs' dtype, b * h_q * s_kv * (d_qk + d_v) * itemsize. Other architectures run
# other kernels: their engine workspace is left out, with a warning.
_CUDNN_ENGINE_BYTES = 256
_CUDNN_ENGINE_MEASURED_CC = (9, 0)
# MHA.cpp run_cudnn_SDP_bprop: from cuDNN 9.5.1 on, grad_out needs only a unit innermost stride;
# before, the same strides as out.
_CUDNN_ANY_GRAD_OUT_STRIDES = 90501
_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_DEFAULTS: dict[str, Any] = {
    "attn_mask": None,
    "dropout_p": 0.0,
    "is_causal": False,
    "scale": None,
    "enable_gqa": False,
}


def register_sdpa(
    registry: EmulationRegistry,
    settings: SdpaSettings | None = None,
    *,
    cudnn_version: int | None = None,
) -> None:
    """Add the SDPA forward hook and the flash backward workspace hook to ``registry``.

    Args:
        registry: where to register.
        settings: process switches that steer the backend choice (cuDNN version, enabled
            backends); default: those in effect at each call (``use_sdpa_settings``, else
            ``default_sdpa_settings()``).
        cudnn_version: the target's cuDNN version (``Target.cudnn_version``), replacing the
            one of the settings above; ``None`` keeps theirs.
    """

    def in_effect() -> SdpaSettings:
        chosen = settings if settings is not None else current_sdpa_settings()
        if cudnn_version is None or chosen.cudnn_version == cudnn_version:
            return chosen
        return dataclasses.replace(chosen, cudnn_version=cudnn_version)

    def sdpa(ctx: EmulationContext) -> Any:
        return _run_sdpa(ctx, in_effect())

    def cudnn_backward(ctx: EmulationContext) -> Any:
        return _cudnn_backward(ctx, in_effect())

    registry.register(SDPA_FUNCTION)(sdpa)
    registry.register(FLASH_BACKWARD_OP)(_flash_backward)
    registry.register(EFFICIENT_FORWARD_OP)(_efficient_forward)
    registry.register(EFFICIENT_BACKWARD_OP)(_efficient_backward)
    registry.register(CUDNN_FORWARD_OP)(_cudnn_forward)
    registry.register(CUDNN_BACKWARD_OP)(cudnn_backward)


def sdpa_backend_for(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    compute_capability: tuple[int, int],
    *,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    enable_gqa: bool = False,
    settings: SdpaSettings | None = None,
) -> SdpBackend:
    """The backend CUDA would run for these tensors on a GPU of ``compute_capability``."""
    tensors = (query, key, value)
    call = SdpaCall(
        query_shape=tuple(query.shape),
        key_shape=tuple(key.shape),
        value_shape=tuple(value.shape),
        dtype=str(query.dtype).removeprefix("torch."),
        has_attn_mask=attn_mask is not None,
        dropout_p=float(dropout_p),
        is_causal=bool(is_causal),
        enable_gqa=bool(enable_gqa),
        # sdp_utils_cpp.h input_requires_grad: grad mode on and any input requires grad.
        requires_grad=torch.is_grad_enabled() and any(t.requires_grad for t in tensors),
        last_dim_contiguous=all(t.dim() == 0 or t.stride(-1) == 1 for t in tensors),
    )
    return select_sdp_backend(call, compute_capability, settings)


def _with_torch_switches(settings: SdpaSettings) -> SdpaSettings:
    """``settings`` with torch.backends.cuda's sdp switches of this moment applied: a step that
    runs under ``torch.nn.attention.sdpa_kernel(...)`` or calls ``enable_flash_sdp(False)``
    turns backends off as on CUDA (sdp_utils.cpp reads the same global context; the switches
    exist in CPU builds too)."""
    switches = torch.backends.cuda
    on = {
        name: getattr(switches, reader, lambda: True)()
        for name, reader in (
            ("flash_enabled", "flash_sdp_enabled"),
            ("mem_efficient_enabled", "mem_efficient_sdp_enabled"),
            ("math_enabled", "math_sdp_enabled"),
            ("cudnn_enabled", "cudnn_sdp_enabled"),
        )
    }
    if all(on.values()):
        return settings
    return dataclasses.replace(
        settings, **{name: getattr(settings, name) and value for name, value in on.items()}
    )


def _bind(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    bound = dict(_DEFAULTS)
    bound.update(zip(_PARAMS, args, strict=False))
    bound.update(kwargs)
    return bound


def _run_sdpa(ctx: EmulationContext, settings: SdpaSettings) -> Any:
    p = _bind(ctx.args, ctx.kwargs)
    q, k, v, mask = p["query"], p["key"], p["value"], p["attn_mask"]
    tensors = [_local(t) for t in (q, k, v, mask) if isinstance(t, torch.Tensor)]
    if len(tensors) < 3 or any(not stands_for_cuda(t) for t in tensors):
        return ctx.run()
    assert ctx.gpu is not None
    cc = ctx.gpu.kernel_compute_capability  # a custom size picks kernels as an H100 does
    cast_to = emulated_autocast_dtype()
    if cast_to is not None:
        # autocast_mode.cpp: scaled_dot_product_attention is lower_precision_fp, so CUDA autocast
        # casts the floating inputs before the composite picks a backend (the math path below
        # gets the same casts from the autocast emulation when it calls the function), the last
        # argument first, as tracing/autocast.py casts (GCC's order in WrapFunction_::call).
        cache: dict[int, torch.Tensor] = {}
        mask, v, k, q = (_autocast(t, cast_to, cache) for t in (mask, v, k, q))
    settings = _with_torch_switches(settings)
    backend = sdpa_backend_for(
        q,
        k,
        v,
        cc,
        attn_mask=mask,
        dropout_p=p["dropout_p"],
        is_causal=p["is_causal"],
        enable_gqa=p["enable_gqa"],
        settings=settings,
    )
    ctx.note_choice(f"SDPA {backend}")
    _note_cudnn(ctx, cc, settings)
    if backend == "math":
        # The meta composite is the CUDA math path (attention.cpp _scaled_dot_product_attention_math),
        # its mask added in place (inplace_adds.py), its softmax as CUDA runs it (softmax.py).
        with in_place_adds(ctx, q, k, v, mask):
            return ctx.run()
    scale = p["scale"]
    dropout_p, is_causal = float(p["dropout_p"]), bool(p["is_causal"])
    # attention.cpp should_compute_logsumexp.
    lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    aten = torch.ops.aten
    if backend == "cudnn_attention":
        bias = _bool_mask_to_float(mask, q.dtype)
        out = aten._scaled_dot_product_cudnn_attention(
            q, k, v, bias, lse, dropout_p, is_causal, False, scale=scale
        )
        return out[0]
    if backend == "flash_attention":
        # attention.cpp: pad_last_dim<8, false> on q, k, v; the scale uses the original head dim
        # (sdp::calculate_scale); post_process_flash_output slices the output back.
        head_dim = q.shape[-1]
        og_scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
        out = aten._scaled_dot_product_flash_attention(
            _pad_last_dim(q, 8),
            _pad_last_dim(k, 8),
            _pad_last_dim(v, 8),
            dropout_p,
            is_causal,
            False,
            scale=og_scale,
        )[0]
        return out[..., :head_dim] if out.shape[-1] != head_dim else out
    bias = _bool_mask_to_float(mask, q.dtype)
    if bias is not None:
        bias = _preprocess_mask(bias, q, k)
    return aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, lse, dropout_p, is_causal, scale=scale
    )[0]


def _local(tensor: Any) -> Any:
    # A DTensor (context parallel's Shard(1) q, k, v: torchtitan's apply_cp_to_forward) stands
    # for CUDA as its local shard does. The kernel is chosen on the DTensors' own (global)
    # sizes, as attention.cpp scaled_dot_product_attention passes them to
    # _fused_sdp_choice_stub, and the fused op called with them goes to torch's CP dispatcher
    # (torch/distributed/tensor/experimental/_context_parallel/_attention.py _sdpa_handler).
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _autocast(
    tensor: torch.Tensor | None, dtype: torch.dtype, cache: dict[int, torch.Tensor]
) -> torch.Tensor | None:
    # autocast_mode.h is_eligible / autocast_mode.cpp cached_cast: floating, not float64, not
    # already ``dtype``; a leaf that requires grad is cast once and the copy reused (approximate:
    # only within this call, not across calls as autocast's weight cache does).
    if tensor is None or not tensor.is_floating_point() or tensor.dtype in (dtype, torch.float64):
        return tensor
    cacheable = tensor.is_leaf and tensor.requires_grad and torch.is_autocast_cache_enabled()
    if not cacheable:
        return tensor.to(dtype)
    if id(tensor) not in cache:
        cache[id(tensor)] = tensor.to(dtype)
    return cache[id(tensor)]


def _bool_mask_to_float(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    # attention.cpp convert_boolean_attn_mask: at::where(mask.logical_not(), -inf, 0.0) in the
    # query dtype (a bool temporary and a new float mask); float masks pass through.
    if mask is None or mask.dtype != torch.bool:
        return mask
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask.logical_not(), float("-inf"), zero)


def _pad_last_dim(tensor: torch.Tensor, alignment: int) -> torch.Tensor:
    # attention.cpp pad_last_dim<alignment, slice=false>: a padded copy when not aligned.
    rem = tensor.shape[-1] % alignment
    return tensor if rem == 0 else F.pad(tensor, (0, alignment - rem))


def _preprocess_mask(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    # attention.cpp preprocess_mask: pad_bias<8> (pad by 8 - last % 8, then slice) unless every
    # stride but the last is a multiple of 8 and the last is 1; then expand to (B, H, L, S).
    aligned = mask.stride(-1) == 1 and all(s % 8 == 0 for s in mask.stride()[:-1])
    if not aligned:
        last = mask.shape[-1]
        mask = F.pad(mask, (0, 8 - last % 8))[..., :last]
    return mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def _flash_backward(ctx: EmulationContext) -> Any:
    """attention_backward.cu ``_flash_attention_backward``: contiguous copies of grad_out and out
    in the kernel's [b, s, h, d] layout where they are not, then flash_api.cpp mha_bwd's
    softmax_d, dq_accum and, for grouped-query attention, dk/dv expanded to the query's heads;
    all freed when the op returns."""
    grad_out, query, key, out_saved = ctx.args[0], ctx.args[1], ctx.args[2], ctx.args[4]
    if not stands_for_cuda(query):
        return ctx.run()
    # _scaled_dot_product_flash_attention_backward_cuda passes grad_out.transpose(1, 2) and
    # out.transpose(1, 2); _flash_attention_backward then takes contiguous_grad_out =
    # grad_out.contiguous() and contiguous_out = out.contiguous() ("CUDA code assumes that dout
    # is contiguous"): a copy each when the [b, h, s, d] tensor is not [b, s, h, d] in memory
    # (measured on an H200: two query-sized requests before dq for [b, h, s, d]-contiguous
    # inputs; none when they are projections' outputs transposed, as in most models).
    copies = [
        ctx.allocate(tensor.numel() * tensor.element_size(), "temporary", name)
        for tensor, name in ((grad_out, "flash_grad_out"), (out_saved, "flash_out"))
        if isinstance(tensor, torch.Tensor) and not tensor.transpose(1, 2).is_contiguous()
    ]
    batch, heads, seq_q, head_dim = query.shape  # (B, H, L, D) as the aten op receives them
    heads_k, seq_k = key.shape[1], key.shape[2]
    fp32 = 4
    # mha_bwd: head_size_rounded = round_multiple(head_size, head_size <= 128 ? 32 : 64);
    # seqlen_q_rounded = round_multiple(seqlen_q, 128).
    head_rounded = _round_up(head_dim, 32 if head_dim <= 128 else 64)
    seq_q_rounded = _round_up(seq_q, 128)
    # mha_bwd allocates dq, dk, dv (the op's outputs) first, then its temporaries.
    out = ctx.run()
    ctx.record_outputs(out)
    ids = [
        # softmax_d = at::empty({batch_size, num_heads, seqlen_q_rounded}, kFloat)
        ctx.allocate(batch * heads * seq_q_rounded * fp32, "workspace", "flash_softmax_d"),
        # non-deterministic: dq_accum = at::empty({b, seqlen_q_rounded, h, head_size_rounded}, kFloat)
        ctx.allocate(
            batch * seq_q_rounded * heads * head_rounded * fp32, "workspace", "flash_dq_accum"
        ),
    ]
    if heads_k != heads:
        # num_heads_k != num_heads: dk_expanded / dv_expanded = at::empty({b, seqlen_k, h, d})
        expanded = batch * seq_k * heads * head_dim * query.element_size()
        ids.append(ctx.allocate(expanded, "workspace", "flash_dk_expanded"))
        ids.append(ctx.allocate(expanded, "workspace", "flash_dv_expanded"))
    # Locals die in reverse order when mha_bwd returns, then _flash_attention_backward's.
    for alloc_id in [*reversed(ids), *reversed(copies)]:
        ctx.free(alloc_id)
    return out


def _efficient_forward(ctx: EmulationContext) -> Any:
    """attention.cu ``_efficient_attention_forward``: philox seed and offset are host tensors
    unless a CUDA graph is being captured (``device = in_capture_stream ? kCUDA : kCPU``), with
    or without dropout; meta makes them on meta. The H200 recorded no request for them."""
    out = ctx.run()
    query = ctx.args[0] if ctx.args else None
    if not (isinstance(query, torch.Tensor) and stands_for_cuda(query) and len(out) == 4):
        return out
    seed = host_tensor(lambda: torch.empty((), dtype=out[2].dtype, device="cpu"))
    offset = host_tensor(lambda: torch.empty((), dtype=out[3].dtype, device="cpu"))
    return (out[0], out[1], seed, offset)


def _efficient_backward(ctx: EmulationContext) -> Any:
    """attention_backward.cu ``_scaled_dot_product_efficient_attention_backward_cuda`` then
    ``_efficient_attention_backward`` (dense, batch <= 65535, ``shared_storage_dqdkdv`` false)."""
    # Schema: (grad_out, query, key, value, attn_bias, out, logsumexp, philox_seed,
    #          philox_offset, dropout_p, grad_input_mask, is_causal, scale); (B, H, M, K) views.
    grad_out, query, key, value = ctx.args[0], ctx.args[1], ctx.args[2], ctx.args[3]
    if not stands_for_cuda(query) or not isinstance(grad_out, torch.Tensor):
        return ctx.run()
    batch, heads, seq_q, _ = query.shape
    config = _efficient_kernel_config(ctx, query, key, value)
    ids = []
    # The kernel works on (B, M, H, K) = grad_out.transpose(1, 2); "handle potentially
    # non-contiguous grad_out through a copy": grad_out.contiguous() before grad_q/k/v exist.
    if not grad_out.transpose(1, 2).is_contiguous():
        ids.append(
            ctx.allocate(
                grad_out.numel() * grad_out.element_size(), "temporary", "efficient_grad_out"
            )
        )
    # grad_q, grad_k, grad_v = at::empty(q/k/v sizes) (the op's outputs; shared_storage_dqdkdv
    # is false on this path, so no packed [B, M, 3, H, K] chunk), grad_bias when requested.
    out = ctx.run()
    ctx.record_outputs(out)
    fp32 = 4
    delta_bytes = batch * heads * seq_q * fp32
    if isinstance(config, EfficientBackwardConfig):
        kernel_computes_delta = config.kernel.kernel_computes_delta
    else:
        kernel_computes_delta = query.dtype in (torch.float16, torch.bfloat16)
    # Inside the launchKernel lambda, once a kernel is chosen:
    if kernel_computes_delta:
        # kernel_backward.h kKernelComputesDelta (half types, not the Sm70 kernels that keep
        # dK/dV in gmem): delta = at::empty({B, nH, M}, kFloat), filled by the kernel.
        delta = ctx.allocate(delta_bytes, "workspace", "efficient_delta")
    else:
        # Otherwise delta = (grad_out.to(kFloat) * out.to(kFloat)).sum(-1).transpose(-2, -1)
        # .contiguous(): the product [B, M, H, Kv] and the sum [B, M, H] are temporaries of
        # the expression, freed (in reverse) once delta [B, nH, M] exists.
        product = ctx.allocate(
            batch * seq_q * heads * value.shape[-1] * fp32, "temporary", "efficient_delta_product"
        )
        summed = ctx.allocate(delta_bytes, "temporary", "efficient_delta_sum")
        delta = ctx.allocate(delta_bytes, "workspace", "efficient_delta")
        ctx.free(summed)
        ctx.free(product)
    workspace = None
    if isinstance(config, EfficientBackwardConfig):
        # workspace = at::empty({p.workspace_size()}, kByte) when the size is not zero
        # (mem_efficient_backward.py; zero_() when split, in place). ``at::Tensor workspace``
        # is declared before the lambda, so it outlives delta.
        if config.workspace_bytes:
            workspace = ctx.allocate(config.workspace_bytes, "workspace", "efficient_workspace")
    else:
        ctx.not_emulated(f"{_EFFICIENT_WORKSPACE_WHAT}: {config.reason}")
    # delta dies with the kernel-launch lambda; workspace, then the grad_out copy, when the
    # function returns (locals in reverse order of declaration).
    ctx.free(delta)
    if workspace is not None:
        ctx.free(workspace)
    for alloc_id in reversed(ids):
        ctx.free(alloc_id)
    return out


def _efficient_kernel_config(
    ctx: EmulationContext, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> EfficientBackwardConfig | UnresolvedKernel:
    # The launchKernel lambda's inputs: B, nH, M, N, K, Kv, dropout, head strides, and the
    # device's compute capability; deterministic mode forces num_splits_key = 1.
    batch, heads, seq_q, head_dim = query.shape
    if batch > _EFFICIENT_MAX_BATCH:
        return UnresolvedKernel(
            f"batch {batch} > {_EFFICIENT_MAX_BATCH} is processed in chunks, which oomkit does "
            "not emulate"
        )
    assert ctx.gpu is not None
    cc = ctx.gpu.kernel_compute_capability  # a custom size picks kernels as an H100 does
    dtype = str(query.dtype).removeprefix("torch.")
    if dtype not in ("float32", "float16", "bfloat16"):
        return UnresolvedKernel(f"the mem-efficient kernels have no {dtype} variant")
    dropout_p = ctx.args[9] if len(ctx.args) > 9 else ctx.kwargs.get("dropout_p", 0.0)
    deterministic = (
        torch.are_deterministic_algorithms_enabled()
        and not torch.is_deterministic_algorithms_warn_only_enabled()
    )
    return efficient_backward_config(
        cc,
        dtype,  # type: ignore[arg-type]
        num_batches=batch,
        num_heads=heads,
        num_queries=seq_q,
        num_keys=key.shape[2],
        head_dim=head_dim,
        head_dim_value=value.shape[-1],
        # attention_backward.cu: use_dropout = std::fpclassify(dropout_p) != FP_ZERO.
        dropout=float(dropout_p) != 0.0,
        # query.stride(2) of the (B, M, H, K) transposes is stride(1) of these (B, H, M, K).
        head_strides=(query.stride(1), key.stride(1), value.stride(1)),
        deterministic=deterministic,
    )


def _note_cudnn(ctx: EmulationContext, cc: tuple[int, int], settings: SdpaSettings) -> None:
    # On GPUs where the cuDNN version can put cuDNN attention first, the choice rests on it.
    if not cudnn_version_decides(cc):
        return
    if settings.cudnn_version is None:
        ctx.note_assumption("cuDNN", "version unknown (cuDNN attention not preferred)")
        return
    build = installed_cudnn_build()
    source = build.source if settings.cudnn_version == build.version else "as given"
    ctx.note_assumption("cuDNN", f"{cudnn_version_text(settings.cudnn_version)} ({source})")


def _cudnn_forward(ctx: EmulationContext) -> Any:
    """attention.cu ``_cudnn_attention_forward``: output and fp32 softmax stats [B, H, L, 1]
    (and the philox seed/offset) as meta records them; the frontend adds no workspace of its own
    for this graph (no ALiBi), the engine's is unknown and warned about."""
    out = ctx.run()
    query = ctx.args[0]
    if isinstance(query, torch.Tensor) and stands_for_cuda(query):
        if _cudnn_engine_measured(ctx):
            # attention.cu _cudnn_attention_forward makes the philox seed and offset before the
            # output and statistics; then the graph's workspace, freed when it returns.
            # Schema: (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed,
            # philox_offset, debug_attn_mask).
            if isinstance(out, tuple) and len(out) > 7:
                ctx.record_outputs((out[6], out[7]))
            ctx.record_outputs(out)
            ctx.free(ctx.allocate(_CUDNN_ENGINE_BYTES, "workspace", "cudnn_workspace"))
        else:
            ctx.not_emulated(_CUDNN_WORKSPACE_WHAT)
    return out


def _cudnn_engine_measured(ctx: EmulationContext) -> bool:
    return ctx.gpu is not None and ctx.gpu.kernel_compute_capability == _CUDNN_ENGINE_MEASURED_CC


def _cudnn_backward(ctx: EmulationContext, settings: SdpaSettings) -> Any:
    """attention_backward.cu ``_cudnn_attention_backward`` (dense) then MHA.cpp
    ``run_cudnn_SDP_bprop``: dq, dk, dv, a grad_out copy where cuDNN needs one, and the graph
    workspace, freed (in reverse) when it returns."""
    # Schema: (grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset,
    #          attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, scale).
    grad_out, query, out = ctx.args[0], ctx.args[1], ctx.args[4]
    if not isinstance(query, torch.Tensor) or not stands_for_cuda(query):
        return ctx.run()
    # dq, dk, dv = at::empty_like(query / key / value): the op's outputs.
    result = ctx.run()
    ctx.record_outputs(result)
    ids = []
    if _cudnn_copies_grad_out(grad_out, out, settings.cudnn_version):
        # permute_to_matching_layout: grad_out.permute(...).contiguous() in out's layout.
        ids.append(
            ctx.allocate(grad_out.numel() * grad_out.element_size(), "temporary", "cudnn_grad_out")
        )
    # The graph workspace (CUDACachingAllocator::get()->allocate(get_workspace_size())), one
    # allocation. Its frontend part, cudnn_frontend CompositeSDPABackwardNode
    # get_fe_workspace_size_node: from cuDNN 9.0, unless the graph is deterministic or has dBias
    # (PyTorch builds neither; deterministic mode rules cuDNN attention out), dQ is accumulated
    # in a non-virtual fp32 [b, h_q, s_q, d_qk] tensor (dQ_accum_size), and the fp32
    # softmax_sum [b, h_q, s_q, 1] (rowsum of dO * O) is non-virtual too (softmax_sum_size).
    batch, heads, seq_q, head_dim = query.shape
    size = batch * heads * seq_q * head_dim * 4 + batch * heads * seq_q * 4
    key, value = ctx.args[2], ctx.args[3]
    if _cudnn_engine_measured(ctx) and isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor):
        size += _CUDNN_ENGINE_BYTES  # the engine's part, measured (see _CUDNN_ENGINE_BYTES)
        if key.shape[1] != heads:
            seq_kv, value_dim = key.shape[2], value.shape[3]
            size += batch * heads * seq_kv * (head_dim + value_dim) * query.element_size()
    else:
        ctx.not_emulated(_CUDNN_BACKWARD_WORKSPACE_WHAT)
    ids.append(ctx.allocate(size, "workspace", "cudnn_workspace"))
    # workspace_ptr is declared after dO_, so it is released first.
    for alloc_id in reversed(ids):
        ctx.free(alloc_id)
    return result


def _cudnn_copies_grad_out(grad_out: Any, out: Any, cudnn_version: int | None) -> bool:
    # MHA.cpp run_cudnn_SDP_bprop: cuDNN >= 9.5.1 copies grad_out when its innermost stride is
    # not 1; older cuDNN when !same_strides(o, dO) (strides of dimensions larger than 1 differ).
    if not isinstance(grad_out, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    if cudnn_version is None or cudnn_version >= _CUDNN_ANY_GRAD_OUT_STRIDES:
        return grad_out.dim() > 0 and grad_out.stride(-1) != 1

    def strides_of_real_dims(t: torch.Tensor) -> list[int]:
        return [stride for size, stride in zip(t.shape, t.stride(), strict=True) if size > 1]

    return strides_of_real_dims(grad_out) != strides_of_real_dims(out)

"""Compiled blocks under context parallel: dynamo's capture takes SDPA's CUDA kernel, as on a GPU.

What a GPU's ``torch.compile`` of a CP block does with ``F.scaled_dot_product_attention`` on the
``Shard(1)`` q, k, v DTensors torchtitan's ``apply_cp_to_forward`` makes:

1. dynamo captures the call as one node and runs it once on fake tensors to learn its output
   (torch/_dynamo/utils.py ``get_fake_value`` -> ``run_node``). SDPA is a
   ``CompositeImplicitAutograd`` function (aten/src/ATen/native/transformers/attention.cpp
   ``scaled_dot_product_attention``): it asks ``_fused_sdp_choice_stub`` of the query's device
   type which kernel to run, and on ``cuda`` that is ``_fused_sdp_choice_cuda`` (sdp_utils.cpp
   ``select_sdp_backend``: flash, memory-efficient or cuDNN as the GPU allows), whose fused op
   reaches DTensor, where torch's CP dispatcher takes it (torch/distributed/tensor/experimental/
   _context_parallel/_attention.py ``custom_ops`` -> ``_sdpa_handler``: the ring);
2. AOTAutograd traces the node again, through DTensor (its subclass desugaring), into the same
   fused op and, by its derivative (tools/autograd/derivatives.yaml: ``_scaled_dot_product_
   {flash,efficient,cudnn}_attention`` -> ``*_backward``), the fused backward op, both run by
   the ring functions; the forward and backward graphs hold the ring's all-gathers and the
   fused kernels.

On the fake process group every tensor's device is ``cpu``, so in step 1 the stub of ``cpu``
answers (``_fused_sdp_choice_cpp``): ``_scaled_dot_product_flash_attention_for_cpu``, for which
DTensor has no sharding rule and CP no handler, and the capture fails. Step 2 is already the
GPU's: the compile backend points the captured SDPA node at the eager path's SDPA emulation
before AOTAutograd traces it (``tracing/compile_backend.py`` ``_fused_sdpa_in``), which calls
the fused op the target GPU picks. :func:`cpu_sdpa_as_cuda` makes step 1 the GPU's too: while
open, CP's ``custom_ops`` (which ``_enable_cp_dtensor_dispatcher`` copies into DTensor's
handlers when torchtitan enables CP) also take the CPU flash op on DTensors, and run what
attention.cpp's CUDA branch runs instead: the backend the target GPU picks
(``emulations/sdpa.py`` ``sdpa_backend_for``, on the DTensors' global sizes, as the stub sees
them, with the settings and cuDNN version the eager path's SDPA emulation uses) and its fused
op, which goes on to torch's ring. Only the capture's fake run reaches the handler: the eager
step's SDPA is the tracer's hook (``emulations/sdpa.py``), and the compiled graphs' SDPA nodes
are replaced before AOTAutograd traces them; nothing it runs is recorded.

Why the handler alone would not do for step 2: AOTAutograd records autograd above DTensor, so a
CPU flash op reaching it there would be differentiated as the CPU op
(``_scaled_dot_product_flash_attention_for_cpu_backward``), which Inductor keeps as it is
(torch/_inductor/decomposition.py:118 excludes the op's decomposition, torch/_decomp/
decompositions.py:5774): the CPU kernel would stay in the backward graph. The node replacement
keeps it out of both graphs.

Sources (torch 2.13.0, git cf30153): torch/distributed/tensor/experimental/_context_parallel/
_attention.py:897 ``_sdpa_handler``, :939 ``custom_ops``, :1001 ``_enable_cp_dtensor_dispatcher``
(``{**existing_custom_ops, **custom_ops}``, read when CP is enabled); torch/_dynamo/utils.py:3942
``get_fake_value``, :4200 ``run_node``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from oomkit.core.target import Target
    from oomkit.prediction.tracing.emulations.sdpa_backend import SdpaSettings

__all__ = ["CPU_FLASH_OP", "cpu_sdpa_as_cuda", "sdpa_settings_for"]

CPU_FLASH_OP = "aten._scaled_dot_product_flash_attention_for_cpu.default"


def sdpa_settings_for(target: Target) -> SdpaSettings:
    """The SDPA switches the eager path's SDPA emulation uses for ``target``: those in effect,
    with the target's cuDNN version where it states one (``emulations/sdpa.py`` ``register_sdpa``
    ``in_effect``)."""
    from oomkit.prediction.tracing.emulations.sdpa_backend import current_sdpa_settings

    settings = current_sdpa_settings()
    if target.cudnn_version is None or settings.cudnn_version == target.cudnn_version:
        return settings
    return dataclasses.replace(settings, cudnn_version=target.cudnn_version)


@contextlib.contextmanager
def cpu_sdpa_as_cuda(target: Target) -> Iterator[None]:
    """While open, CP's dispatcher runs SDPA's CPU flash op on DTensors as the target GPU's
    fused op (see the module docstring); CP's ``custom_ops`` are put back when it closes.

    Args:
        target: the GPU (its kernel compute capability) and cuDNN version that pick the kernel.
    """
    import torch
    from torch.distributed.tensor.experimental._context_parallel import _attention

    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    capability = target.gpu.kernel_compute_capability  # a custom size picks kernels as an H100

    def handler(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return _as_cuda_sdpa(args, kwargs, capability, sdpa_settings_for(target))

    ops = _attention.custom_ops
    had = ops.get(op)
    ops[op] = handler
    try:
        yield
    finally:
        if had is None:
            ops.pop(op, None)
        else:  # pragma: no cover - torch's CP has no handler of its own for the CPU op
            ops[op] = had


def _as_cuda_sdpa(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    capability: tuple[int, int],
    settings: SdpaSettings,
) -> tuple[Any, Any]:
    """``_scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, *,
    attn_mask, scale) -> (output, logsumexp)`` on DTensors, run as attention.cpp's CUDA branch
    runs SDPA: the fused op of the backend the GPU picks, on the same DTensors.

    The composite reads the output only (attention.cpp: ``std::get<0>`` of the CPU op); the
    second element is the fused kernel's own logsumexp (or softmax stats), as it comes.
    """
    import torch

    from oomkit.prediction.tracing.emulations.sdpa import (
        _bool_mask_to_float,
        _pad_last_dim,
        _preprocess_mask,
        sdpa_backend_for,
    )

    aten = torch.ops.aten
    query, key, value = args[:3]
    dropout_p = float(args[3]) if len(args) > 3 else float(kwargs.get("dropout_p", 0.0))
    is_causal = bool(args[4]) if len(args) > 4 else bool(kwargs.get("is_causal", False))
    mask, scale = kwargs.get("attn_mask"), kwargs.get("scale")
    # The CPU op takes K/V of fewer heads as grouped-query attention (the caller's enable_gqa,
    # which the composite does not pass on).
    gqa = query.shape[-3] != key.shape[-3]
    backend = sdpa_backend_for(
        query,
        key,
        value,
        capability,
        attn_mask=mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        enable_gqa=gqa,
        settings=settings,
    )
    # The CUDA branches as the eager path's emulation runs them (emulations/sdpa.py _run_sdpa,
    # after attention.cpp scaled_dot_product_attention).
    lse = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if backend == "cudnn_attention":
        out = aten._scaled_dot_product_cudnn_attention(
            query, key, value, _bool_mask_to_float(mask, query.dtype), lse, dropout_p,
            is_causal, False, scale=scale,
        )
        return out[0], out[1]
    if backend == "flash_attention":
        # pad_last_dim<8, false> on q, k, v; the scale of the unpadded head dim
        # (sdp::calculate_scale); the output sliced back (post_process_flash_output).
        head_dim = query.shape[-1]
        flash_scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
        out = aten._scaled_dot_product_flash_attention(
            _pad_last_dim(query, 8), _pad_last_dim(key, 8), _pad_last_dim(value, 8),
            dropout_p, is_causal, False, scale=flash_scale,
        )
        output = out[0][..., :head_dim] if out[0].shape[-1] != head_dim else out[0]
        return output, out[1]
    if backend == "efficient_attention":
        bias = _bool_mask_to_float(mask, query.dtype)
        if bias is not None:
            bias = _preprocess_mask(bias, query, key)
        out = aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, lse, dropout_p, is_causal, scale=scale
        )
        return out[0], out[1]
    # The math path CUDA runs too (attention.cpp _scaled_dot_product_attention_math).
    out = aten._scaled_dot_product_attention_math(
        query, key, value, mask, dropout_p, is_causal, None, scale=scale, enable_gqa=gqa
    )
    return out[0], out[1]

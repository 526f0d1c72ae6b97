"""The attention a Hugging Face model runs; FlashAttention-2 and flex attention emulated.

FlashAttention-2 and flex attention are emulated from their kernels' allocations.

transformers picks the attention function by ``config._attn_implementation``
(modeling_utils.py ``ALL_ATTENTION_FUNCTIONS``): ``eager`` (integrations' ``eager_attention_forward``
per model: ``matmul`` scores, ``softmax`` in fp32, dropout, ``matmul``: every ``[b, h, s, s]``
matrix is a real op the tracer records), ``sdpa`` (``F.scaled_dot_product_attention``, whose
CUDA backend the tracer emulates), ``flash_attention_2`` (the ``flash_attn`` package) and
``flex_attention`` (``torch.nn.attention.flex_attention``, compiled by Inductor). The last two
cannot run without CUDA (transformers refuses them at build time), so the model is built with a
stand-in registered in ``AttentionInterface`` that allocates what their kernels allocate:

- FlashAttention-2 (flash_attn ``flash_attn_interface.py`` ``FlashAttnFunc`` and
  ``csrc/flash_attn/flash_api.cpp`` ``mha_fwd`` / ``mha_bwd``): the forward makes ``out =
  empty_like(q)`` and ``softmax_lse`` (fp32, ``[b, h, s_q]``), saved for backward with q, k, v;
  the backward makes ``dq, dk, dv`` (``empty_like``), ``softmax_d`` (fp32, ``[b, h,
  round128(s_q)]``) and ``dq_accum`` (fp32, ``[b, round128(s_q), h, round32/64(d)]``), and for
  grouped-query attention ``dk_expanded`` / ``dv_expanded`` at the query's heads. PyTorch's own
  flash kernel is this code (aten/src/ATen/native/transformers/cuda/flash_attn), so the stand-in
  calls ``aten._scaled_dot_product_flash_attention``, whose meta kernel allocates the forward's
  outputs and whose backward's workspaces the tracer's flash-backward emulation adds
  (``tracing/emulations/sdpa.py _flash_backward``). Where it may differ: flash_attn keeps one
  ``rng_state`` (int64 ``[2]``) where aten keeps a philox seed and offset (two 0-d int64): one
  512-byte block against two; flash_attn's head dims above 256 and its varlen (padded-batch
  ``_upad_input``) path are not modelled: a padding mask is not passed (the inputs have none).
- flex attention (torch/_inductor/kernel/flex/flex_attention.py ``flex_attention`` and
  ``flex_attention_backward``): the forward template writes ``out`` (query's stride order),
  ``logsumexp`` and ``max_scores`` (both fp32, ``[b, h, s_q]``; ``max_scores`` is dropped when
  not asked for); backward makes ``delta`` (fp32 ``[b, h, s_q]``: ``sum(out * grad_out)`` fused
  into one reduction), ``grad_query`` and the key/value gradients at the key's heads (no
  broadcast sum when the batch is not broadcast). The ``BlockMask`` (int32 block indices,
  ``[b, h, s/128, s/128]``) is not modelled: the model is called without a padding mask, and
  causal masking takes none here.
"""

from __future__ import annotations

import functools
from typing import Any, Literal, get_args

import torch
import torch.nn.functional as F

__all__ = [
    "ATTN_IMPLEMENTATIONS",
    "AttnImplementation",
    "build_attn_implementation",
    "config_attn_implementation",
]

AttnImplementation = Literal["eager", "sdpa", "flash_attention_2", "flex_attention"]
ATTN_IMPLEMENTATIONS: tuple[AttnImplementation, ...] = get_args(AttnImplementation)
# The names the stand-ins are registered under in transformers' AttentionInterface: without
# "flash" or "flex" in them, which transformers takes for its own kernels and imports
# (modeling_utils.py _check_and_adjust_attn_implementation, lazy_import_flash_attention).
_EMULATED = {
    "flash_attention_2": "oomkit_emulated_fa2",
    "flex_attention": "oomkit_emulated_fx",
}
# flash_attn FlashAttnFunc.forward: head dims not a multiple of 8 are padded first.
_FLASH_HEAD_ALIGNMENT = 8


def config_attn_implementation(config: Any) -> str | None:
    """The attention implementation a config names (``attn_implementation`` in its
    ``config.json``, kept by ``PretrainedConfig`` as ``_attn_implementation_internal``), or
    ``None`` when it names none (transformers then picks ``sdpa`` where available)."""
    named = getattr(config, "_attn_implementation_internal", None)
    if named is None:
        named = config.__dict__.get("attn_implementation")
    return named if isinstance(named, str) else None


def build_attn_implementation(transformers: Any, chosen: str) -> str:
    """The ``attn_implementation`` to build with for ``chosen``: itself for ``eager`` and
    ``sdpa``; for FlashAttention-2 and flex attention, the name of their stand-in, registered in
    transformers' ``AttentionInterface`` (and ``AttentionMaskInterface``) on first use."""
    if chosen not in _EMULATED:
        return chosen
    _register(transformers)
    return _EMULATED[chosen]


@functools.cache
def _register(transformers: Any) -> None:
    interface = transformers.AttentionInterface
    interface.register(_EMULATED["flash_attention_2"], _flash_attention_2)
    interface.register(_EMULATED["flex_attention"], _flex_attention)
    masking = getattr(transformers, "masking_utils", None)
    masks = getattr(masking, "AttentionMaskInterface", None)
    flash_mask = getattr(masking, "flash_attention_mask", None)
    if masks is not None and flash_mask is not None:
        # flash_attention_mask: no mask tensor without padding (causality is the kernel's flag).
        for name in _EMULATED.values():
            masks.register(name, flash_mask)


def _pad_head(tensor: torch.Tensor) -> torch.Tensor:
    rem = tensor.shape[-1] % _FLASH_HEAD_ALIGNMENT
    return tensor if rem == 0 else F.pad(tensor, (0, _FLASH_HEAD_ALIGNMENT - rem))


def _flash_attention_2(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' ``flash_attention_forward`` with flash_attn's allocations: ``[b, h, s, d]``
    in (transformers hands flash_attn their ``transpose(1, 2)``; the kernel's ``empty_like``
    keeps that layout), ``[b, s, h, d]`` out."""
    head_dim = query.shape[-1]
    scale = scaling if scaling is not None else head_dim**-0.5
    causal = bool(getattr(module, "is_causal", False)) and query.shape[-2] > 1
    out = torch.ops.aten._scaled_dot_product_flash_attention(
        _pad_head(query), _pad_head(key), _pad_head(value), float(dropout), causal, False,
        scale=scale,
    )[0]
    if out.shape[-1] != head_dim:  # FlashAttnFunc.forward slices the padding off
        out = out[..., :head_dim]
    return out.transpose(1, 2), None


class _FlexAttention(torch.autograd.Function):
    """The allocations of Inductor's flex attention templates (forward and backward)."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> Any:
        batch, heads, seq_q, _ = query.shape
        # flex_attention.py flex_attention: out with query's stride order, v's head dim.
        out = query.new_empty((batch, heads, seq_q, value.shape[-1]))
        logsumexp = query.new_empty((batch, heads, seq_q), dtype=torch.float32)
        max_scores = query.new_empty((batch, heads, seq_q), dtype=torch.float32)
        del max_scores  # written by the template, not returned
        ctx.save_for_backward(query, key, value, out, logsumexp)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        query, key, value, out, logsumexp = ctx.saved_tensors
        # flex_attention_backward: delta = sum(out * grad_out, -1) in fp32, one fused reduction.
        delta = query.new_empty(query.shape[:-1], dtype=torch.float32)
        grad_query = torch.empty_like(query)
        grad_key = torch.empty_like(key)
        grad_value = torch.empty_like(value)
        del delta
        return grad_query, grad_key, grad_value


def _flex_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' ``flex_attention_forward`` with the Inductor templates' allocations:
    ``[b, h, s, d]`` in, ``[b, s, h, d]`` out (its ``transpose(1, 2).contiguous()``)."""
    out = _FlexAttention.apply(query, key, value)
    return out.transpose(1, 2).contiguous(), None

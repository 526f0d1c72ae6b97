"""``embedding`` on CUDA: the flattened indices forward, the sort path's index temporaries backward.

aten/src/ATen/native/Embedding.cpp ``embedding_symint`` (forward): a 1-D index tensor is passed to
``index_select`` as it is; any other is flattened first (``indices.reshape(-1)``), which copies
it when it cannot be viewed flat (an expanded or transposed index tensor: BERT's
``token_type_ids[:seq].expand(batch, seq)``), and the copy is freed when the op returns. Meta's
kernel allocates the output alone. Measured on an H200: BERT's token-type lookup asked for the
8-byte-per-index copy, then the output, then freed the copy.

aten/src/ATen/native/cuda/Embedding.cu ``embedding_dense_backward_cuda``:

- first ``indices_.contiguous()`` and ``grad_.contiguous()``: copies where they are not
  contiguous (BERT's expanded token-type ids: measured on an H200, 8 bytes per index asked
  for before ``grad_weight``, freed after it);
- ``num_indices <= 3072`` and not ``scale_grad_by_freq``: one kernel accumulates straight into
  ``grad_weight = at::zeros({num_weights, dim})``; nothing else is allocated (meta records the
  same output).
- otherwise: ``sorted_indices`` and ``orig_indices`` (``empty_like(indices)`` each, filled by a
  cub radix sort) and, with ``scale_grad_by_freq``, ``count`` (``empty_like(indices)``), all
  freed when the op returns.

Approximate: the cub radix-sort temp storage and the segment buffers that
``embedding_backward_cuda_kernel`` (EmbeddingBackwardKernel.cu) allocates, whose sizes depend
on the number of distinct indices, are not recorded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from oomkit.prediction.tracing.emulation_sites import EMBEDDING_BACKWARD_SITE, SITE_PLANS
from oomkit.prediction.tracing.fake_storages import stands_for_cuda

if TYPE_CHECKING:
    from oomkit.prediction.tracing.emulation import EmulationContext, EmulationRegistry

__all__ = ["EMBEDDING_BACKWARD_OP", "EMBEDDING_OP", "register_embedding"]

EMBEDDING_OP = "aten.embedding.default"

# The path's limit (3,072 indices, Embedding.cu) is emulation_sites.py's, with its temporaries.
EMBEDDING_BACKWARD_OP = SITE_PLANS[EMBEDDING_BACKWARD_SITE].op


def register_embedding(registry: EmulationRegistry) -> None:
    """Add the ``embedding`` and ``embedding_dense_backward`` hooks to ``registry``."""
    registry.register(EMBEDDING_OP)(_embedding)
    registry.register(EMBEDDING_BACKWARD_OP)(_embedding_dense_backward)


def _views_flat(tensor: Any) -> bool:
    """Whether ``tensor.reshape(-1)`` is a view (no copy): every pair of neighbouring dimensions
    of more than one element merges (the outer stride is the inner stride times its size)."""
    if tensor.numel() == 0:
        return True
    dims = [(size, stride) for size, stride in zip(tensor.shape, tensor.stride(), strict=True)
            if size != 1]
    return all(outer[1] == inner[1] * inner[0] for outer, inner in zip(dims, dims[1:], strict=False))


def _embedding(ctx: EmulationContext) -> Any:
    # Schema: (weight, indices, padding_idx, scale_grad_by_freq, sparse).
    weight, indices = ctx.args[0], ctx.args[1]
    if not stands_for_cuda(weight) or indices.dim() == 1 or _views_flat(indices):
        return ctx.run()
    flat = ctx.allocate(indices.numel() * indices.element_size(), "temporary", "embedding_indices")
    out = ctx.run()
    ctx.record_outputs(out)
    ctx.free(flat)
    return out


def _embedding_dense_backward(ctx: EmulationContext) -> Any:
    # Schema: (grad_output, indices, num_weights, padding_idx, scale_grad_by_freq).
    indices = ctx.args[1]
    scale_grad_by_freq = bool(ctx.args[4]) if len(ctx.args) > 4 else False
    scale_grad_by_freq = bool(ctx.kwargs.get("scale_grad_by_freq", scale_grad_by_freq))
    if not stands_for_cuda(indices):
        return ctx.run()
    grad = ctx.args[0]
    # The path and its temporaries, from the sizes (emulation_sites.py), noted as a site on
    # either path so that a batch search can synthesize the other one.
    params = (
        indices.numel(),
        indices.element_size(),
        int(scale_grad_by_freq),
        int(not indices.is_contiguous()),
        0 if grad.is_contiguous() else grad.numel() * grad.element_size(),
    )
    plan = SITE_PLANS[EMBEDDING_BACKWARD_SITE]
    ids = [ctx.allocate(nbytes, "temporary", what) for what, nbytes in plan.temporaries(params)]
    # embedding_backward_cuda_kernel allocates grad_weight last, while the indices still live.
    out = ctx.run()
    ctx.record_outputs(out)
    ctx.note_site(EMBEDDING_BACKWARD_SITE, params, out)
    for alloc_id in reversed(ids):
        ctx.free(alloc_id)
    return out

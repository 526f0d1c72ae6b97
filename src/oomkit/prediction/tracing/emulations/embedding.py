"""``embedding_dense_backward`` on CUDA: the sort path's index temporaries.

aten/src/ATen/native/cuda/Embedding.cu ``embedding_dense_backward_cuda``:

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

from oomkit.prediction.tracing.fake_storages import stands_for_cuda

if TYPE_CHECKING:
    from oomkit.prediction.tracing.emulation import EmulationContext, EmulationRegistry

__all__ = ["EMBEDDING_BACKWARD_OP", "SMALL_PATH_MAX_INDICES", "register_embedding"]

EMBEDDING_BACKWARD_OP = "aten.embedding_dense_backward.default"
# Embedding.cu embedding_dense_backward_cuda: the direct (unsorted) kernel's limit.
SMALL_PATH_MAX_INDICES = 3072


def register_embedding(registry: EmulationRegistry) -> None:
    """Add the ``embedding_dense_backward`` hook to ``registry``."""
    registry.register(EMBEDDING_BACKWARD_OP)(_embedding_dense_backward)


def _embedding_dense_backward(ctx: EmulationContext) -> Any:
    # Schema: (grad_output, indices, num_weights, padding_idx, scale_grad_by_freq).
    indices = ctx.args[1]
    scale_grad_by_freq = bool(ctx.args[4]) if len(ctx.args) > 4 else False
    scale_grad_by_freq = bool(ctx.kwargs.get("scale_grad_by_freq", scale_grad_by_freq))
    num_indices = indices.numel()
    if not stands_for_cuda(indices) or (
        num_indices <= SMALL_PATH_MAX_INDICES and not scale_grad_by_freq
    ):
        return ctx.run()
    index_bytes = num_indices * indices.element_size()
    ids = [
        ctx.allocate(index_bytes, "temporary", "embedding_sorted_indices"),
        ctx.allocate(index_bytes, "temporary", "embedding_orig_indices"),
    ]
    if scale_grad_by_freq:
        ids.append(ctx.allocate(index_bytes, "temporary", "embedding_count"))
    # embedding_backward_cuda_kernel allocates grad_weight last, while the indices still live.
    out = ctx.run()
    ctx.record_outputs(out)
    for alloc_id in reversed(ids):
        ctx.free(alloc_id)
    return out

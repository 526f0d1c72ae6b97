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

from oomkit.prediction.tracing.emulation_sites import EMBEDDING_BACKWARD_SITE, SITE_PLANS
from oomkit.prediction.tracing.fake_storages import stands_for_cuda

if TYPE_CHECKING:
    from oomkit.prediction.tracing.emulation import EmulationContext, EmulationRegistry

__all__ = ["EMBEDDING_BACKWARD_OP", "register_embedding"]

# The path's limit (3,072 indices, Embedding.cu) is emulation_sites.py's, with its temporaries.
EMBEDDING_BACKWARD_OP = SITE_PLANS[EMBEDDING_BACKWARD_SITE].op


def register_embedding(registry: EmulationRegistry) -> None:
    """Add the ``embedding_dense_backward`` hook to ``registry``."""
    registry.register(EMBEDDING_BACKWARD_OP)(_embedding_dense_backward)


def _embedding_dense_backward(ctx: EmulationContext) -> Any:
    # Schema: (grad_output, indices, num_weights, padding_idx, scale_grad_by_freq).
    indices = ctx.args[1]
    scale_grad_by_freq = bool(ctx.args[4]) if len(ctx.args) > 4 else False
    scale_grad_by_freq = bool(ctx.kwargs.get("scale_grad_by_freq", scale_grad_by_freq))
    if not stands_for_cuda(indices):
        return ctx.run()
    # The path and its temporaries, from the sizes (emulation_sites.py), noted as a site on
    # either path so that a batch search can synthesize the other one.
    params = (indices.numel(), indices.element_size(), int(scale_grad_by_freq))
    plan = SITE_PLANS[EMBEDDING_BACKWARD_SITE]
    ids = [ctx.allocate(nbytes, "temporary", what) for what, nbytes in plan.temporaries(params)]
    # embedding_backward_cuda_kernel allocates grad_weight last, while the indices still live.
    out = ctx.run()
    ctx.record_outputs(out)
    ctx.note_site(EMBEDDING_BACKWARD_SITE, params, out)
    for alloc_id in reversed(ids):
        ctx.free(alloc_id)
    return out

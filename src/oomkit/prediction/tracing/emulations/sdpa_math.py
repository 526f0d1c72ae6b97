"""SDPA's math path as CUDA runs it: the mask added to the scores in place.

When CUDA picks no fused kernel (fp32 grouped-query attention on sm90, a mask with a grad...),
``scaled_dot_product_attention`` runs ``_scaled_dot_product_attention_math``
(aten/src/ATen/native/transformers/attention.cpp), a composite the recorder sees op by op. Its
mask add is ``attn.add_(*attn_mask)`` in place, unless ``at::areAnyTensorSubclassLike({attn,
*attn_mask})``, when ``attn = attn.add(*attn_mask)``. The recorder's fake tensors are
subclass-like, so it recorded a second scores-sized buffer that no GPU allocates (8 MiB a layer
for Llama 1B fp32 at 256 tokens; measured on an H200, torch 2.11). While the math path runs
(``math_attention``, entered by ``emulations/sdpa.py``) the add's output shares the scores'
storage, as the in-place add leaves it. Not where the inputs are DTensors (tensor or context
parallel): they are subclass-like on a GPU too. The path's softmax is ``softmax.py``'s.

Not emulated: with ``dropout_p > 0`` the math path calls ``at::dropout``, which on CUDA is the
fused kernel (a 1-byte mask) and on meta a noise tensor of the scores' dtype
(``emulations/dropout.py`` covers ``F.dropout`` only): the recording then holds 3 bytes more
per score (fp32) for the dropout's mask.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import torch

from oomkit.prediction.tracing.fake_storages import stands_for_cuda

if TYPE_CHECKING:
    from oomkit.prediction.tracing.emulation import EmulationContext

__all__ = ["math_attention", "math_mask_add"]

# The mask add rides on aten.add.Tensor's one hook: emulations/input_buffer.py asks
# math_mask_add first.
_STATE_KEY = "sdpa_math_attention"


@contextlib.contextmanager
def math_attention(ctx: EmulationContext, *tensors: Any) -> Iterator[None]:
    """While open, the math path of one SDPA call runs: its mask add is in place, as on CUDA,
    unless one of ``tensors`` (q, k, v, mask) is a DTensor (subclass-like on a GPU too)."""
    from torch.distributed.tensor import DTensor

    plain = not any(isinstance(t, DTensor) for t in tensors)
    before = ctx.state.get(_STATE_KEY, False)
    ctx.state[_STATE_KEY] = plain
    try:
        yield
    finally:
        ctx.state[_STATE_KEY] = before


def math_mask_add(ctx: EmulationContext) -> Any | None:
    """The math path's ``attn + mask`` with the scores' storage kept (``attn.add_``), or
    ``None`` when this ``aten.add.Tensor`` is not that add."""
    if not ctx.state.get(_STATE_KEY) or len(ctx.args) != 2 or ctx.kwargs:
        return None
    attn, mask = ctx.args
    if not isinstance(attn, torch.Tensor) or not isinstance(mask, torch.Tensor):
        return None
    if not stands_for_cuda(attn):
        return None
    out = ctx.run()
    if isinstance(out, torch.Tensor) and out.shape == attn.shape and out.dtype == attn.dtype:
        # set_ points the output at the scores' storage before the engine sees the output, so
        # the meta kernel's new storage is never recorded (as collectives.py's wait_tensor).
        cast(Any, out).set_(attn)
    return out

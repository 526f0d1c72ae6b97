"""Adds that CUDA makes in place inside a composite, out of place for the recorder's tensors.

Two composites the recorder sees op by op end with an add that their C++ makes in place unless
a tensor is subclass-like (``at::isTensorSubclassLike``), which the recorder's fake tensors are:

- **SDPA's math path** (aten/src/ATen/native/transformers/attention.cpp
  ``_scaled_dot_product_attention_math``, which CUDA runs where no fused kernel applies: fp32
  grouped-query attention on sm90, a mask with a grad...): ``attn.add_(*attn_mask)``, else
  ``attn = attn.add(*attn_mask)``. The recorder kept a second scores-sized buffer that no GPU
  allocates (8 MiB a layer for Llama 1B fp32 at 256 tokens; measured on an H200, torch 2.11).
- **``linear`` with a bias** on the ``matmul`` path (aten/src/ATen/native/Linear.cpp ``linear``:
  an input that is neither 2-D, for ``addmm``, nor contiguous, for ``_flatten_nd_linear``; e.g.
  ``nn.MultiheadAttention``'s ``batch_first`` inputs, transposed before their projections):
  ``output.add_(*bias)``, else ``output = at::add(output, *bias)``. Measured on an H200:
  torchvision's ViT-B/16 in-projection asked for its ``[197, 8, 2304]`` output once.

While such a composite runs (``in_place_adds``, entered by ``emulations/sdpa.py`` and by the
``F.linear`` hook here) its add's output shares the first operand's storage, as the in-place add
leaves it. Not where the tested operand is a DTensor (subclass-like on a GPU too: q, k, v or the
mask for SDPA, under context parallel; the bias for ``linear``, under tensor parallel), nor for
``linear`` with a forward-mode gradient on the bias (also out of place there).

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
import torch.autograd.forward_ad as fwad

from oomkit.prediction.tracing.fake_storages import stands_for_cuda

if TYPE_CHECKING:
    from oomkit.prediction.tracing.emulation import EmulationContext, EmulationRegistry

__all__ = ["LINEAR_FUNCTION", "composite_add", "in_place_adds", "register_linear"]

LINEAR_FUNCTION = "torch.nn.functional.linear"
# The adds ride on aten.add.Tensor's one hook: emulations/input_buffer.py asks composite_add
# first. The state holds what the open composite adds in place: None (nothing), "any" (the
# math path's one add), or the bias's shape (linear's).
_STATE_KEY = "in_place_adds"
_ANY = "any"


def register_linear(registry: EmulationRegistry) -> None:
    """Add the ``F.linear`` hook (its bias add in place, as CUDA makes it)."""
    registry.register(LINEAR_FUNCTION)(_linear)


@contextlib.contextmanager
def in_place_adds(ctx: EmulationContext, *tensors: Any, second: Any = _ANY) -> Iterator[None]:
    """While open, the composite's add (of a second operand shaped ``second``, or any) keeps its
    first operand's storage, unless one of ``tensors`` is a DTensor (subclass-like on a GPU)."""
    from torch.distributed.tensor import DTensor

    plain = not any(isinstance(t, DTensor) for t in tensors)
    before = ctx.state.get(_STATE_KEY)
    ctx.state[_STATE_KEY] = second if plain else None
    try:
        yield
    finally:
        ctx.state[_STATE_KEY] = before


def composite_add(ctx: EmulationContext) -> Any | None:
    """The open composite's add with its first operand's storage kept (``add_``), or ``None``
    when this ``aten.add.Tensor`` is not that add."""
    second = ctx.state.get(_STATE_KEY)
    if second is None or len(ctx.args) != 2 or ctx.kwargs:
        return None
    first, other = ctx.args
    if not isinstance(first, torch.Tensor) or not isinstance(other, torch.Tensor):
        return None
    if not stands_for_cuda(first) or (second != _ANY and tuple(other.shape) != second):
        return None
    out = ctx.run()
    if isinstance(out, torch.Tensor) and out.shape == first.shape and out.dtype == first.dtype:
        # set_ points the output at the first operand's storage before the engine sees the
        # output, so the meta kernel's new storage is never recorded (as collectives.py's
        # wait_tensor).
        cast(Any, out).set_(first)
    return out


def _linear(ctx: EmulationContext) -> Any:
    args = dict(zip(("input", "weight", "bias"), ctx.args, strict=False))
    args.update(ctx.kwargs)
    x, bias = args.get("input"), args.get("bias")
    if (
        not isinstance(bias, torch.Tensor)
        or not isinstance(x, torch.Tensor)
        or not stands_for_cuda(x)
        or _has_forward_grad(bias)
    ):
        return ctx.run()
    # Linear.cpp tests the bias alone (isTensorSubclassLike(*bias)): a DTensor bias (tensor
    # parallel) is added out of place on a GPU too; FSDP2's unsharded parameters are plain.
    with in_place_adds(ctx, bias, second=tuple(bias.shape)):
        return ctx.run()


def _has_forward_grad(tensor: torch.Tensor) -> bool:
    # Linear.cpp: bias->_fw_grad(0).defined() takes the out-of-place add.
    try:
        return fwad.unpack_dual(tensor).tangent is not None
    except RuntimeError:  # pragma: no cover - no forward-AD level open
        return False

"""Softmax on CUDA: ``_safe_softmax``'s temporaries, and the backward's ``grad * output``.

- **``_safe_softmax``** (the softmax SDPA's math path calls since pytorch#131844;
  aten/src/ATen/native/transformers/attention.cpp): on CUDA ``out = softmax(self)``,
  ``masked = self.isneginf()`` (1 byte per element), ``masked_rows = all(masked, dim,
  keepdim)`` (1 byte per row), ``zero = scalar_tensor(0)``, then ``where_out(out, masked_rows,
  zero, out)`` into ``out`` itself; the three temporaries are freed when it returns. Meta
  allocates the output alone. Measured on an H200 (torch 2.11, Llama 1B fp32): the softmax's
  output, 2 MiB, 8 KiB and 4 bytes, then the frees. Earlier forms of the function (torch
  2.5-2.6, before pytorch#139612 trimmed its peak) made a ``-inf`` scalar and an out-of-place
  ``where``, one more output-sized buffer at once, which is not modelled: on those versions the
  peak there may be one output higher. ``all``'s own multi-block staging is left out (none below
  131,072 elements per row).
- **``_softmax_backward_data``** (aten/src/ATen/native/cuda/SoftMax.cu
  ``softmax_backward_cuda_out``): ``Tensor tmp = grad * output;`` before the kernel, after the
  gradient's own output, freed when it returns: one more output-sized buffer (in the promoted
  dtype of ``grad`` and ``output``). Measured on an H200: Llama 1B fp32's attention backward
  asked for the 8 MiB gradient, then 8 MiB more. ``_log_softmax_backward_data`` has no such
  product.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from oomkit.prediction.tracing.fake_storages import stands_for_cuda

if TYPE_CHECKING:
    from oomkit.prediction.tracing.emulation import EmulationContext, EmulationRegistry

__all__ = ["SAFE_SOFTMAX_OP", "SOFTMAX_BACKWARD_OP", "register_softmax"]

SAFE_SOFTMAX_OP = "aten._safe_softmax.default"
SOFTMAX_BACKWARD_OP = "aten._softmax_backward_data.default"


def register_softmax(registry: EmulationRegistry) -> None:
    """Add the ``_safe_softmax`` and ``_softmax_backward_data`` hooks to ``registry``."""
    registry.register(SAFE_SOFTMAX_OP)(_safe_softmax)
    registry.register(SOFTMAX_BACKWARD_OP)(_softmax_backward_data)


def _arg(ctx: EmulationContext, index: int, name: str) -> Any:
    return ctx.args[index] if len(ctx.args) > index else ctx.kwargs[name]


def _safe_softmax(ctx: EmulationContext) -> Any:
    x = ctx.args[0] if ctx.args else None
    if not isinstance(x, torch.Tensor) or not stands_for_cuda(x) or x.numel() == 0:
        return ctx.run()
    dim = int(_arg(ctx, 1, "dim"))
    out = ctx.run()
    ctx.record_outputs(out)
    numel = x.numel()
    masked = ctx.allocate(numel, "temporary", "safe_softmax_neginf_mask")
    rows = ctx.allocate(numel // max(1, x.shape[dim]), "temporary", "safe_softmax_masked_rows")
    zero = ctx.allocate(out.element_size(), "temporary", "safe_softmax_zero")
    for alloc_id in (zero, rows, masked):  # locals destroyed last first
        ctx.free(alloc_id)
    return out


def _softmax_backward_data(ctx: EmulationContext) -> Any:
    grad, output = _arg(ctx, 0, "grad_output"), _arg(ctx, 1, "output")
    if (
        not isinstance(grad, torch.Tensor)
        or not isinstance(output, torch.Tensor)
        or not stands_for_cuda(grad)
        or grad.numel() == 0
    ):
        return ctx.run()
    out = ctx.run()
    ctx.record_outputs(out)
    numel = torch.broadcast_shapes(grad.shape, output.shape).numel()
    itemsize = torch.promote_types(grad.dtype, output.dtype).itemsize
    tmp = ctx.allocate(numel * itemsize, "temporary", "softmax_backward_product")
    ctx.free(tmp)
    return out

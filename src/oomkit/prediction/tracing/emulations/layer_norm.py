"""``native_layer_norm_backward`` on CUDA: a gradient that is not contiguous is copied first.

aten/src/ATen/native/cuda/layer_norm_kernel.cu ``LayerNormBackwardKernelImpl`` calls the
kernel with ``dY.contiguous()`` (the CPU kernel takes ``dY`` as it is), after
``layer_norm_backward_cuda`` has allocated ``dX``, ``dgamma`` and ``dbeta``; the copy is
dropped when the kernel is queued. Meta allocates the outputs alone. A layer norm whose output
goes through a transpose gets such a gradient: torchvision's ViT, whose ``ln_1`` feeds
``nn.MultiheadAttention``'s ``batch_first`` transpose, asked on an H200 for one 4,841,472-byte
copy (``[8, 197, 768]`` fp32) per block and step after ``ln_1``'s three gradients.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from oomkit.prediction.tracing.fake_storages import stands_for_cuda

if TYPE_CHECKING:
    from oomkit.prediction.tracing.emulation import EmulationContext, EmulationRegistry

__all__ = ["LAYER_NORM_BACKWARD_OP", "register_layer_norm"]

LAYER_NORM_BACKWARD_OP = "aten.native_layer_norm_backward.default"


def register_layer_norm(registry: EmulationRegistry) -> None:
    """Add the ``native_layer_norm_backward`` hook to ``registry``."""
    registry.register(LAYER_NORM_BACKWARD_OP)(_layer_norm_backward)


def _layer_norm_backward(ctx: EmulationContext) -> Any:
    # Schema: (grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask).
    grad = ctx.args[0] if ctx.args else None
    if (
        not isinstance(grad, torch.Tensor)
        or not stands_for_cuda(grad)
        or grad.is_contiguous()
        or grad.numel() == 0  # M == 0 or N == 0: no kernel
    ):
        return ctx.run()
    out = ctx.run()
    # dX, dgamma, dbeta exist before the kernel's copy of dY.
    ctx.record_outputs([t for t in out if isinstance(t, torch.Tensor)])
    ctx.free(ctx.allocate(grad.numel() * grad.element_size(), "temporary", "layer_norm_grad_copy"))
    return out

"""``F.rms_norm`` on CUDA: the fused kernel, what its autograd keeps, and its backward's temporaries.

Since torch 2.9 ``rms_norm`` (aten/src/ATen/native/layer_norm.cpp ``rms_norm_symint``) calls
``at::_fused_rms_norm`` on CUDA unless the input is channels-last or complex or the weight's
dtype differs from the input's (then it warns once: "Mismatch dtype between input and weight
... Cannot dispatch to fused implementation", a string 2.9.0's libtorch_cpu.so holds). There the op has a kernel of its own
(layer_norm_kernel.cu ``_fused_rms_norm_cuda``: ``Y = empty_like(X)`` and an fp32 ``rstd`` of
one value per row, after ``input.expect_contiguous()``, a copy only where the input is not
contiguous), so its autograd formula applies (derivatives.yaml: it saves ``input``, ``weight``
and ``rstd``; backward is ``_fused_rms_norm_backward``). Meta has no kernel for it: its
CompositeImplicitAutograd kernel (``rms_norm_composite``) fills the autograd slot, and the
composite's ops are what a plain recording holds for backward, the normalised product (1x
the input's bytes) and, for bf16 or fp16 input, fp32 copies of the input and of that product
(4x). Before 2.9 CUDA ran the composite too: 2.7.1's wheel has no ``_fused_rms_norm``, and
2.8.0's declares it with no CUDA kernel and no backward op (its include/ATen/ops holds no
``_fused_rms_norm_cuda_dispatch.h`` or ``_fused_rms_norm_backward.h``; 2.9.0's holds both).

Here, for a target torch of 2.9 or later:

- ``torch.nn.functional.rms_norm`` (``nn.RMSNorm``'s forward) runs as a ``torch.autograd.Function``
  that calls ``aten._fused_rms_norm`` below autograd, so the op reaches the recorder whole (its
  outputs, ``Y`` then ``rstd``, as the CUDA kernel's) and saves what derivatives.yaml saves;
  its backward calls ``aten._fused_rms_norm_backward`` as the formula does (grad mode off: no
  double backward). Under CUDA autocast the input is first cast as autocast casts it
  (``rms_norm`` is in the fp32 list since 2.12, ``autocast_policy.ADDED_IN``).
- ``aten._fused_rms_norm``: the input's and the weight's contiguous copies before the outputs,
  freed when it returns.
- ``aten._fused_rms_norm_backward`` (``_fused_rms_norm_backward_cuda``): the contiguous copies,
  then ``dX`` and ``dgamma``, then ``RMSNormBackwardKernelImpl``'s ``dY.contiguous()``; where
  there are more than 65,536 rows and ``N / 32 < SMs / 2``
  (``LaunchGammaBetaBackwardCUDAKernel``), the two-pass weight gradient:
  ``dgamma_blocks = empty({blocks.y, dgamma->size(-1)})`` of partial sums, then ``*dgamma =
  dgamma_blocks.sum(0)`` (a new tensor, with the reduction's own staging; the first ``dgamma``
  is freed on assignment), ``dgamma_blocks`` freed at the end of its scope: layer norm's kernels
  and layer_norm.py's ``weight_gradients``, with its batch-search site.

Left as meta runs them (the composite, as CUDA runs it or as close as the recorder gets): a
DTensor input or weight (tensor parallel's sequence-parallel norms; said in the recording's
warnings), compiled code (Inductor writes its own kernel), channels-last or complex input, a
weight of another dtype, ``torch.rms_norm`` called directly.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

import torch
from torch._prims_common import suggest_memory_format
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from oomkit.prediction.tracing._torch_version import torch_minor
from oomkit.prediction.tracing.autocast_policy import ADDED_IN
from oomkit.prediction.tracing.emulations.layer_norm import weight_gradients
from oomkit.prediction.tracing.emulations.reductions import LOW_PRECISION
from oomkit.prediction.tracing.fake_storages import stands_for_cuda

if TYPE_CHECKING:
    from oomkit.prediction.tracing.emulation import EmulationContext, EmulationRegistry

__all__ = [
    "FUSED_RMS_NORM_BACKWARD_OP",
    "FUSED_RMS_NORM_OP",
    "FUSED_SINCE",
    "RMS_NORM_FUNCTION",
    "register_rms_norm",
]

RMS_NORM_FUNCTION = "torch.nn.functional.rms_norm"
FUSED_RMS_NORM_OP = "aten._fused_rms_norm.default"
FUSED_RMS_NORM_BACKWARD_OP = "aten._fused_rms_norm_backward.default"
# The first release with _fused_rms_norm's CUDA kernel and backward (the PyPI wheels'
# include/ATen/ops: 2.9.0 has _fused_rms_norm_cuda_dispatch.h, 2.8.0 does not).
FUSED_SINCE = (2, 9)
_PARAMS = ("input", "normalized_shape", "weight", "eps")
_COPY = "rms_norm_contiguous_copy"


def register_rms_norm(registry: EmulationRegistry, *, torch_version: str | None = None) -> None:
    """Add the ``F.rms_norm``, ``_fused_rms_norm`` and backward hooks to ``registry``, for the
    target's torch (``None``: this install's)."""
    minor = torch_minor(torch_version or torch.__version__) or (99, 0)
    # This install runs the recording: it needs both ops (2.8 declares the forward alone).
    fused = minor >= FUSED_SINCE and all(
        hasattr(torch.ops.aten, op) for op in ("_fused_rms_norm", "_fused_rms_norm_backward")
    )
    autocast_fp32 = minor >= ADDED_IN["rms_norm"]
    registry.register(RMS_NORM_FUNCTION)(
        functools.partial(_rms_norm, fused=fused, autocast_fp32=autocast_fp32)
    )
    registry.register(FUSED_RMS_NORM_OP)(_fused_rms_norm)
    registry.register(FUSED_RMS_NORM_BACKWARD_OP)(_fused_rms_norm_backward)


def _plain_cuda(tensor: Any) -> bool:
    """A tensor the fused path takes here: standing for CUDA memory (meta, or a fake tensor of
    the fake device), not a wrapper subclass such as DTensor (whose own dispatch would split the
    op) or a compiled graph's functional tensor."""
    return (
        isinstance(tensor, torch.Tensor)
        and not isinstance(tensor, FunctionalTensor)
        and not is_traceable_wrapper_subclass(tensor)
        and stands_for_cuda(tensor)
    )


def _autocast_dtype(tensor: Any, autocast_fp32: bool) -> torch.dtype | None:
    """The dtype ``tensor`` reaches the op in: autocast_mode.cpp ``cached_cast(kFloat, ...)``
    casts a floating, non-double CUDA tensor to fp32 where ``rms_norm`` is on the fp32 list."""
    if not isinstance(tensor, torch.Tensor):
        return None
    if autocast_fp32 and torch.is_autocast_enabled("cuda") and tensor.dtype in LOW_PRECISION:
        return torch.float32
    return tensor.dtype


def _rms_norm(ctx: EmulationContext, *, fused: bool, autocast_fp32: bool) -> Any:
    bound: dict[str, Any] = {"weight": None, "eps": None}
    bound.update(zip(_PARAMS, ctx.args, strict=False))
    bound.update(ctx.kwargs)
    x, weight = bound["input"], bound["weight"]
    if not fused or torch.compiler.is_compiling():
        return ctx.run()
    if not _plain_cuda(x) or (weight is not None and not _plain_cuda(weight)):
        if any(
            is_traceable_wrapper_subclass(t) and not isinstance(t, FunctionalTensor)
            for t in (x, weight)
        ):
            ctx.not_emulated(
                "CUDA's fused kernel for DTensor inputs (tensor parallel's sequence-parallel "
                "norms): recorded as the composite, which keeps 1x (fp32) to 4x (bf16) the "
                "input's bytes more until backward"
            )
        return ctx.run()
    dtype = _autocast_dtype(x, autocast_fp32)
    if (
        x.is_complex()
        or suggest_memory_format(x) in (torch.channels_last, torch.channels_last_3d)
        or (weight is not None and _autocast_dtype(weight, autocast_fp32) != dtype)
    ):
        return ctx.run()  # rms_norm_symint's composite fallbacks, as on CUDA
    if dtype != x.dtype:
        x = x.to(dtype)
    if weight is not None and weight.dtype != dtype:
        weight = weight.to(dtype)
    shape = bound["normalized_shape"]
    shape = [shape] if isinstance(shape, int) else list(shape)
    return _FusedRmsNorm.apply(x, weight, shape, bound["eps"])


class _FusedRmsNorm(torch.autograd.Function):
    """``_fused_rms_norm`` with derivatives.yaml's formula: saves input, weight and rstd."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, shape: list[int], eps: Any
    ) -> torch.Tensor:
        with torch._C._AutoDispatchBelowAutograd():
            y, rstd = torch.ops.aten._fused_rms_norm.default(x, shape, weight, eps)
        ctx.normalized_shape = shape
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[Any, ...]:
        x, weight, rstd = ctx.saved_tensors
        if grad is None:
            return None, None, None, None
        mask = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[1]]
        dx, dweight = torch.ops.aten._fused_rms_norm_backward.default(
            grad, x, ctx.normalized_shape, rstd, weight, mask
        )
        return dx, dweight, None, None


def _fused_rms_norm(ctx: EmulationContext) -> Any:
    # Schema: (input, normalized_shape, weight, eps) -> (Y, rstd).
    x = ctx.args[0] if ctx.args else None
    if not isinstance(x, torch.Tensor) or not stands_for_cuda(x):
        return ctx.run()
    weight = ctx.args[2] if len(ctx.args) > 2 else ctx.kwargs.get("weight")
    copies = ctx.contiguous_copies(_COPY, x, weight)
    out = ctx.run()
    ctx.record_outputs(list(out))
    ctx.free_last_first(copies)
    return out


def _fused_rms_norm_backward(ctx: EmulationContext) -> Any:
    # Schema: (grad_out, input, normalized_shape, rstd, weight, output_mask) -> (dX, dgamma).
    grad, x = ctx.args[0], ctx.args[1]
    if not isinstance(x, torch.Tensor) or not stands_for_cuda(x) or x.numel() == 0:
        return ctx.run()
    weight = ctx.args[4] if len(ctx.args) > 4 else ctx.kwargs.get("weight")
    copies = ctx.contiguous_copies(_COPY, x, weight)
    dx, dgamma = ctx.run()
    ctx.record_outputs(dx)
    # RMSNormBackwardKernelImpl: dY.contiguous(), then layer norm's gamma kernels (the fused op
    # exists from 2.9, after their two-pass branch).
    weight_gradients(ctx, x, math.prod(ctx.args[2]), dgamma, None, grad, two_pass=True)
    ctx.free_last_first(copies)
    return dx, dgamma

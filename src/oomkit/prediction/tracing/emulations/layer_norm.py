"""Layer norm on CUDA: the contiguous copies and two-pass gradients its kernels make, not meta's.

aten/src/ATen/native/cuda/layer_norm_kernel.cu:

- ``layer_norm_cuda`` takes ``input.expect_contiguous()``, ``weight.expect_contiguous()`` and
  ``bias.expect_contiguous()`` (a copy of each that is not contiguous) before ``Y``, ``mean``
  and ``rstd``, and drops them when it returns (C++ destroys them last first).
- ``layer_norm_backward_cuda`` takes the same three copies, then allocates ``dX``, ``dgamma``
  and ``dbeta``; ``LayerNormBackwardKernelImpl`` runs the kernels on ``dY.contiguous()``,
  dropped when they are queued. A layer norm whose output goes through a transpose gets such a
  gradient: torchvision's ViT, whose ``ln_1`` feeds ``nn.MultiheadAttention``'s ``batch_first``
  transpose, asked on an H200 for one 4,841,472-byte copy (``[8, 197, 768]`` fp32) per block
  and step after ``ln_1``'s three gradients.
- Past 65,536 rows, where ``N / 32 < SMs / 2``, ``LaunchGammaBetaBackwardCUDAKernel`` computes
  the weight and bias gradients in two passes: ``dgamma_blocks`` and ``dbeta_blocks`` of
  partial sums (``{blocks.y, dgamma->size(-1)}`` each, ``blocks.y`` as
  ``emulation_sites.two_pass_gamma_rows``), then ``*dgamma = dgamma_blocks.sum(0)`` and ``*dbeta =
  dbeta_blocks.sum(0)``: new tensors, each with the reduction's own staging, the first
  ``dgamma`` and ``dbeta`` released by the assignments; the partial sums are dropped at the end
  of their scope (``dbeta_blocks`` first). The kernel family came with pytorch#148605
  (reapplied as #150625): 2.8.0's libtorch_cuda.so holds ``GammaBetaBackwardCUDAKernelTemplate``
  and 2.7.1's does not, so targets before 2.8 reduce in one pass. Their order, with the
  ``dY.contiguous()`` copy's, is a site's program
  (``emulation_sites.gamma_beta_backward_program``), noted on both paths, so that a batch
  search learning below 65,536 rows synthesizes the sizes above (ViT's ``ln_1`` has the copy).

``_fused_rms_norm`` reuses these kernels (emulations/rms_norm.py uses the helpers here).
Where this may differ: with a multi-dimensional ``normalized_shape`` past 65,536 rows CUDA sizes
the partial sums by its last dimension while its kernel writes ``N`` columns (ROCm/pytorch#3564
reports it); the buffers are recorded as sized. A bias without a weight past 65,536 rows reads
``dgamma->size(-1)`` of an undefined ``dgamma`` on CUDA; here the bias's width is used.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

import torch

from oomkit.prediction.tracing._torch_version import torch_minor
from oomkit.prediction.tracing.emulation_sites import (
    GAMMA_BETA_BACKWARD_SITE,
    NORM_GRAD_COPY,
    GammaBetaBackward,
    SiteStep,
    gamma_beta_backward_program,
)
from oomkit.prediction.tracing.emulations.reductions import LOW_PRECISION, OPMATH_BYTES
from oomkit.prediction.tracing.fake_storages import stands_for_cuda

if TYPE_CHECKING:
    from oomkit.prediction.tracing.emulation import EmulationContext, EmulationRegistry

__all__ = [
    "LAYER_NORM_BACKWARD_OP",
    "LAYER_NORM_OP",
    "TWO_PASS_SINCE",
    "register_layer_norm",
    "weight_gradients",
]

LAYER_NORM_OP = "aten.native_layer_norm.default"
LAYER_NORM_BACKWARD_OP = "aten.native_layer_norm_backward.default"
# The first release with LaunchGammaBetaBackwardCUDAKernel's two-pass branch (pytorch#148605,
# reapplied in April 2025 as #150625; 2.8.0's libtorch_cuda.so has its kernel template, 2.7.1's
# does not).
TWO_PASS_SINCE = (2, 8)


def register_layer_norm(registry: EmulationRegistry, *, torch_version: str | None = None) -> None:
    """Add the ``native_layer_norm`` and backward hooks to ``registry``, for the target's torch
    (``None``: this install's)."""
    minor = torch_minor(torch_version or torch.__version__) or (99, 0)
    registry.register(LAYER_NORM_OP)(_layer_norm)
    registry.register(LAYER_NORM_BACKWARD_OP)(
        functools.partial(_layer_norm_backward, two_pass=minor >= TWO_PASS_SINCE)
    )


def weight_gradients(
    ctx: EmulationContext,
    x: torch.Tensor,
    columns: int,
    dgamma: torch.Tensor | None,
    dbeta: torch.Tensor | None,
    grad: torch.Tensor,
    *,
    two_pass: bool,
) -> None:
    """Record the weight and bias gradients a CUDA norm backward returns (``dgamma``, ``dbeta``:
    ``None`` where not computed), after ``dX``, with ``dY.contiguous()`` of a ``grad`` that is
    not contiguous and, where ``LaunchGammaBetaBackwardCUDAKernel`` takes two passes
    (``two_pass``: the target's torch has the branch), its temporaries: all by the site's program
    (emulation_sites.py ``gamma_beta_backward_program``), each step before or after the output
    it is placed beside. Notes the site, anchored at the first gradient, on either path, so a
    batch search learning on one side of 65,536 rows synthesizes the other."""
    gradients = [g for g in (dgamma, dbeta) if g is not None]
    if not gradients:  # the kernels on dY.contiguous(), and nothing to plan
        ctx.free_last_first(ctx.contiguous_copies(NORM_GRAD_COPY, grad))
        return
    assert ctx.gpu is not None
    first = gradients[0]
    site = GammaBetaBackward(
        rows=x.numel() // columns,
        columns=columns,
        width=first.shape[-1],  # dgamma->size(-1)
        multiprocessor_count=ctx.gpu.kernel_multiprocessor_count,
        max_threads_per_multiprocessor=ctx.gpu.kernel_max_threads_per_multiprocessor,
        element_bytes=first.element_size(),
        arg_bytes=OPMATH_BYTES.get(first.dtype, 8),
        accumulates_in_output=int(first.dtype not in LOW_PRECISION),
        dgamma_bytes=0 if dgamma is None else dgamma.numel() * dgamma.element_size(),
        dbeta_bytes=0 if dbeta is None else dbeta.numel() * dbeta.element_size(),
        grad_copy_bytes=0 if grad.is_contiguous() else grad.numel() * grad.element_size(),
        two_pass_branch=int(two_pass),
    )
    params = site.params()
    steps = gamma_beta_backward_program(params)
    ids: dict[str, int] = {}
    for offset, gradient in enumerate(gradients):
        for step in steps:
            if step.offset == offset and not step.after:
                _run(ctx, step, ids)
        ctx.record_outputs(gradient)  # the one-pass output, or the two-pass .sum(0)
        if offset == 0:
            ctx.note_site(GAMMA_BETA_BACKWARD_SITE, params, gradient)
        for step in steps:
            if step.offset == offset and step.after:
                _run(ctx, step, ids)


def _run(ctx: EmulationContext, step: SiteStep, ids: dict[str, int]) -> None:
    """One step of a site's program: allocate its temporary (kept in ``ids`` by name) or free it."""
    if step.action == "alloc":
        ids[step.name] = ctx.allocate(step.nbytes, "temporary", step.name)
    else:
        ctx.free(ids.pop(step.name))


def _layer_norm(ctx: EmulationContext) -> Any:
    # Schema: (input, normalized_shape, weight, bias, eps) -> (Y, mean, rstd).
    x = ctx.args[0] if ctx.args else None
    if not isinstance(x, torch.Tensor) or not stands_for_cuda(x):
        return ctx.run()
    weight = ctx.args[2] if len(ctx.args) > 2 else ctx.kwargs.get("weight")
    bias = ctx.args[3] if len(ctx.args) > 3 else ctx.kwargs.get("bias")
    copies = ctx.contiguous_copies("layer_norm_contiguous_copy", x, weight, bias)
    if not copies:
        return ctx.run()
    out = ctx.run()
    ctx.record_outputs(list(out))
    ctx.free_last_first(copies)
    return out


def _layer_norm_backward(ctx: EmulationContext, *, two_pass: bool) -> Any:
    # Schema: (grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask).
    grad, x = ctx.args[0], ctx.args[1]
    if (
        not isinstance(x, torch.Tensor)
        or not isinstance(grad, torch.Tensor)
        or not stands_for_cuda(x)
        or x.numel() == 0  # M == 0 or N == 0: no kernel
    ):
        return ctx.run()
    weight, bias = (ctx.args[i] if len(ctx.args) > i else None for i in (5, 6))
    copies = ctx.contiguous_copies("layer_norm_contiguous_copy", x, weight, bias)
    dx, dgamma, dbeta = out = ctx.run()
    ctx.record_outputs([t for t in (dx,) if t is not None])
    weight_gradients(ctx, x, math.prod(ctx.args[2]), dgamma, dbeta, grad, two_pass=two_pass)
    ctx.free_last_first(copies)
    return out

"""``torch._grouped_mm`` (a mixture of experts' matmuls) outside bfloat16: CUDA's fallback.

torch's meta kernel takes bfloat16 inputs only (torch/_meta_registrations.py
``_meta_grouped_mm_common``: "Expected inputs of BF16 type"), as an older ``_grouped_mm_cuda``
did. The CUDA kernel takes float32, bfloat16 and float16 (aten/src/ATen/native/GroupedMMUtils.h
``_grouped_mm_validate_inputs``): bfloat16 on sm90 / sm100 runs the CUTLASS grouped GEMM, any
other ``_grouped_mm_fallback``, one ``mm_out`` per group into the output, its offsets read on
the host (aten/src/ATen/native/cuda/GroupedBlas.cpp ``_grouped_mm_cuda``). transformers 5 runs
MoE experts through it by default (``experts_implementation="grouped_mm"``), and autocast
leaves it in the weights' dtype, so fp32 and bf16-mixed MoE training stopped on meta where a
GPU runs.

For float32 and float16 the hook returns what the kernel allocates, its output alone
(``create_grouped_gemm_output_tensor``): ``[tokens, N]`` for 2-D x 3-D (the MoE case),
``[groups, M, N]`` for 2-D x 2-D and 3-D x 3-D, ``[M, tokens]`` for 3-D x 2-D, in the input's
dtype, the last dimension's stride padded to 16 bytes (for TMA). bfloat16 keeps meta's kernel;
inputs the kernel refuses raise its own message.

Where it may differ: the ``mm_out`` calls use cuBLAS's workspace, which the model's other
matmuls have allocated already on the same stream.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from oomkit.prediction.tracing.emulation import EmulationContext, EmulationRegistry

__all__ = ["GROUPED_MM_OP", "register_grouped_mm"]

GROUPED_MM_OP = "aten._grouped_mm.default"
# GroupedMMUtils.h _grouped_mm_validate_inputs: the dtypes the CUDA kernel takes.
_TAKEN = (torch.float32, torch.bfloat16, torch.float16)


def register_grouped_mm(registry: EmulationRegistry) -> None:
    """Add the ``_grouped_mm`` hook to ``registry``."""
    registry.register(GROUPED_MM_OP)(_grouped_mm)


def _argument(ctx: EmulationContext, index: int, name: str) -> Any:
    # _grouped_mm(Tensor self, Tensor mat2, Tensor? offs=None, Tensor? bias=None,
    #             ScalarType? out_dtype=None)
    return ctx.args[index] if len(ctx.args) > index else ctx.kwargs.get(name)


def _grouped_mm(ctx: EmulationContext) -> Any:
    a, b = ctx.args[0], ctx.args[1]
    offs = _argument(ctx, 2, "offs")
    out_dtype = _argument(ctx, 4, "out_dtype") or a.dtype
    a_2d, b_2d = a.dim() == 2, b.dim() == 2
    if a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16:
        return ctx.run()  # meta's own kernel
    # What GroupedMMUtils.h refuses, in its words (meta's would only ask for bfloat16).
    refused = (
        "Expected mat_a and mat_b to be Float32, BFloat16 or Float16 matrices"
        if a.dtype not in _TAKEN or b.dtype not in _TAKEN
        else "mat_a and mat_b have to be 2 or 3d" if {a.dim(), b.dim()} - {2, 3}
        else "Grouped gemm output dtype must match `mat_a` dtype" if out_dtype != a.dtype
        else "Have to provide offsets if there is a 2d matrix, or no offset if both matrices "
        "are 3d" if (offs is None) == (a_2d or b_2d)
        else "Bias not supported yet" if _argument(ctx, 3, "bias") is not None
        else None
    )
    if refused is not None:
        raise RuntimeError(refused)
    if a_2d:
        shape = [offs.shape[0], a.shape[0], b.shape[1]] if b_2d else [a.shape[0], b.shape[-1]]
    else:
        shape = [a.shape[1], b.shape[1]] if b_2d else [a.shape[0], a.shape[1], b.shape[-1]]
    # For TMA transfers the output's strides are 1 or multiples of 16 bytes.
    alignment = 16 // out_dtype.itemsize
    padded = -(-shape[-1] // alignment) * alignment
    stride = [padded, 1] if a_2d != b_2d else [shape[1] * padded, padded, 1]
    return torch.empty_strided(shape, stride, dtype=out_dtype, device=a.device)

"""``_foreach_norm`` on CUDA (gradient clipping): the per-chunk partial norms it stages.

``torch.nn.utils.clip_grad_norm_`` (and ``get_total_norm``, torchtitan's and the Hugging Face
Trainer's clipping through it) takes the norm of every gradient with one ``_foreach_norm`` per
device and dtype. aten/src/ATen/native/cuda/ForeachReduceOp.cu ``foreach_tensor_norm_cuda``
(torch 2.4 and later, every torch oomkit records on):

- on its fast route (``can_use_fast_route``, ForeachUtils.h: every tensor on one device, one
  dtype, strided, non-overlapping and dense; no integer or complex tensor; ``ord`` 1, 2 or
  inf) it first allocates ``output_per_tensor = at::zeros({ntensors * max_chunks_per_tensor})``
  in the output dtype's opmath type (float for half, bfloat16 and float; double for double),
  one partial result per 65,536-element chunk (``kChunkSize``, MultiTensorApply.cuh) of the
  tensor with the most chunks, for every tensor; then one 0-dim output per tensor
  (``empty_cuda({})``); ``multi_tensor_apply`` fills the partials and ``lpnorm_cleanup`` sums
  them into the outputs; ``output_per_tensor`` is freed when the function returns. Meta
  allocates the outputs alone. GPT-2 124M's 148 gradients (``wte``: 38,597,376 elements, 589
  chunks): 348,688 bytes of partials before the norms; a Llama 3 8B's 291 (the 128,256 x 4,096
  embedding, 8,016 chunks): 9,330,624 bytes.
- an empty tensor gets a fresh ``at::zeros({})`` for its norm after all the outputs, and as
  many of the outputs made first go unused and are freed with the partials. Emulated as that
  many 0-dim allocations before meta's outputs, freed before the partials: the same sizes in
  the same order; which of the equal-sized blocks is freed may differ.
- off the fast route it is ``foreach_tensor_norm_slow``, one ``linalg_vector_norm`` per tensor,
  recorded as meta runs it (those reductions' own staging is not emulated: ``reductions.py``).

No reduction's staging: the partials are all the extra memory the fast route asks for.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from oomkit.prediction.tracing.emulations.reductions import OPMATH_BYTES
from oomkit.prediction.tracing.fake_storages import stands_for_cuda
from oomkit.prediction.tracing.reduce_config import non_overlapping_and_dense

if TYPE_CHECKING:
    from oomkit.prediction.tracing.emulation import EmulationContext, EmulationRegistry

__all__ = ["FOREACH_NORM_OP", "foreach_norm_partials_bytes", "register_foreach_norm"]

FOREACH_NORM_OP = "aten._foreach_norm.Scalar"

# MultiTensorApply.cuh: `static constexpr int64_t kChunkSize = 65536;`
CHUNK_ELEMENTS = 65536


def register_foreach_norm(registry: EmulationRegistry) -> None:
    """Add the ``_foreach_norm`` hook to ``registry``."""
    registry.register(FOREACH_NORM_OP)(_foreach_norm)


def foreach_norm_partials_bytes(numels: list[int], out_dtype: torch.dtype) -> int:
    """The bytes of ``output_per_tensor``: ``ntensors * max_chunks_per_tensor`` partials in the
    opmath type of ``out_dtype`` (0 when every tensor is empty)."""
    max_chunks = max((math.ceil(n / CHUNK_ELEMENTS) for n in numels), default=0)
    return len(numels) * max_chunks * OPMATH_BYTES[out_dtype]


def _fast_route(tensors: list[Any], p: float) -> bool:
    """``foreach_tensor_norm_cuda``'s test for the multi-tensor kernel (see the module doc)."""
    first = tensors[0]
    if first.dtype not in OPMATH_BYTES or p not in (1.0, 2.0, math.inf):
        return False
    return all(
        t.device == first.device
        and t.dtype == first.dtype
        and t.layout == torch.strided
        and non_overlapping_and_dense(t.shape, t.stride())
        for t in tensors
    )


def _foreach_norm(ctx: EmulationContext) -> Any:
    args = ctx.args
    tensors = list(args[0]) if args else list(ctx.kwargs.get("self", ()))
    if (
        not tensors
        or not all(isinstance(t, torch.Tensor) and stands_for_cuda(t) for t in tensors)
    ):
        return ctx.run()
    ord_ = args[1] if len(args) > 1 else ctx.kwargs.get("ord", 2)
    dtype = args[2] if len(args) > 2 else ctx.kwargs.get("dtype")
    if not isinstance(ord_, (int, float)) or not _fast_route(tensors, float(ord_)):
        return ctx.run()
    out_dtype = dtype if dtype is not None else tensors[0].dtype
    if out_dtype not in OPMATH_BYTES:
        return ctx.run()  # torch refuses it (check_foreach_norm_dtype): meta says so too
    partials_bytes = foreach_norm_partials_bytes([t.numel() for t in tensors], out_dtype)
    partials = (
        ctx.allocate(partials_bytes, "temporary", "foreach_norm_partials")
        if partials_bytes
        else None
    )
    empties = sum(1 for t in tensors if t.numel() == 0)
    unused = [
        ctx.allocate(out_dtype.itemsize, "temporary", "foreach_norm_unused_result")
        for _ in range(empties)
    ]
    out = ctx.run()
    ctx.record_outputs(out)
    for alloc_id in unused:  # vec_res's unused tail, destroyed before output_per_tensor
        ctx.free(alloc_id)
    if partials is not None:
        ctx.free(partials)
    return out

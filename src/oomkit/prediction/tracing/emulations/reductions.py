"""``sum`` and ``mean`` on CUDA: the staging memory of a reduction split across thread blocks.

aten/src/ATen/native/cuda/Reduce.cuh ``gpu_reduce_kernel``: when its launch configuration
(``setReduceConfig``) splits each output's inputs across several blocks (``ctas_per_output >
1``, a "global reduce"), the kernel asks the caching allocator for a staging buffer
(``ReduceConfig::global_memory_size``) and one ``int`` semaphore per column of blocks
(``semaphore_size``) after the output exists, and drops both when the kernel is queued
(``semaphores`` first: C++ destroys locals in reverse order). A reduction too large for 32-bit
indexing runs once per sub-iterator (``with_32bit_indexing``), each with its own configuration
and staging; where the output cannot accumulate (bf16 or half in and out) those runs first share
an ``AccumulationBuffer`` of the output's extent in ``arg_t``. Meta allocates the output alone.

Which reductions ask for staging depends on the iteration geometry TensorIterator gives the
kernel, ported in ``reduce_config.py``: the output is viewed with its reduced dimensions at stride 0
(``review_reduce_result``), the dimensions are ordered fastest first with the reduced ones in
front (``TensorIteratorBase::reorder_dimensions``), neighbours that can be merged are merged
(``coalesce_dimensions``); then ``setReduceConfig`` as Reduce.cuh writes it, with the target's
SM count and resident threads per SM. The typical case is a bias or norm weight gradient: a
``[tokens, C]`` gradient summed over the tokens. Measured on an H200 (torch 2.11): GPT-2's
``c_proj`` bias gradient, ``[2048, 768]`` fp32 summed over 2,048 tokens, asked for 12 MiB of
staging and 24 bytes of semaphores; BERT's MLM head bias gradient ``[1024, 768]``, 6 MiB; a
Llama's ``[512, 2048]`` norm weight gradient none (one block per output).

``sum`` (``sum.default``, ``sum.dim_IntList``) and ``mean`` (``mean.default``, ``mean.dim``)
are emulated (ReduceSumProdKernel.cu, ReduceMomentKernel.cu: ``gpu_reduce_kernel<scalar_t,
out_t>`` with the default ``vt0 = input_vec_size = 4``; ``arg_t`` is float for half, bfloat16
and float, double for double, int64 for integer sums). ``make_reduction_from_out_ty`` casts the
input to the output's dtype first unless a half or bfloat16 input reduces into float: that copy
is allocated before the staging and freed after it (``x.sum()`` of a bool mask copies it to
int64).

``amax`` and ``amin`` (``amax.default``, ``amin.default``: ``max_values_stub``) and ``max()``
and ``min()`` of a whole tensor (``max.default``, ``min.default``: ``max_all_stub``) run
ReduceMaxValuesKernel.cu / ReduceMinValuesKernel.cu ``max_values_kernel_cuda_impl``:
``gpu_reduce_kernel<scalar_t, scalar_t>`` with ``MaxNanFunctor<acc_t>``, ``acc_t = scalar_t``,
so ``arg_t`` is the input's own type (half the staging of a bfloat16 sum of the same shape); the
input is never cast (``make_reduction(self, result, dim, keepdim, self.scalar_type())``).
``max()`` and ``min()`` (TensorCompare.cpp ``max``) make the output first, then run on
``self.contiguous()``: a copy of an input that is not contiguous, freed when they return. These
feed float8 training's scales (torchao's ``torch.max(torch.abs(x))`` and the rowwise recipe's
``torch.amax(..., dim)``). Other reductions (``max.dim``, ``norm``, ``var``, ``any``...) reach
the same kernel with other ``arg_t`` types and are not emulated: their staging, when they have
one, is missing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch._prims_common import make_contiguous_strides_for

from oomkit.prediction.tracing.emulation_sites import (
    REDUCTION_SITE,
    ReductionSite,
    staging_temporaries,
)
from oomkit.prediction.tracing.fake_storages import stands_for_cuda
from oomkit.prediction.tracing.reduce_config import non_overlapping_and_dense

if TYPE_CHECKING:
    from oomkit.prediction.tracing.emulation import EmulationContext, EmulationRegistry

__all__ = [
    "LOW_PRECISION",
    "OPMATH_BYTES",
    "EXTREME_ALL_OPS",
    "EXTREME_OPS",
    "REDUCTION_OPS",
    "record_reduction",
    "register_reductions",
    "reduction_site",
]

REDUCTION_OPS = (
    "aten.sum.default",
    "aten.sum.dim_IntList",
    "aten.mean.default",
    "aten.mean.dim",
)
# max_values_stub / min_values_stub (with dims) and max_all_stub / min_all_stub (everything).
EXTREME_OPS = ("aten.amax.default", "aten.amin.default")
EXTREME_ALL_OPS = ("aten.max.default", "aten.min.default")
# at::opmath_type (OpMathType.h): float for half, bfloat16 and float, double for double. It is
# the arg_t of sum_functor and MeanOps (ReduceSumProdKernel.cu, ReduceMomentKernel.cu; an
# integer sum accumulates in its int64 output) and the foreach norms' partials' type.
OPMATH_BYTES = {torch.float16: 4, torch.bfloat16: 4, torch.float32: 4, torch.float64: 8}
LOW_PRECISION = (torch.float16, torch.bfloat16)


def register_reductions(registry: EmulationRegistry) -> None:
    """Add the ``sum``, ``mean``, ``amax``, ``amin``, ``max()`` and ``min()`` hooks to
    ``registry``."""
    for op in REDUCTION_OPS:
        registry.register(op)(_reduction)
    for op in EXTREME_OPS:
        registry.register(op)(_extreme)
    for op in EXTREME_ALL_OPS:
        registry.register(op)(_extreme_of_all)


def reduction_site(
    x: torch.Tensor,
    out_dtype: torch.dtype,
    reduced: Sequence[int],
    *,
    multiprocessor_count: int,
    max_threads_per_multiprocessor: int,
    in_input_type: bool = False,
) -> ReductionSite | None:
    """What ``sum``/``mean`` of ``x`` over ``reduced`` (none: all) into ``out_dtype`` launches
    on CUDA (``in_input_type``: a reduction whose ``arg_t`` is the input's type, ``amax``'s);
    ``None`` for a complex input (not emulated)."""
    # make_reduction_from_out_ty (ReduceOpsUtils.h): the kernel reads the input in the output's
    # dtype, except a half or bfloat16 input reduced into float (cast inside the kernel).
    lowp_to_float = x.dtype in LOW_PRECISION and out_dtype == torch.float32
    in_dtype = x.dtype if lowp_to_float else out_dtype
    if in_dtype.is_complex:
        return None
    arg_bytes = in_dtype.itemsize if in_input_type else OPMATH_BYTES.get(in_dtype, 8)
    sizes, strides = tuple(x.shape), tuple(x.stride())
    offset_bytes, cast_bytes = int(x.storage_offset()) * x.element_size(), 0
    if in_dtype != x.dtype:
        # make_reduction's self.to(in_dtype) (preserve_format): a copy with the input's strides
        # where they tile memory densely, else contiguous.
        cast_bytes, offset_bytes = in_dtype.itemsize, 0
        if not non_overlapping_and_dense(sizes, strides):
            strides = tuple(make_contiguous_strides_for(sizes))
    ndim = len(sizes)
    mask = 0
    for d in reduced:
        mask |= 1 << (d % ndim if ndim else 0)
    return ReductionSite(
        multiprocessor_count=multiprocessor_count,
        max_threads_per_multiprocessor=max_threads_per_multiprocessor,
        arg_bytes=arg_bytes,
        scalar_bytes=in_dtype.itemsize,
        output_bytes=out_dtype.itemsize,
        cast_bytes=cast_bytes,
        accumulates_in_output=int(not (in_dtype == out_dtype and in_dtype in LOW_PRECISION)),
        offset_bytes=offset_bytes,
        reduced_mask=mask if ndim else 0,
        sizes=sizes,
        strides=strides,
    )


def _extreme(ctx: EmulationContext) -> Any:
    # Schema: (self, dim=[], keepdim=False); an empty dim reduces everything.
    x = ctx.args[0] if ctx.args else None
    if not isinstance(x, torch.Tensor) or not stands_for_cuda(x) or x.numel() == 0:
        return ctx.run()
    dims = ctx.args[1] if len(ctx.args) > 1 else ctx.kwargs.get("dim", [])
    out = ctx.run()
    if isinstance(out, torch.Tensor):
        reduced = [int(dims)] if isinstance(dims, int) else [int(d) for d in dims]
        record_reduction(ctx, x, out, reduced, in_input_type=True)
    return out


def _extreme_of_all(ctx: EmulationContext) -> Any:
    # TensorCompare.cpp max(self): result = at::empty({}), then max_all_stub on
    # self.contiguous() (a copy of a non-contiguous input, freed when it returns).
    x = ctx.args[0] if ctx.args else None
    if not isinstance(x, torch.Tensor) or not stands_for_cuda(x) or x.numel() == 0:
        return ctx.run()
    out = ctx.run()
    if not isinstance(out, torch.Tensor):
        return out
    ctx.record_outputs(out)
    copy = ctx.contiguous_copies("reduction_contiguous_copy", x)
    read = torch.empty(x.shape, dtype=x.dtype, device="meta") if copy else x
    record_reduction(ctx, read, out, [], in_input_type=True)
    ctx.free_last_first(copy)
    return out


def _reduced_dims(ctx: EmulationContext) -> list[int]:
    if ctx.op_name.endswith(".default"):
        return []
    dims = ctx.args[1] if len(ctx.args) > 1 else ctx.kwargs.get("dim")
    if dims is None:
        return []
    return [int(dims)] if isinstance(dims, int) else [int(d) for d in dims]


def _reduction(ctx: EmulationContext) -> Any:
    x = ctx.args[0] if ctx.args else None
    if not isinstance(x, torch.Tensor) or not stands_for_cuda(x) or x.numel() == 0:
        return ctx.run()  # sum_out / mean_out launch nothing for an empty input
    out = ctx.run()
    if isinstance(out, torch.Tensor):
        record_reduction(ctx, x, out, _reduced_dims(ctx))
    return out


def record_reduction(
    ctx: EmulationContext,
    x: torch.Tensor,
    out: torch.Tensor,
    reduced: Sequence[int],
    *,
    in_input_type: bool = False,
) -> None:
    """Record ``out`` (a ``sum``/``mean`` of ``x`` over ``reduced``, none: all; with
    ``in_input_type`` a reduction accumulating in the input's type) as allocated now, then the
    kernel's temporaries, freed at once; a site where they are held together. For a hook whose
    op reduces inside (``convolution_backward``'s bias gradient) too."""
    if x.numel() == 0 or not all(
        type(n) is int for n in (*x.shape, *x.stride(), x.storage_offset())
    ):
        return  # nothing launched, or symbolic sizes (a graph being traced, not run)
    assert ctx.gpu is not None
    site = reduction_site(
        x,
        out.dtype,
        reduced,
        multiprocessor_count=ctx.gpu.kernel_multiprocessor_count,
        max_threads_per_multiprocessor=ctx.gpu.kernel_max_threads_per_multiprocessor,
        in_input_type=in_input_type,
    )
    if site is None:
        return
    # The structured kernel's output exists before the implementation casts or launches.
    ctx.record_outputs(out)
    launches = site.launches()
    if len(launches) == 1:
        ids = [ctx.allocate(n, "temporary", what) for what, n in site.temporaries()]
        ctx.note_site(REDUCTION_SITE, site.params(), out)
        for alloc_id in reversed(ids):  # semaphores, staging, accumulator, cast
            ctx.free(alloc_id)
        return
    # Several 32-bit launches: each frees its staging before the next asks (no site: a site's
    # temporaries are held together).
    held = [ctx.allocate(n, "temporary", what) for what, n in site.held_temporaries()]
    for staging, semaphores in launches:
        ids = [ctx.allocate(n, "temporary", what) for what, n in staging_temporaries(staging, semaphores)]
        for alloc_id in reversed(ids):
            ctx.free(alloc_id)
    for alloc_id in reversed(held):
        ctx.free(alloc_id)

"""Where an emulated CUDA kernel picks its code path by a size: the site a recording notes.

Some kernels allocate temporaries on one path and nothing on another, and pick the path by a
size that grows with the batch: ``embedding_dense_backward`` sorts its indices above 3,072 of
them (aten/src/ATen/native/cuda/Embedding.cu). A recording made on one side of that size has
other events than one made on the other, so a batch search that learns from two sizes on one
side could not synthesize the other (``plan/trace_interpolation.py``). The emulation therefore
notes an ``EmulationSite`` at each call, on either path: its kind, the integers its choice and
its temporaries depend on, and the op output they sit around (``anchor``). ``SITE_PLANS`` gives,
for every kind, the temporaries of any such integers: the emulation allocates them through
it, and an interpolator that strips them from two recordings finds one structure on both sides
of the size, and puts them back at any batch.

A second kind: ``sum`` and ``mean`` (``emulations/reductions.py``), whose multi-block staging
appears once the reduced extent is large enough and then grows with it, not affinely
(``reduce_config.py``). Their temporaries come after the output (``SitePlan.after_anchor``).

A third: the weight and bias gradients of layer norm's and RMSNorm's CUDA backward
(``emulations/layer_norm.py``), reduced in two passes past 65,536 rows. Its temporaries are
not held around one output: the first gradients and their partial sums are allocated before
the weight gradient, each gradient's ``.sum(0)`` staging after it, and the first tensors freed
one at a time (``SitePlan.program``: each step placed before or after an output of the call).

It needs no torch itself, but importing it imports ``oomkit.prediction.tracing``, which does:
``plan/trace_interpolation.py`` imports it only where a recording has sites.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from oomkit.prediction.tracing.reduce_config import (
    ReduceIteration,
    reduce_iteration,
    reduce_staging,
    split_for_32bit_indexing,
)

__all__ = [
    "EMBEDDING_BACKWARD_SITE",
    "EMBEDDING_SMALL_PATH_MAX_INDICES",
    "GAMMA_BETA_BACKWARD_SITE",
    "NORM_GRAD_COPY",
    "REDUCTION_SITE",
    "SITE_PLANS",
    "EmulationSite",
    "GammaBetaBackward",
    "ReductionSite",
    "SitePlan",
    "SiteStep",
    "embedding_backward_temporaries",
    "gamma_beta_backward_program",
    "reduction_temporaries",
    "staging_temporaries",
    "two_pass_gamma_rows",
]

EMBEDDING_BACKWARD_SITE = "embedding_dense_backward"
REDUCTION_SITE = "reduction"
GAMMA_BETA_BACKWARD_SITE = "gamma_beta_backward"
# Embedding.cu embedding_dense_backward_cuda: the direct (unsorted) kernel's limit.
EMBEDDING_SMALL_PATH_MAX_INDICES = 3072
# The `emulated` tags of the sort path's temporaries (one place: the plan's names are these).
_SORTED_INDICES, _ORIG_INDICES, _COUNT, _INDICES_COPY, _GRAD_COPY = (
    "embedding_sorted_indices",
    "embedding_orig_indices",
    "embedding_count",
    "embedding_indices_copy",
    "embedding_grad_copy",
)
# A norm backward's dY.contiguous() (layer_norm_kernel.cu LayerNormBackwardKernelImpl).
NORM_GRAD_COPY = "norm_grad_copy"
_REDUCTION_CAST, _REDUCTION_ACCUMULATOR, _REDUCTION_STAGING, _REDUCTION_SEMAPHORES = (
    "reduction_cast",
    "reduction_accumulator",
    "reduction_staging",
    "reduction_semaphores",
)


@dataclass(frozen=True)
class EmulationSite:
    """One call of an emulated kernel whose temporaries depend on a size.

    Attributes:
        kind: which plan (``SITE_PLANS``) gives its temporaries: ``"embedding_dense_backward"``.
        anchor: the index, in the recording's events, of the alloc of the op's output: the
            temporaries are allocated just before it and freed just after it, last first.
        params: the integers the temporaries depend on, in the plan's order.
    """

    kind: str
    anchor: int
    params: tuple[int, ...]


@dataclass(frozen=True)
class SiteStep:
    """One allocation or free of a site's temporaries, placed among the call's outputs.

    Attributes:
        offset: which output it sits beside: 0 the anchor, 1 the output allocated next, ...
        after: just after that output (and the steps placed there before it); else just before.
        action: ``"alloc"`` or ``"free"`` (of the temporary allocated as ``name``).
        name: the temporary's ``emulated`` tag, unique in its site.
        nbytes: the temporary's size in bytes.
    """

    offset: int
    after: bool
    action: str
    name: str
    nbytes: int


@dataclass(frozen=True)
class SitePlan:
    """The temporaries of one kind of site.

    Attributes:
        op: the aten overload the site's kernel is (a reduction's anchor may be ``sum`` or
            ``mean``: the temporaries take the anchor's own ``op`` tag).
        category: the category of the temporaries.
        names: every ``emulated`` tag its temporaries may carry.
        temporaries: params -> (``emulated`` tag, bytes) of each temporary, in allocation
            order; empty on the path that allocates none.
        after_anchor: the temporaries are allocated just after the anchor (and freed, last
            first, right after them) rather than just before it.
        program: params -> the steps, for temporaries that are not held together around the
            anchor (``temporaries`` then unused); see :meth:`steps`.
    """

    op: str
    category: str
    names: frozenset[str]
    temporaries: Callable[[tuple[int, ...]], tuple[tuple[str, int], ...]] = lambda params: ()
    after_anchor: bool = False
    program: Callable[[tuple[int, ...]], tuple[SiteStep, ...]] | None = None

    def steps(self, params: tuple[int, ...]) -> tuple[SiteStep, ...]:
        """Every allocation and free of a call's temporaries, in order: the ``program``'s, or
        the ``temporaries`` allocated just before the anchor (just after it with
        ``after_anchor``) and freed just after it and them, last first."""
        if self.program is not None:
            return self.program(params)
        temporaries = self.temporaries(params)
        allocs = [SiteStep(0, self.after_anchor, "alloc", what, n) for what, n in temporaries]
        frees = [SiteStep(0, True, "free", what, n) for what, n in reversed(temporaries)]
        return (*allocs, *frees)


def embedding_backward_temporaries(params: tuple[int, ...]) -> tuple[tuple[str, int], ...]:
    """The temporaries of ``embedding_dense_backward_cuda`` (Embedding.cu), in allocation order.

    ``params``: (number of indices, bytes per index, 1 with ``scale_grad_by_freq`` else 0, and
    optionally 1 when the indices are not contiguous else 0, and the bytes of ``grad`` when it
    is not contiguous else 0). First ``indices_.contiguous()`` and ``grad_.contiguous()``,
    copies only where the tensors are not contiguous (BERT's expanded token-type ids). Then,
    ``num_indices <= 3072`` without ``scale_grad_by_freq``: one kernel accumulates straight
    into ``grad_weight``, nothing else. Otherwise ``sorted_indices`` and ``orig_indices``
    (``empty_like(indices)`` each, filled by a cub radix sort) and, with
    ``scale_grad_by_freq``, ``count`` (``empty_like(indices)``).
    """
    num_indices, index_bytes, scale_grad_by_freq = params[:3]
    indices_copy, grad_copy_bytes = params[3:5] if len(params) >= 5 else (0, 0)
    nbytes = num_indices * index_bytes
    out: list[tuple[str, int]] = []
    if indices_copy:
        out.append((_INDICES_COPY, nbytes))
    if grad_copy_bytes:
        out.append((_GRAD_COPY, grad_copy_bytes))
    if num_indices <= EMBEDDING_SMALL_PATH_MAX_INDICES and not scale_grad_by_freq:
        return tuple(out)
    out += [(_SORTED_INDICES, nbytes), (_ORIG_INDICES, nbytes)]
    if scale_grad_by_freq:
        out.append((_COUNT, nbytes))
    return tuple(out)


@dataclass(frozen=True)
class ReductionSite:
    """The integers a ``sum`` or ``mean`` call's temporaries depend on (a site's ``params``).

    Attributes:
        multiprocessor_count, max_threads_per_multiprocessor: the target's (grid sizing).
        arg_bytes, scalar_bytes, output_bytes: ``sizeof`` the accumulator, the element the
            kernel reads and the output's element.
        cast_bytes: bytes per element of the input's copy in the kernel's dtype; 0: no copy.
        accumulates_in_output: 0 when input and output are both half or both bfloat16
            (``gpu_reduce_kernel``'s ``can_accumulate_in_output``), else 1.
        offset_bytes: the read tensor's first element's offset from its allocation.
        reduced_mask: bit ``d`` set when dimension ``d`` is reduced; 0: every dimension.
        sizes, strides: the read tensor's (strides in elements).
    """

    multiprocessor_count: int
    max_threads_per_multiprocessor: int
    arg_bytes: int
    scalar_bytes: int
    output_bytes: int
    cast_bytes: int
    accumulates_in_output: int
    offset_bytes: int
    reduced_mask: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]

    def params(self) -> tuple[int, ...]:
        head = (
            self.multiprocessor_count, self.max_threads_per_multiprocessor, self.arg_bytes,
            self.scalar_bytes, self.output_bytes, self.cast_bytes, self.accumulates_in_output,
            self.offset_bytes, self.reduced_mask, len(self.sizes),
        )
        return (*head, *self.sizes, *self.strides)

    @classmethod
    def from_params(cls, params: tuple[int, ...]) -> ReductionSite:
        sm, threads, arg, scalar, output, cast, accumulates, offset, mask, ndim = params[:10]
        return cls(
            multiprocessor_count=sm,
            max_threads_per_multiprocessor=threads,
            arg_bytes=arg,
            scalar_bytes=scalar,
            output_bytes=output,
            cast_bytes=cast,
            accumulates_in_output=accumulates,
            offset_bytes=offset,
            reduced_mask=mask,
            sizes=tuple(params[10:10 + ndim]),
            strides=tuple(params[10 + ndim:10 + 2 * ndim]),
        )

    def iteration(self) -> ReduceIteration:
        """The iteration TensorIterator builds for this call (``reduce_config.reduce_iteration``)."""
        return self._iteration

    @functools.cached_property
    def _iteration(self) -> ReduceIteration:
        reduced = [d for d in range(len(self.sizes)) if self.reduced_mask >> d & 1]
        return reduce_iteration(
            self.sizes, self.strides, self.scalar_bytes, self.output_bytes, reduced,
            self.offset_bytes,
        )

    def launches(self) -> tuple[tuple[int, int], ...]:
        """(staging bytes, semaphore bytes) of each ``gpu_reduce_kernel`` launch, in order (one
        per 32-bit sub-iteration; (0, 0) where a launch stages nothing)."""
        return self._launches

    @functools.cached_property
    def _launches(self) -> tuple[tuple[int, int], ...]:
        return tuple(
            (staging.global_memory_bytes, staging.semaphore_bytes)
            for staging in (
                reduce_staging(
                    sub, self.arg_bytes, self.scalar_bytes,
                    multiprocessor_count=self.multiprocessor_count,
                    max_threads_per_multiprocessor=self.max_threads_per_multiprocessor,
                )
                for sub in split_for_32bit_indexing(self._iteration)
            )
        )

    def held_temporaries(self) -> tuple[tuple[str, int], ...]:
        """What stays allocated across the launches, in allocation order: the input's copy in
        the kernel's dtype (``make_reduction``'s ``self.to``), then the ``AccumulationBuffer``
        the sub-iterations share (only when the output cannot accumulate and the iteration needs
        64-bit indexing: the output's extent in ``arg_t``)."""
        out: list[tuple[str, int]] = []
        if self.cast_bytes:
            numel = 1
            for size in self.sizes:
                numel *= size
            out.append((_REDUCTION_CAST, numel * self.cast_bytes))
        if not self.accumulates_in_output:
            iteration = self._iteration
            if not iteration.can_use_32bit_indexing():
                extent = max(
                    [self.output_bytes]
                    + [n * s for n, s in zip(iteration.shape, iteration.output_strides, strict=True)]
                )
                out.append((_REDUCTION_ACCUMULATOR, extent // self.output_bytes * self.arg_bytes))
        return tuple(out)

    def temporaries(self) -> tuple[tuple[str, int], ...]:
        """Every temporary in allocation order: the held ones, then each launch's staging
        buffer and semaphores (``reduction_temporaries``, the site plan's)."""
        out = list(self.held_temporaries())
        for staging, semaphores in self.launches():
            out.extend(staging_temporaries(staging, semaphores))
        return tuple(out)


def staging_temporaries(staging: int, semaphores: int) -> tuple[tuple[str, int], ...]:
    """One launch's staging buffer and semaphores (none when it stages nothing)."""
    if not staging:
        return ()
    return ((_REDUCTION_STAGING, staging), (_REDUCTION_SEMAPHORES, semaphores))


def reduction_temporaries(params: tuple[int, ...]) -> tuple[tuple[str, int], ...]:
    """A ``sum`` or ``mean`` call's temporaries (``ReductionSite.params``), in allocation order:
    the held ones, then each launch's staging buffer and semaphores. Several launches (an input
    beyond 32-bit indexing) free each launch's staging before the next one asks; a site's
    temporaries are held together, so the emulation notes no site there."""
    return ReductionSite.from_params(params).temporaries()


def two_pass_gamma_rows(rows: int, columns: int, multiprocessor_count: int) -> int | None:
    """``LaunchGammaBetaBackwardCUDAKernel``'s partial sums (aten/src/ATen/native/cuda/
    layer_norm_kernel.cu; CUDA's ``block_dim_x`` 32, ``rows_per_block_y`` 32, ``max_grid_size``
    32,768): how many rows its ``dgamma_blocks`` has, or ``None`` where it reduces in one pass
    (``M <= 64 * 1024`` or ``N / 32 >= SMs / 2``)."""
    if rows <= 64 * 1024 or columns // 32 >= multiprocessor_count // 2:
        return None
    blocks_x = -(-columns // 32)
    return min((64 * 1024 // 2) // blocks_x, -(-rows // 32))


@dataclass(frozen=True)
class GammaBetaBackward:
    """The integers a norm backward's weight and bias gradients depend on (a site's ``params``).

    Attributes:
        rows, columns: ``M`` and ``N`` (``N`` the normalized shape's elements).
        width: ``dgamma->size(-1)``, the partial sums' row length (the normalized shape's last
            dimension).
        multiprocessor_count, max_threads_per_multiprocessor: the target's.
        element_bytes: the gradients' element size; ``arg_bytes`` the ``.sum(0)``'s
            accumulator (``at::opmath_type``); ``accumulates_in_output`` 0 for 16-bit floats.
        dgamma_bytes, dbeta_bytes: each gradient's bytes; 0 where it is not computed.
        grad_copy_bytes: ``dY.contiguous()``'s bytes where the gradient is not contiguous, else 0.
        two_pass_branch: 1 where the target's torch has the two-pass branch (2.8 on), else 0.
    """

    rows: int
    columns: int
    width: int
    multiprocessor_count: int
    max_threads_per_multiprocessor: int
    element_bytes: int
    arg_bytes: int
    accumulates_in_output: int
    dgamma_bytes: int
    dbeta_bytes: int
    grad_copy_bytes: int
    two_pass_branch: int

    def params(self) -> tuple[int, ...]:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))


def gamma_beta_backward_program(params: tuple[int, ...]) -> tuple[SiteStep, ...]:
    """A norm backward's weight and bias gradients (``GammaBetaBackward`` params) around their
    outputs (``dgamma`` then ``dbeta``, those computed), with ``dY.contiguous()`` where the
    gradient is not contiguous (``LayerNormBackwardKernelImpl``: made after the outputs, freed
    when the kernels are queued). One pass: the copy alone, after the last gradient. Two passes
    (``LaunchGammaBetaBackwardCUDAKernel``): before the weight gradient the first ``dgamma`` and
    ``dbeta`` (``layer_norm_backward_cuda``'s outputs, in that order), the copy, then
    ``dgamma_blocks`` and ``dbeta_blocks``; after each gradient (``*dgamma =
    dgamma_blocks.sum(0)``, then ``*dbeta``) the sum's staging, freed when it is queued, then
    the first tensor, freed by the assignment; after the last the partial sums, ``dbeta_blocks``
    first (C++ destroys locals last first), then the copy."""
    site = GammaBetaBackward(*params)
    gradients = [
        (name, nbytes)
        for name, nbytes in (("dgamma", site.dgamma_bytes), ("dbeta", site.dbeta_bytes))
        if nbytes
    ]
    if not gradients:
        return ()
    last = len(gradients) - 1
    copy = [(NORM_GRAD_COPY, site.grad_copy_bytes)] if site.grad_copy_bytes else []
    rows = (
        two_pass_gamma_rows(site.rows, site.columns, site.multiprocessor_count)
        if site.two_pass_branch else None
    )
    if rows is None:
        return tuple(
            SiteStep(last, True, action, name, n) for action in ("alloc", "free") for name, n in copy
        )
    partial = rows * site.width * site.element_bytes
    steps = [SiteStep(0, False, "alloc", f"two_pass_{name}", n) for name, n in gradients]
    steps += [SiteStep(0, False, "alloc", name, n) for name, n in copy]
    steps += [SiteStep(0, False, "alloc", f"two_pass_{name}_blocks", partial) for name, _ in gradients]
    # .sum(0) of the [rows, width] partial sums into a tensor of their dtype.
    reduction = ReductionSite(
        multiprocessor_count=site.multiprocessor_count,
        max_threads_per_multiprocessor=site.max_threads_per_multiprocessor,
        arg_bytes=site.arg_bytes, scalar_bytes=site.element_bytes,
        output_bytes=site.element_bytes, cast_bytes=0,
        accumulates_in_output=site.accumulates_in_output, offset_bytes=0, reduced_mask=1,
        sizes=(rows, site.width), strides=(site.width, 1),
    )
    for offset, (name, nbytes) in enumerate(gradients):
        staging = [(f"two_pass_{name}_{what}", n) for what, n in reduction.temporaries()]
        steps += [SiteStep(offset, True, "alloc", what, n) for what, n in staging]
        steps += [SiteStep(offset, True, "free", what, n) for what, n in reversed(staging)]
        steps.append(SiteStep(offset, True, "free", f"two_pass_{name}", nbytes))
    steps += [
        SiteStep(last, True, "free", f"two_pass_{name}_blocks", partial)
        for name, _ in reversed(gradients)
    ]
    steps += [SiteStep(last, True, "free", name, n) for name, n in copy]
    return tuple(steps)


SITE_PLANS: Mapping[str, SitePlan] = {
    EMBEDDING_BACKWARD_SITE: SitePlan(
        op="aten.embedding_dense_backward.default",
        category="temporary",
        names=frozenset({_SORTED_INDICES, _ORIG_INDICES, _COUNT, _INDICES_COPY, _GRAD_COPY}),
        temporaries=embedding_backward_temporaries,
    ),
    REDUCTION_SITE: SitePlan(
        op="aten.sum.dim_IntList",
        category="temporary",
        names=frozenset(
            {_REDUCTION_CAST, _REDUCTION_ACCUMULATOR, _REDUCTION_STAGING, _REDUCTION_SEMAPHORES}
        ),
        temporaries=reduction_temporaries,
        after_anchor=True,
    ),
    GAMMA_BETA_BACKWARD_SITE: SitePlan(
        op="aten.native_layer_norm_backward.default",  # and aten._fused_rms_norm_backward
        category="temporary",
        names=frozenset({NORM_GRAD_COPY}) | frozenset(
            f"two_pass_{name}{suffix}"
            for name in ("dgamma", "dbeta")
            for suffix in ("", "_blocks", *(f"_{what}" for what in (
                _REDUCTION_CAST, _REDUCTION_ACCUMULATOR, _REDUCTION_STAGING, _REDUCTION_SEMAPHORES
            )))
        ),
        program=gamma_beta_backward_program,
    ),
}

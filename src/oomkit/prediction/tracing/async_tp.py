"""Async tensor parallel under ``torch.compile``: Inductor's micro-pipeline pass, its ops' memory.

torchtitan turns async TP on with compile (torchtitan/distributed/compile.py
``_maybe_enable_async_tp``: ``enable_symm_mem_for_group(tp group)`` and
``torch._inductor.config._micro_pipeline_tp = True``). Inductor then runs
torch/_inductor/fx_passes/micro_pipeline_tp.py ``micro_pipeline_tp_pass`` on each post-grad
graph (post_grad.py ``post_grad_passes``), after compile_fx.py ``view_to_reshape``. The pass
rewrites an all-gather whose result feeds matmuls into ``symm_mem.fused_all_gather_matmul``
(``..._scaled_matmul`` for float8) and a matmul whose result is reduce-scattered into
``symm_mem.fused_matmul_reduce_scatter`` (``fused_scaled_matmul_reduce_scatter``), with an
``inductor_force_stride_order`` on the input that lays it out gather (scatter) dimension first.

:func:`rewrite_for_async_tp` runs that pass itself, as Inductor does, on the graph oomkit's
Inductor stand-in plans (``compile_backend.py``). The pass is pure FX; it runs on the fake group
once NCCL is said to be available (its guard: ``torch.distributed.is_nccl_available()``, false
on CPU wheels) and the group is registered (torchtitan's ``enable_symm_mem_for_group`` does it).
A ``force_stride_order`` becomes a buffer only where Inductor copies
(ir.py ``ExternKernel.require_stride_order``: a kernel Inductor generates has a flexible layout
and is written in the order asked; a graph input or an extern kernel's output of other strides
is copied).

:class:`AsyncTpEmulations` runs the fused ops as their CUDA implementations allocate
(torch/distributed/_symmetric_memory/__init__.py):

- all-gather + matmuls (``_fused_all_gather_matmul_impl``): the gathered ``A`` (``A_flat``) and
  each full-size output, on the current stream; ``A`` is kept when the graph reads it
  (``return_A``), else freed when the op returns. Gathering on the last dimension
  (``_fused_all_gather_matmul_last_gather_dim_impl``) allocates row-shard outputs, and a second
  gathered copy (``torch.cat``) when ``A`` is returned.
- matmul + reduce-scatter (``_fused_matmul_reduce_scatter_impl``,
  ``_fused_scaled_matmul_reduce_scatter_impl``): the unreduced ``stacked_partials`` (the full
  matmul output), then the reduced shard (``torch.sum`` over the ranks' partials); the partials
  are freed when the op returns.
- the GEMMs run chunk by chunk, alternately on the current stream and on a backend stream
  (``_get_backend_stream``); cuBLAS takes a workspace per (thread, stream) on its first GEMM
  there (emulations/cublas.py), so forward and backward each add one on the backend stream.
  Every other buffer is allocated on the current stream before the chunks run, and the current
  stream waits for the backend stream at the end: no cross-stream free.
- the symmetric-memory workspace of the group (``get_symm_mem_workspace``): one buffer per
  group, grown to the largest request and kept: the shard's bytes for an all-gather
  (``_pipelined_multi_all_gather_and_consume`` ``p2p_workspace_size_req``), two output chunks
  for a reduce-scatter (``_pipelined_produce_and_all2all``). It is allocated by
  ``_SymmetricMemory.empty_strided_p2p`` outside the caching allocator
  (torch/csrc/distributed/c10d/symm_mem/CUDASymmetricMemory.cpp
  ``CUDASymmetricMemoryAllocator::alloc``: the size rounded to 16 bytes plus the signal pad,
  rounded up to the allocation granularity), so it is a line outside the allocator, as NCCL's
  buffers are.

Where it may differ from a GPU run: the copy a reader of a fused output needs (its layout is
gather dimension first) may be planned in place of that output (compile_plan.py's in-place rule
does not compare indexing; Inductor keeps both for the copy kernel): one buffer of the output's
size less, for one kernel, per such copy. A workspace that grows frees the smaller one after the
new one is made (both mapped for a moment; here only the largest is counted). The allocation
granularity is taken as 2 MiB, not asked of the driver. The native and multicast paths
(``TORCH_SYMM_MEM_ENABLE_NATIVE_ASYNC_TP``; ``_should_use_multimem_all_gather_matmul``, taken
only without ``return_A`` and for at most 2048 gathered rows) are not modelled.
"""

from __future__ import annotations

import contextlib
import math
import operator
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx

from oomkit.prediction.tracing.collectives import nccl_said_available
from oomkit.prediction.tracing.compile_plan import node_kind
from oomkit.prediction.tracing.emulation import EmulationContext, OpEmulation
from oomkit.prediction.tracing.emulations.cublas import ensure_cublas_workspace

__all__ = [
    "ALL_GATHER_MATMUL_OPS",
    "ASYNC_TP_OPS",
    "REDUCE_SCATTER_MATMUL_OPS",
    "SIGNAL_PAD_BYTES",
    "SYMM_MEM_GRANULARITY_BYTES",
    "AsyncTpEmulations",
    "async_tp_state_kept",
    "fused_op_names",
    "micro_pipeline_tp_enabled",
    "note_unfused",
    "rewrite_for_async_tp",
    "symmetric_block_bytes",
]

ALL_GATHER_MATMUL_OPS = (
    "symm_mem.fused_all_gather_matmul.default",
    "symm_mem.fused_all_gather_scaled_matmul.default",
)
REDUCE_SCATTER_MATMUL_OPS = (
    "symm_mem.fused_matmul_reduce_scatter.default",
    "symm_mem.fused_scaled_matmul_reduce_scatter.default",
)
ASYNC_TP_OPS = ALL_GATHER_MATMUL_OPS + REDUCE_SCATTER_MATMUL_OPS

# torch/csrc/distributed/c10d/symm_mem/CUDASymmetricMemoryTypes.hpp default_signal_pad_size:
# symm_max_nblocks (32) x max_cuda_p2p_domain_size (72) x sizeof(uint32_t).
SIGNAL_PAD_BYTES = 32 * 72 * 4
# CUDASymmetricMemoryAllocator::alloc rounds the block to cuMemGetAllocationGranularity
# (CU_MEM_ALLOC_GRANULARITY_RECOMMENDED), 2 MiB for device memory on current NVIDIA GPUs; the
# driver is not queried here.
SYMM_MEM_GRANULARITY_BYTES = 2 * 1024 * 1024

_WORKSPACE_SOURCE = (
    "torch/distributed/_symmetric_memory/__init__.py get_symm_mem_workspace (the largest "
    "request: a shard for all-gather+matmul, 2 output chunks for matmul+reduce-scatter); "
    "CUDASymmetricMemory.cpp CUDASymmetricMemoryAllocator::alloc (+ signal pad, rounded to "
    "the 2 MiB granularity)"
)


def micro_pipeline_tp_enabled() -> bool:
    """Whether Inductor's async-TP pass is on (``torch._inductor.config._micro_pipeline_tp``)."""
    import torch._inductor.config as inductor_config

    return bool(getattr(inductor_config, "_micro_pipeline_tp", False))


@contextlib.contextmanager
def async_tp_state_kept() -> Iterator[None]:
    """Inductor's ``_micro_pipeline_tp`` as it was, restored on exit.

    torchtitan's ``_maybe_enable_async_tp`` sets it process-wide. The groups it registers for
    symmetric memory stay registered: ``_SymmetricMemory.set_group_info`` refuses a second
    registration of a name (a later job on an equal group finds it registered, as its
    ``enable_symm_mem_for_group`` returns early), and the registration matters only while the
    flag is on.
    """
    import torch._inductor.config as inductor_config

    flag = getattr(inductor_config, "_micro_pipeline_tp", False)
    try:
        yield
    finally:
        inductor_config._micro_pipeline_tp = flag


def symmetric_block_bytes(size_bytes: int) -> int:
    """Device bytes ``CUDASymmetricMemoryAllocator::alloc`` maps for a ``size_bytes`` buffer."""
    block = -(-size_bytes // 16) * 16 + SIGNAL_PAD_BYTES
    return -(-block // SYMM_MEM_GRANULARITY_BYTES) * SYMM_MEM_GRANULARITY_BYTES


def rewrite_for_async_tp(gm: torch.fx.GraphModule, example_inputs: Any) -> Counter[str]:
    """Run Inductor's micro-pipeline TP pass on ``gm`` as compile_fx.py does; the fused ops made.

    ``view_to_reshape`` first (compile_fx.py ``_compile_fx_inner`` runs it before the post-grad
    passes; the pass matches ``reshape``), ``remove_noop_ops`` (post_grad.py, earlier in the
    post-grad passes), then ``micro_pipeline_tp_pass``; the nodes it adds get
    their values (``meta['val']``) from their meta kernels, and each ``force_stride_order`` it
    inserts stays only where Inductor copies.

    Args:
        gm: an AOTAutograd forward or backward graph (changed in place).
        example_inputs: its inputs (their fake mode computes the new nodes' values).

    Returns:
        The fused ops in the graph now, by op name.
    """
    import torch.distributed._symmetric_memory  # noqa: F401 - defines the symm_mem ops
    from torch._guards import detect_fake_mode
    from torch._inductor.fx_passes.post_grad import remove_noop_ops, view_to_reshape
    from torch.utils._python_dispatch import _disable_current_modes

    view_to_reshape(gm)
    mode = detect_fake_mode(example_inputs)
    # The pass restrides the nodes' fake values (torch/distributed/_symmetric_memory
    # restride_A_shard_for_fused_all_gather_matmul): in their own fake mode, with the
    # recorder's modes off, as Inductor runs it (compile_fx.py: under V.set_fake_mode).
    with _disable_current_modes(), torch._C.DisableTorchFunction(), nccl_said_available():
        with contextlib.nullcontext() if mode is None else mode:
            # post_grad.py post_grad_passes: remove_noop_ops (pattern_matcher, on by default)
            # before the pass: DTensor's all-gather ends in a full-range slice otherwise
            remove_noop_ops(gm.graph)
            _micro_pipeline_tp(gm.graph)
            _fill_values(gm)
            _read_through_copies(gm)
    _keep_copying_restrides(gm)
    gm.graph.lint()
    gm.recompile()
    return Counter(str(n.target) for n in gm.graph.nodes if str(n.target) in ASYNC_TP_OPS)


def _micro_pipeline_tp(graph: torch.fx.Graph) -> None:
    """micro_pipeline_tp.py ``micro_pipeline_tp_pass``, one match at a time.

    Its own functions find and fuse each match; a match on which torch's pass fails (torch 2.13's
    ``_scatter_dim_after_reshape`` asserts "reshape must be from 3D+ to 2D" on a float8
    backward's ``reshape -> _scaled_mm``, before changing the graph) is left unfused and noted
    (:func:`note_unfused`): on a GPU that assertion stops Inductor compiling the graph.
    """
    import torch._inductor.config as inductor_config
    from torch._inductor.fx_passes import micro_pipeline_tp as pass_module

    all_gathers = pass_module.find_all_gather_patterns(graph)
    reduce_scatters = pass_module.find_reduce_scatter_patterns(graph)
    if inductor_config.reorder_for_compute_comm_overlap:  # the pass's own exclusion
        hidden = pass_module._get_unexposed_collectives(graph)
        all_gathers = [m for m in all_gathers if m.ag_node not in hidden]
        reduce_scatters = [m for m in reduce_scatters if m.reduce_scatter_node not in hidden]
    fusions = [(pass_module.fuse_all_gather_matmul, m) for m in all_gathers] + [
        (pass_module.fuse_matmul_reduce_scatter, m) for m in reduce_scatters
    ]
    for fuse, match in fusions:
        try:
            fuse(match)
        except AssertionError as exc:
            note_unfused(f"{fuse.__name__}: {str(exc).splitlines()[0] if str(exc) else 'assert'}")


_UNFUSED: list[Counter[str]] = []  # the open recordings' counts of matches left unfused


def note_unfused(why: str) -> None:
    """Count a match torch's pass failed on, for the recording open now (if any)."""
    if _UNFUSED:
        _UNFUSED[-1][why] += 1


def _fill_values(gm: torch.fx.GraphModule) -> None:
    """``meta['val']`` of the nodes the pass added, from their meta kernels, in graph order."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or "val" in node.meta:
            continue
        args, kwargs = torch.fx.node.map_arg(
            (node.args, node.kwargs), lambda n: n.meta.get("val")
        )
        node.meta["val"] = node.target(*args, **kwargs)


def _fused_root(node: torch.fx.Node) -> torch.fx.Node | None:
    """The fused op a ``getitem`` chain reads (``fused[1][0]``), else ``None``."""
    root: Any = node
    while isinstance(root, torch.fx.Node) and root.target is operator.getitem:
        root = root.args[0]
    if isinstance(root, torch.fx.Node) and str(root.target) in ASYNC_TP_OPS:
        return root
    return None


def _read_through_copies(gm: torch.fx.GraphModule) -> None:
    """Readers of a fused op's output that is not contiguous read it through a ``clone``.

    The fused ops return their outputs laid out gather dimension first
    (``_fused_all_gather_matmul_impl`` ``unflatten``; the meta kernel's strides, which Inductor's
    fallback kernel fixes as its layout). Inductor reads such a buffer through index remapping:
    inlined into a pointwise reader (whose own buffer is contiguous, ``FlexibleLayout``), and
    copied once for an extern kernel or a graph output, whose reshape cannot view it (ir.py
    ``View.create`` / ``ExternKernel.realize_input``). A contiguous ``clone``, which the plan
    inlines or materialises by the same rules, does both; and later values keep the strides
    of the graph AOTAutograd traced.
    """
    for node in list(gm.graph.nodes):
        if node.target is not operator.getitem or _fused_root(node) is None:
            continue
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor) or value.is_contiguous():
            continue
        readers = list(node.users)
        with gm.graph.inserting_after(node):
            copy = gm.graph.call_function(
                torch.ops.aten.clone.default, (node,), {"memory_format": torch.contiguous_format}
            )
        copy.meta["val"] = value.clone(memory_format=torch.contiguous_format)
        for reader in readers:
            reader.replace_input_with(node, copy)


def _is_restride(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and "inductor_force_stride_order" in str(node.target)


def _keep_copying_restrides(gm: torch.fx.GraphModule) -> None:
    """Drop each ``force_stride_order`` that Inductor lowers without a copy.

    ir.py ``ExternKernel.require_stride_order``: a value already in that order is used as it is,
    and a buffer of a kernel Inductor generates (pointwise, reduction: a ``FlexibleLayout``) is
    frozen in the order asked, so its kernel writes it that way; a graph input or an extern
    kernel's output (a fixed layout) of other strides is copied (``copy_input``).
    """
    for node in list(gm.graph.nodes):
        if not _is_restride(node):
            continue
        source = node.args[0]
        assert isinstance(source, torch.fx.Node)
        if _inductor_copies(source, tuple(node.args[1])):
            continue
        node.replace_all_uses_with(source)
        gm.graph.erase_node(node)


def _inductor_copies(source: torch.fx.Node, stride: tuple[int, ...]) -> bool:
    value = source.meta.get("val")
    if isinstance(value, torch.Tensor) and all(
        size == 1 or have == want
        for size, have, want in zip(value.shape, value.stride(), stride, strict=True)
    ):
        return False  # laid out as asked already (size-1 dimensions have no order)
    producer = source
    while node_kind(producer) == "view" and producer.all_input_nodes:
        producer = producer.all_input_nodes[0]  # a view of it: re-indexed, same producer
    return node_kind(producer) not in ("pointwise", "reduction")


def _group_size(group_name: str) -> int:
    from torch.distributed import distributed_c10d as c10d

    return int(c10d._get_group_size_by_name(c10d.GroupName(group_name)))


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class AsyncTpEmulations:
    """CUDA's memory for the fused async-TP ops, and the symmetric-memory workspace they ask.

    Attributes:
        workspace_bytes: per TP group (by name), the workspace's size (its largest request).
        calls: fused-op calls run, by op name.
    """

    def __init__(self) -> None:
        self.workspace_bytes: dict[str, int] = {}
        self.calls: Counter[str] = Counter()
        self.unfused: Counter[str] = Counter()
        # symm_mem._get_backend_stream: one stream per priority, made on first use.
        self._backend_stream: Any = None

    @property
    def emulations(self) -> dict[str, OpEmulation]:
        """The hooks, by op name (an ``EmulationRegistry`` mapping)."""
        gather: OpEmulation = self._all_gather_matmul
        scatter: OpEmulation = self._matmul_reduce_scatter
        return {
            **dict.fromkeys(ALL_GATHER_MATMUL_OPS, gather),
            **dict.fromkeys(REDUCE_SCATTER_MATMUL_OPS, scatter),
        }

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """While open, matches torch's pass fails on are counted here (:func:`note_unfused`)."""
        _UNFUSED.append(self.unfused)
        try:
            yield
        finally:
            _UNFUSED.remove(self.unfused)

    def notes(self) -> tuple[str, ...]:
        """Warnings for the recording: the matches torch's pass could not fuse."""
        return tuple(
            f"async TP: {n} collective(s) left unfused because torch's micro_pipeline_tp pass "
            f"failed on them ({why}); on a GPU that failure stops Inductor compiling the graph"
            for why, n in sorted(self.unfused.items())
        )

    def outside_lines(self) -> tuple[tuple[str, int, str], ...]:
        """``(what, bytes, source)`` per TP group: its workspace as mapped on the device."""
        return tuple(
            (
                f"symmetric-memory workspace of TP group {name!r} (async TP; "
                f"{size:,} bytes asked)",
                symmetric_block_bytes(size),
                _WORKSPACE_SOURCE,
            )
            for name, size in sorted(self.workspace_bytes.items())
        )

    # ------------------------------------------------------------------ shared steps

    def _workspace(self, group_name: str, size_bytes: int) -> None:
        # get_symm_mem_workspace: re-allocated at max(size, min_size) when a request exceeds it.
        have = self.workspace_bytes.get(group_name, 0)
        self.workspace_bytes[group_name] = max(have, size_bytes)

    def _gemms(self, ctx: EmulationContext, group_size: int) -> None:
        """cuBLAS workspaces of the chunks' GEMMs: the current stream's, then the backend's."""
        ensure_cublas_workspace(ctx)
        if group_size < 2:
            return  # no step runs on the backend stream
        if self._backend_stream is None:
            self._backend_stream = torch.cpu.Stream()
        # The backend stream's key in the cuBLAS state; its allocation goes to its own pool
        # (the stream is made current around it, as `with stream:` does on CUDA).
        with torch.cpu.stream(self._backend_stream):
            ensure_cublas_workspace(ctx, stream=-1)

    # ------------------------------------------------------------------ all-gather + matmul

    def _all_gather_matmul(self, ctx: EmulationContext) -> Any:
        scaled = ctx.op_name == ALL_GATHER_MATMUL_OPS[1]
        args = ctx.args
        shard, bs = args[0], list(args[1])
        if scaled:
            scale, gather_dim, group_name = args[2], int(args[4]), str(args[5])
            out_dtypes = [d or b.dtype for d, b in zip(args[8], bs, strict=True)]
            return_a = True  # fused_all_gather_scaled_matmul always returns A
        else:
            scale, gather_dim, group_name = None, int(args[2]), str(args[3])
            out_dtypes = [b.dtype for b in bs]
            return_a = bool(ctx.kwargs.get("return_A", args[4] if len(args) > 4 else True))
        self.calls[ctx.op_name] += 1
        ctx.note_choice(f"async TP {ctx.op_name}")
        size = _group_size(group_name)
        if gather_dim in (-1, shard.dim() - 1):
            return self._gather_last_dim(ctx, shard, bs, out_dtypes, group_name, size, return_a)
        # _fused_all_gather_matmul_impl: the gather dimension first, flattened to 2-D (the
        # pass's restride laid the shard out so; no copy).
        moved = shard.movedim(gather_dim, 0)
        leading = [size, *moved.shape[:-1]]
        rows, k = math.prod(moved.shape[:-1]), moved.shape[-1]
        a_flat = shard.new_empty(rows * size, k)
        ctx.record_outputs(a_flat)
        outputs = [a_flat.new_empty(rows * size, b.shape[1], dtype=d) for b, d in zip(bs, out_dtypes, strict=True)]
        ctx.record_outputs(outputs)
        request = _nbytes(shard)
        if scale is not None and scale.numel() > 1 and scale.shape[:-1] == shard.shape[:-1]:
            # _ScaleMode.ROW_WISE_SHARDED: the scales are gathered alongside (A_scale_flat)
            scale_flat = scale.new_empty(rows * size, scale.shape[-1])
            ctx.record_outputs(scale_flat)
            request += _nbytes(scale)
        self._workspace(group_name, request)
        self._gemms(ctx, size)

        def unflatten(t: torch.Tensor) -> torch.Tensor:
            return t.view(*leading, -1).flatten(0, 1).movedim(0, gather_dim)

        gathered = unflatten(a_flat) if return_a else None
        return gathered, [unflatten(out) for out in outputs]

    def _gather_last_dim(
        self,
        ctx: EmulationContext,
        shard: torch.Tensor,
        bs: list[torch.Tensor],
        out_dtypes: list[torch.dtype],
        group_name: str,
        size: int,
        return_a: bool,
    ) -> Any:
        """_fused_all_gather_matmul_last_gather_dim_impl: row-shard outputs, A gathered by rows."""
        leading = list(shard.shape[:-1])
        rows, k = math.prod(leading), shard.shape[-1]
        a_flat = shard.new_empty(rows * size, k)
        ctx.record_outputs(a_flat)
        outputs = [
            shard.new_empty(rows, b.shape[1], dtype=d) for b, d in zip(bs, out_dtypes, strict=True)
        ]
        ctx.record_outputs(outputs)
        self._workspace(group_name, _nbytes(shard))
        self._gemms(ctx, size)
        gathered = None
        if return_a:  # torch.cat of the row chunks along the last dimension: a second copy
            gathered = torch.cat(a_flat.chunk(size), dim=-1).view(*leading, -1)
            ctx.record_outputs(gathered)
        return gathered, [out.view(*leading, -1) for out in outputs]

    # ------------------------------------------------------------------ matmul + reduce-scatter

    def _matmul_reduce_scatter(self, ctx: EmulationContext) -> Any:
        scaled = ctx.op_name == REDUCE_SCATTER_MATMUL_OPS[1]
        args = ctx.args
        a, b = args[0], args[1]
        if scaled:
            reduce_op, scatter_dim, dim_2d = str(args[4]), int(args[5]), int(args[6])
            group_name, output_shape = str(args[7]), list(args[8])
            out_dtype = _arg(ctx, 11, "out_dtype") or a.dtype
        else:
            reduce_op, scatter_dim, group_name = str(args[2]), int(args[3]), str(args[4])
            dim_2d, output_shape, out_dtype = scatter_dim, None, a.dtype
        self.calls[ctx.op_name] += 1
        ctx.note_choice(f"async TP {ctx.op_name}")
        size = _group_size(group_name)
        reduce = torch.sum if reduce_op == "sum" else torch.mean
        if not scaled and scatter_dim == a.dim() - 1:
            # _fused_matmul_reduce_scatter_impl, last dimension: partials of the rows' outputs
            leading = list(a.shape[:-1])
            rows = math.prod(leading)
            partials = torch.empty((rows, b.shape[1]), dtype=out_dtype, device=a.device)
            ctx.record_outputs(partials)
            chunk_bytes = rows * (b.shape[1] // size) * partials.element_size()
            self._workspace(group_name, 2 * chunk_bytes)
            self._gemms(ctx, size)
            out = reduce(partials.reshape(*leading, size, -1), dim=-2)
            ctx.record_outputs(out)
            return out
        # The scatter dimension first, flattened to 2-D (laid out so by the pass's restride).
        moved = a.movedim(dim_2d, 0)
        leading = [size, *moved.shape[:-1]]
        rows = math.prod(moved.shape[:-1])
        partials = a.new_empty(rows, b.shape[1], dtype=out_dtype)
        ctx.record_outputs(partials)
        # _pipelined_produce_and_all2all: two chunks of the output, one per stream in flight
        chunk_bytes = (rows // size) * b.shape[1] * partials.element_size()
        self._workspace(group_name, 2 * chunk_bytes)
        self._gemms(ctx, size)
        if scaled:  # _fused_scaled_matmul_reduce_scatter_impl
            leading[scatter_dim if scatter_dim > 0 else 1] //= size
            view = partials.view(*leading, -1).movedim(1, dim_2d + 1)
            reduced = reduce(view, dim=0)
        else:  # _fused_matmul_reduce_scatter_impl
            leading[1] //= size
            view = partials.view(*leading, -1).movedim(1, scatter_dim + 1).movedim(0, scatter_dim)
            reduced = reduce(view, dim=scatter_dim)
        del view
        ctx.record_outputs(reduced)
        if output_shape is not None:
            output_shape[scatter_dim] //= size
            return reduced.view(*output_shape)
        return reduced


def _arg(ctx: EmulationContext, index: int, name: str) -> Any:
    if len(ctx.args) > index:
        return ctx.args[index]
    return ctx.kwargs.get(name)


def fused_op_names(gm: torch.fx.GraphModule) -> list[str]:
    """The async-TP ops in ``gm``, in graph order (for tests and reports)."""
    return [str(n.target) for n in gm.graph.nodes if str(n.target) in ASYNC_TP_OPS]


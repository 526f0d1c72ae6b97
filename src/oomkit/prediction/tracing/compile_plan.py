"""Inductor's memory plan for one AOTAutograd graph, emulated: which values get a buffer, when.

AOTAutograd hands Inductor a forward or backward FX graph of aten ops (after its decompositions
and the min-cut partitioner). Inductor then decides, per value, whether it is *materialised* (a
buffer in the generated wrapper) or computed inside a fused kernel and never stored, and the
wrapper allocates each buffer before the kernel that writes it and frees it after the last kernel
that reads it, reusing freed buffers of the same size instead of allocating. Running Inductor
itself needs a GPU target and Triton (absent from CPU torch wheels), so this module applies the
rules below to the FX graph; each rule names the Inductor code it mirrors.

Which values are buffers (torch/_inductor/lowering.py and ir.py):
- Extern kernels materialise their outputs: every op without a pointwise or reduction lowering
  (``mm``/``addmm``/``bmm``, convolution, SDPA, sorting, scatter with accumulate, ...) is a
  fallback or template kernel (lowering.py ``make_fallback``, ``ir.ExternKernel``), and its
  tensor inputs are realised (``ExternKernel.realize_input``).
- Pointwise ops (``torch.Tag.pointwise``, constants, ``clone``/``_to_copy``, indexing, ``cat``,
  padding) are inlined into their consumers' loaders, so they are not buffers, except when: the
  value is a graph output (a result, or a tensor saved for backward), an extern kernel reads it,
  or it has several consumers and reads more than ``realize_reads_threshold`` (4) buffers or
  inlines more than ``realize_opcount_threshold`` (30) ops (ir.py
  ``StorageBox.should_realize_on_reuse``; counted here as aten nodes, not Inductor's ops).
- Reductions are realised (lowering.py ``make_reduction``); the scheduler may later drop a
  reduction buffer read only inside its fused kernel (a softmax's max and sum), which is kept
  here: reduced tensors are small, so this over-counts little.
- Views (``view``, ``permute``, ``split``, ...) alias their base; a value is freed after the last
  kernel that reads it through any view.
- Constants (``get_attr`` nodes: tensors lifted out of the traced code, ``torch.tensor(...)``)
  are not made per call (graph.py ``GraphLowering.get_attr``): a 0-d one is a scalar and a 1-D
  one of at most 8 elements is inlined (lowering.py ``tensor``), so both act as pointwise
  leaves; a larger one is a ``ConstantBuffer`` the compiled module holds, allocated once. A
  CPU constant moved to the device (``device_put``, what a ``torch.tensor`` made on the meta
  device is traced as, ``compiled.py``) is copied to the device once at compile time
  (ir.py ``DeviceCopy.create``: a value that reads only constants becomes
  ``constant_to_device``), so the move is inlined and the device copy, if not itself inlined,
  is held once.
- ``call_module`` and ``call_method`` nodes (never in AOTAutograd's aten graphs) are extern
  kernels.

The wrapper's plan (torch/_inductor/codegen/wrapper.py ``MemoryPlanningState``, ``AllocateLine``,
``FreeIfNotReusedLine``, ``ReuseLine``; scheduler.py ``decide_inplace_update``):
- A buffer that dies is pushed on a pool keyed by (dtype, bytes) (``buffer_reuse_key``; in a
  graph compiled with dynamic shapes the bytes are a symbolic expression, ``2048*s27``, and
  only buffers of the same expression share a key); the next allocation with that key pops it
  (last in, first out) and reuses it, so neither the free nor the allocation reaches the
  allocator. A buffer never reused is freed where it died.
- A fused kernel whose input buffer dies in it and has its output's dtype and size writes its
  output in place (``config.inplace_buffers``).
- Graph inputs are dropped after their last use (``del``) and never enter the pool.

Where it may differ from real Inductor: the scheduler's fusion choices are not run (two
realised pointwise nodes may share a kernel and drop a buffer, and Inductor's own op counts
differ from aten node counts); pattern rewrites of the joint-graph and post-grad passes are not
applied (async TP's micro-pipeline pass is: ``async_tp.py``); buffers padded for alignment
(``config.comprehensive_padding``) are not padded here.
"""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

__all__ = [
    "BufferPlan",
    "Buffer",
    "fetch_attr",
    "node_kind",
    "plan_graph",
    "REALIZE_READS_THRESHOLD",
    "WAITS_RETURNING_INPUT",
]

# torch/_inductor/config.py realize_reads_threshold and _realize_opcount_threshold_default.
REALIZE_READS_THRESHOLD = 4
REALIZE_OPCOUNT_THRESHOLD = 30

# Ops without a pointwise tag that Inductor still lowers to loaders inlined into consumers
# (lowering.py: constants, copies, indexing, cat, padding, random via inductor_random).
_INLINED_OPS: frozenset[str] = frozenset(
    {
        "clone", "_to_copy", "convert_element_type", "full", "full_like", "zeros", "zeros_like",
        "ones", "ones_like", "scalar_tensor", "iota", "arange", "rand", "rand_like", "randn",
        "randn_like", "embedding", "index", "gather", "cat", "constant_pad_nd", "slice_scatter",
        "select_scatter", "diagonal_scatter", "where", "masked_fill", "fill", "lift_fresh_copy",
        "expand_copy", "permute_copy", "view_copy", "_unsafe_view", "repeat", "tril", "triu",
        "flip", "roll", "bernoulli",
    }
)  # fmt: skip
# Reductions (lowering.py make_reduction / var_mean lowering).
_REDUCTION_OPS: frozenset[str] = frozenset(
    {
        "sum", "mean", "amax", "amin", "max", "min", "var_mean", "var", "std", "prod", "any",
        "all", "argmax", "argmin", "logsumexp", "_log_softmax", "_softmax", "cumsum",
    }
)  # fmt: skip

# Collective waits that hand back their input (no buffer of their own): torch/_inductor/
# comm_lowering.py ``_wait_tensor`` returns ``inp`` after ``ir._WaitKernel.create_wait`` (a
# kernel with a ``NoneLayout`` that mutates its input), as the CUDA kernel returns its input
# (torch/csrc/distributed/c10d/FunctionalRegistry.cpp ``wait_tensor``). Their schema has no
# alias annotation, so without this the collective's output would die at the wait and its
# memory be handed to a later buffer while the wait's readers still read it.
WAITS_RETURNING_INPUT: frozenset[str] = frozenset({"_c10d_functional.wait_tensor.default"})


def _op_key(target: Any) -> str:
    """``namespace.name.overload`` of an OpOverload (the emulations' key); else ``""``."""
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._schema.name.split('::')[-1]}.{target._overloadname}"
    return ""


# Values of nodes that compute sizes, not tensors (symbolic in a dynamic-shape graph).
_SIZE_VALUES = (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)

# A buffer is (the node that produced it, the output index); graph inputs have index 0.
BufferKey = tuple[str, int]


@dataclass
class Buffer:
    """One buffer of the plan: who made it, its size, and how its memory comes and goes."""

    key: BufferKey
    nbytes: int  # in a dynamic-shape graph, at the sizes it was compiled for (a size hint)
    dtype: torch.dtype | None
    is_input: bool = False
    made_at: int = -1  # node index whose kernel writes it
    last_use: int = -1  # node index of the last kernel reading it; -1: never read
    is_output: bool = False
    constant: bool = False  # a constant the compiled module holds: made once, never freed here
    reuses: BufferKey | None = None  # takes this dead buffer's memory (pool or in place)
    in_place: bool = False
    reused_later: bool = False  # its memory goes to a later buffer: no free
    # Its bytes as an expression: ``"65536"``, or ``"2048*s27"`` in a dynamic-shape graph.
    size_expr: str = ""

    def __post_init__(self) -> None:
        if not self.size_expr:  # a static size given as bytes only
            self.size_expr = str(self.nbytes)


@dataclass
class BufferPlan:
    """The emulated plan of one graph: kinds per node and the buffers in allocation order."""

    kinds: dict[str, str] = field(default_factory=dict)  # node -> placeholder/view/extern/...
    materialised: set[str] = field(default_factory=set)
    buffers: dict[BufferKey, Buffer] = field(default_factory=dict)
    # node name -> the buffers (node, index) it aliases (views) or is (materialised).
    bases: dict[str, tuple[BufferKey, ...]] = field(default_factory=dict)
    order: dict[str, int] = field(default_factory=dict)
    # device_put nodes of CPU constants -> bytes of the device copy the compiled module holds.
    held_constants: dict[str, int] = field(default_factory=dict)

    @property
    def inlined(self) -> list[str]:
        """Nodes computed inside fused kernels, never stored."""
        return [n for n, k in self.kinds.items() if k in ("pointwise",) and n not in self.materialised]

    @property
    def symbolic(self) -> bool:
        """Some buffer's size is symbolic: dynamo compiled the graph with dynamic shapes."""
        return any(not b.size_expr.isdigit() for b in self.buffers.values())

    def allocated_bytes(self) -> int:
        """Bytes the wrapper asks the allocator for (reused buffers excluded)."""
        return sum(b.nbytes for b in self.buffers.values() if not b.is_input and b.reuses is None)

    def kept_after(self) -> list[Buffer]:
        """Intermediate buffers alive when the graph returns (its outputs)."""
        return [b for b in self.buffers.values() if b.is_output and not b.is_input]


def _op_name(node: torch.fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    return getattr(target, "__name__", str(target))


def _classify(node: torch.fx.Node) -> str:
    if node.op == "placeholder":
        return "placeholder"
    if node.op == "output":
        return "output"
    if node.op == "get_attr":
        return "constant"
    if node.op != "call_function":  # call_module / call_method: run as they are, materialised
        return "extern"
    if isinstance(node.meta.get("val"), _SIZE_VALUES) and not any(
        isinstance(n.meta.get("val"), torch.Tensor) for n in node.all_input_nodes
    ):
        # A size computed from sizes (8 * s27) in a dynamic-shape graph: the wrapper evaluates
        # it in Python (its symbolic size expressions), no kernel, no buffer. A scalar read
        # from a tensor (_local_scalar_dense) stays a kernel that reads its input's buffer.
        return "size"
    target = node.target
    if target is operator.getitem:
        return "getitem"
    if _op_key(target) in WAITS_RETURNING_INPUT:
        return "view"
    if isinstance(target, torch._ops.OpOverload):
        returns = target._schema.returns
        aliased = [r.alias_info for r in returns if r.alias_info is not None]
        if aliased:
            # Views alias their input; out-of-graph writes (copy_ into an input) write it.
            return "view" if not any(a.is_write for a in aliased) else "mutation"
        name = _op_name(node)
        if name in _REDUCTION_OPS:
            return "reduction"
        if torch.Tag.pointwise in target.tags or name in _INLINED_OPS:
            return "pointwise"
    return "extern"


def node_kind(node: torch.fx.Node) -> str:
    """The plan's kind of ``node`` by its op alone: ``pointwise``, ``reduction``, ``view``,
    ``extern``, ... (before the plan decides which pointwise values are materialised)."""
    return _classify(node)


def _tensors(val: Any) -> list[tuple[int, Any]]:
    if isinstance(val, torch.Tensor):
        return [(0, val)]
    if isinstance(val, (list, tuple)):
        return [(i, v) for i, v in enumerate(val) if isinstance(v, torch.Tensor)]
    return []


def _sized(val: Any) -> tuple[int, str]:
    """A tensor's storage bytes: its size hint and its expression, without guarding on either.

    In a graph dynamo compiled with dynamic shapes the sizes are symbolic; ``int()`` of one
    would add a guard that specialises the graph to this call's sizes (so every new size
    recompiled static). Inductor plans with the symbolic size (wrapper.py ``buffer_reuse_key``:
    ``sympy_str(sizevars.simplify(storage_size))``, "so that we don't try to reuse a buffer for
    s0 for s1, just because they happen to share the same size hint") and weighs peaks by
    size hints (``EfficientPeakEstimate._get_size``: ``optimization_hint(..., fallback=0)``).
    """
    try:
        size = val.untyped_storage().nbytes()
    except (NotImplementedError, RuntimeError):
        size = val.numel() * val.element_size()
    if isinstance(size, torch.SymInt):
        shape_env, expr = size.node.shape_env, size.node.expr
        if hasattr(shape_env, "optimization_hint"):  # torch >= 2.12: size_hint is deprecated
            hint = shape_env.optimization_hint(expr, fallback=0)
        else:  # ShapeEnv.size_hint "does not introduce a guard"
            hint = shape_env.size_hint(expr, allow_none=True)
        return (0 if hint is None else int(hint)), str(shape_env.simplify(expr))
    return int(size), str(int(size))


def _buffer(key: BufferKey, val: Any, **fields: Any) -> Buffer:
    nbytes, size_expr = _sized(val)
    return Buffer(key, nbytes, val.dtype, size_expr=size_expr, **fields)


def _input_nodes(node: torch.fx.Node) -> list[torch.fx.Node]:
    return [n for n in node.all_input_nodes]


def fetch_attr(gm: torch.fx.GraphModule, target: str) -> Any:
    """The value of a ``get_attr`` node: the dotted attribute of the graph module."""
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _inlined_constant(value: torch.Tensor) -> bool:
    """graph.py get_attr: a 0-d constant is a scalar, a 1-D one of <= 8 elements is inlined."""
    return value.dim() == 0 or (value.dim() == 1 and value.shape[0] <= 8)


def plan_graph(gm: torch.fx.GraphModule) -> BufferPlan:
    """Emulate Inductor's buffers and wrapper memory plan for ``gm`` (nodes carry ``meta['val']``).

    Args:
        gm: an AOTAutograd forward, backward or inference graph of aten ops.

    Returns:
        The plan: which nodes are buffers, each buffer's size, last use and reuse.
    """
    plan = BufferPlan()
    nodes = list(gm.graph.nodes)
    plan.order = {n.name: i for i, n in enumerate(nodes)}
    kinds = plan.kinds
    for node in nodes:
        kinds[node.name] = _classify(node)
    # getitem takes its parent's kind: an element of a view op's list (split) is a view.
    for node in nodes:
        if kinds[node.name] == "getitem":
            parent = node.args[0]
            assert isinstance(parent, torch.fx.Node)
            kinds[node.name] = "view" if kinds[parent.name] == "view" else "element"

    def consumers(node: torch.fx.Node) -> list[torch.fx.Node]:
        """Non-view users, looking through views and list elements of view ops."""
        out: list[torch.fx.Node] = []
        for user in node.users:
            if kinds[user.name] == "view":
                out.extend(consumers(user))
            else:
                out.append(user)
        return out

    # Reads of each node's value when inlined: the buffers its loader reads, and its op count.
    reads: dict[str, frozenset[BufferKey]] = {}
    opcount: dict[str, int] = {}
    materialised = plan.materialised
    values: dict[str, Any] = {}  # get_attr values, for nodes without meta['val']
    # Nodes whose value reads CPU constants only (and their bytes, for a device copy).
    constant_bytes: dict[str, int] = {}
    for i, node in enumerate(nodes):
        kind = kinds[node.name]
        if kind == "output":
            continue
        inputs = _input_nodes(node)
        if kind == "constant":
            value = values[node.name] = fetch_attr(gm, str(node.target))
            plan.bases[node.name] = ()
            reads[node.name] = frozenset()
            opcount[node.name] = 0
            if not isinstance(value, torch.Tensor):
                continue  # a subgraph or script object: no device memory
            if value.device.type == "cpu":
                constant_bytes[node.name] = 0 if _inlined_constant(value) else _sized(value)[0]
                continue
            if _inlined_constant(value):
                kinds[node.name] = kind = "pointwise"  # inlined like any pointwise value
            else:
                key = (node.name, 0)
                plan.buffers[key] = _buffer(key, value, is_input=True, constant=True)
                plan.bases[node.name] = (key,)
                reads[node.name] = frozenset({key})
                continue
        elif inputs and all(n.name in constant_bytes for n in inputs):
            if kind in ("pointwise", "view", "element"):
                constant_bytes[node.name] = max(constant_bytes[n.name] for n in inputs)
                kinds[node.name] = "constant"
                plan.bases[node.name] = ()
                reads[node.name] = frozenset()
                opcount[node.name] = 0
                continue
            if _op_name(node) == "device_put":
                # ir.py DeviceCopy.create -> constant_to_device: copied once, read inlined.
                held = max(constant_bytes[n.name] for n in inputs)
                if held:
                    plan.held_constants[node.name] = held
                kinds[node.name] = kind = "pointwise"
        if kind == "size":
            plan.bases[node.name] = ()
            reads[node.name] = frozenset()
            opcount[node.name] = 0
            continue
        if kind == "placeholder":
            key = (node.name, 0)
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                plan.buffers[key] = _buffer(key, val, is_input=True, made_at=-1)
            plan.bases[node.name] = (key,)
            reads[node.name] = frozenset({key})
            opcount[node.name] = 0
            continue
        if kind in ("view", "mutation"):
            base = inputs[0] if inputs else None
            plan.bases[node.name] = plan.bases.get(base.name, ()) if base is not None else ()
            reads[node.name] = frozenset().union(*(reads.get(n.name, frozenset()) for n in inputs))
            opcount[node.name] = sum(opcount.get(n.name, 0) for n in inputs)
            continue
        if kind == "element":
            parent = node.args[0]
            assert isinstance(parent, torch.fx.Node)
            index = node.args[1]
            key = (parent.name, int(index))
            plan.bases[node.name] = (key,) if key in plan.buffers else ()
            reads[node.name] = frozenset(plan.bases[node.name])
            opcount[node.name] = 0
            continue
        inlined_reads = frozenset().union(*(reads.get(n.name, frozenset()) for n in inputs))
        users = consumers(node)
        must = kind in ("extern", "reduction") or any(
            kinds[u.name] in ("extern", "output", "mutation") or kinds[u.name] == "element"
            for u in users
        )
        ops = 1 + sum(opcount.get(n.name, 0) for n in inputs if n.name not in materialised)
        if not must and len({u.name for u in users}) > 1:
            # ir.py StorageBox.should_realize_on_reuse (graph fan-out).
            must = len(inlined_reads) > REALIZE_READS_THRESHOLD or ops > REALIZE_OPCOUNT_THRESHOLD
        if not must:
            reads[node.name] = inlined_reads
            opcount[node.name] = ops
            plan.bases[node.name] = ()
            continue
        materialised.add(node.name)
        keys: list[BufferKey] = []
        for index, val in _tensors(node.meta.get("val", values.get(node.name))):
            key = (node.name, index)
            plan.buffers[key] = _buffer(key, val, made_at=i)
            keys.append(key)
        plan.bases[node.name] = tuple(keys)
        reads[node.name] = frozenset(keys)
        opcount[node.name] = 0
        # The kernel reads its inputs' buffers (inlined producers read theirs).
        for key in inlined_reads:
            if key in plan.buffers:  # not a SymInt input
                plan.buffers[key].last_use = max(plan.buffers[key].last_use, i)
    for node in nodes:
        if kinds[node.name] == "output":
            for value in node.all_input_nodes:
                for key in plan.bases.get(value.name, ()):
                    if key in plan.buffers:
                        plan.buffers[key].is_output = True
            # Mutations at the end write their targets: their sources are read there.
            break
    for node in nodes:
        if kinds[node.name] == "mutation":
            i = plan.order[node.name]
            for key in reads.get(node.name, frozenset()):
                if key in plan.buffers:
                    plan.buffers[key].last_use = max(plan.buffers[key].last_use, i)
    _plan_reuse(plan, nodes, reads)
    return plan


def _plan_reuse(
    plan: BufferPlan, nodes: list[torch.fx.Node], reads: dict[str, frozenset[BufferKey]]
) -> None:
    """wrapper.py MemoryPlanningState: in-place and pooled reuse, in kernel order.

    A pooled buffer is taken only by the next kernel, or when holding it until then keeps the
    graph under its estimated peak (wrapper.py ``AllocateLine.should_reuse_buffer`` with
    ``EfficientPeakEstimate``): a reused buffer is never freed, so it stays allocated between.
    """
    kernels = [i for i, n in enumerate(nodes) if n.name in plan.materialised]
    position = {i: k for k, i in enumerate(kernels)}
    live = _live_by_kernel(plan, kernels)
    overall_peak = max(live, default=0)
    dying: dict[int, list[Buffer]] = {}
    for buf in plan.buffers.values():
        if not buf.is_output and buf.last_use >= 0:
            dying.setdefault(buf.last_use, []).append(buf)
    # Keyed as wrapper.py buffer_reuse_key: dtype and the symbolic size, not its hint.
    pool: dict[tuple[Any, str], list[Buffer]] = {}
    for i, node in enumerate(nodes):
        if node.name in plan.materialised:
            kernel_reads = _kernel_reads(node, reads)
            for key in plan.bases.get(node.name, ()):
                buf = plan.buffers[key]
                if buf.made_at != i:
                    continue
                donor = _in_place_donor(plan, buf, node, kernel_reads, i)
                if donor is not None:
                    buf.in_place = True
                else:
                    donor = _pooled_donor(pool, buf, kernels, position, live, overall_peak)
                if donor is not None:
                    buf.reuses = donor.key
                    donor.reused_later = True
        for buf in dying.get(i, ()):
            if not buf.is_input and not buf.reused_later:
                pool.setdefault((buf.dtype, buf.size_expr), []).append(buf)


def _live_by_kernel(plan: BufferPlan, kernels: list[int]) -> list[int]:
    """Bytes alive while each kernel runs, before reuse (memory.py ``estimate_peak_memory``)."""
    delta = [0] * (len(kernels) + 1)
    for buf in plan.buffers.values():
        first = bisect.bisect_left(kernels, buf.made_at)  # inputs (made_at -1): from the start
        if buf.is_output or buf.last_use < 0:
            last = len(kernels) - 1
        else:
            last = bisect.bisect_right(kernels, buf.last_use) - 1
        if first <= last:
            delta[first] += buf.nbytes
            delta[last + 1] -= buf.nbytes
    return list(itertools.accumulate(delta[:-1]))


def _pooled_donor(
    pool: dict[tuple[Any, str], list[Buffer]],
    buf: Buffer,
    kernels: list[int],
    position: dict[int, int],
    live: list[int],
    overall_peak: int,
) -> Buffer | None:
    stack = pool.get((buf.dtype, buf.size_expr))
    if not stack:
        return None
    donor = stack.pop()
    # Kernels strictly between the donor's last reader and this buffer's kernel.
    start = bisect.bisect_right(kernels, donor.last_use)
    end = position[buf.made_at] - 1
    if start > end:  # the next kernel: always reused
        return donor
    if buf.nbytes + max(live[start : end + 1]) <= overall_peak:
        for k in range(start, end + 1):  # EfficientPeakEstimate.update_peak_between
            live[k] += buf.nbytes
        return donor
    stack.append(donor)
    return None


def _kernel_reads(node: torch.fx.Node, reads: dict[str, frozenset[BufferKey]]) -> frozenset[BufferKey]:
    return frozenset().union(*(reads.get(n.name, frozenset()) for n in node.all_input_nodes))


def _in_place_donor(
    plan: BufferPlan, buf: Buffer, node: torch.fx.Node, kernel_reads: Iterable[BufferKey], i: int
) -> Buffer | None:
    """scheduler.py decide_inplace_update: a fused kernel's dying input of the same layout."""
    if plan.kinds[node.name] not in ("pointwise",):
        return None
    for key in sorted(kernel_reads):
        donor = plan.buffers.get(key)
        if (
            donor is not None
            and not donor.is_input
            and not donor.is_output
            and not donor.reused_later
            and donor.last_use == i
            and donor.dtype == buf.dtype
            # wrapper.py can_match_buffer_size: the symbolic sizes' text, not their hints.
            and donor.size_expr == buf.size_expr
        ):
            return donor
    return None

"""``torch.compile`` recorded GPU-free: real dynamo and AOTAutograd, Inductor's memory emulated.

What runs for real: dynamo captures the graph on the step's meta tensors, and AOTAutograd traces
it with Inductor's own decomposition table (torch/_inductor/decomposition.py
``select_decomp_table``) and partitions it with the min-cut partitioner exactly as Inductor asks
(torch/_inductor/compile_fx.py ``partition_fn``: ``min_cut_rematerialization_partition(...,
compiler="inductor")``), so what is saved for backward is what a GPU run saves. The partitioner
is device independent. Inductor's joint-graph pattern passes are not run: on meta tensors their
constant folding replaces every value by an empty tensor (checked on torch 2.13). Its post-grad
micro-pipeline TP pass is, where async TP turned it on (``async_tp.py``).

What is emulated: Inductor itself. Lowering for CUDA needs Triton, which CPU torch wheels do not
ship (``import triton`` fails), so each forward/backward graph is executed by
:class:`PlannedGraph`, which follows ``compile_plan.plan_graph``: fused values are computed on
meta but never recorded, buffers are recorded when their kernel runs and freed after their last
reader, and reused buffers keep one allocation. Constants (``get_attr`` nodes) are read from the
graph module, never made per call; the device copies the compiled graph holds are allocated on
its first call and freed when it dies. Extern kernels with a CUDA emulation (cuBLAS
workspace, SDPA backward temporaries) run through the engine's hooks. SDPA calls in the
captured graph are replaced, before AOTAutograd traces them, by the fused kernel CUDA would pick
on the target GPU (``emulations/sdpa.py``), as Inductor keeps it as an extern kernel: on meta
the composite would take the math path.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._python_dispatch import _disable_current_modes

from oomkit.prediction.tracing.async_tp import micro_pipeline_tp_enabled, rewrite_for_async_tp
from oomkit.prediction.tracing.compile_plan import (
    WAITS_RETURNING_INPUT,
    BufferKey,
    BufferPlan,
    fetch_attr,
    plan_graph,
)
from oomkit.prediction.tracing.emulation import EmulationContext
from oomkit.prediction.tracing.fake_storages import mark_host
from oomkit.prediction.tracing.storages import Allocation, tensor_storage
from oomkit.prediction.tracing.value_reads import active_known_values

if TYPE_CHECKING:
    from oomkit.prediction.tracing.engine import CudaEmulationEngine
    from oomkit.prediction.tracing.values import KnownValues

__all__ = ["DYNAMIC_SHAPES", "InductorStandIn", "PlannedGraph"]

# The count of compiled graphs with symbolic sizes in InductorStandIn.graphs (the assumption
# lists it after the graphs' kinds). Dynamo decides which: torch/_dynamo/config.py
# automatic_dynamic_shapes recompiles a frame whose input sizes changed with those sizes
# symbolic (pgo.py update_automatic_dynamic), unless torch.compile(dynamic=False) or
# mark_static keeps them static.
DYNAMIC_SHAPES = (
    "of them with dynamic shapes, sizes dynamo made symbolic as it does on a GPU (by default "
    "those that changed between calls); a buffer is reused only for an equal symbolic size"
)

_SDPA_NAME = "torch.nn.functional.scaled_dot_product_attention"


class PlannedGraph:
    """Runs one AOTAutograd graph on meta as Inductor's wrapper would allocate for it.

    Called by AOTAutograd's runtime with a boxed argument list (``_boxed_call``), which it
    clears, as Inductor's generated ``call(args)`` does, so inputs die after their last use.
    """

    def __init__(self, gm: torch.fx.GraphModule, plan: BufferPlan, engine: CudaEmulationEngine):
        # An instance attribute: dynamo's disable wrapper copies the instance __dict__ only.
        self._boxed_call = True
        self.gm = gm
        self.plan = plan
        self._engine = engine
        self._nodes = list(gm.graph.nodes)
        index = {n.name: i for i, n in enumerate(self._nodes)}
        # Python references: an env entry goes after its last user runs (FX's own rule).
        self._drop_after: dict[int, list[str]] = {}
        for i, node in enumerate(self._nodes):
            last = max((index[u.name] for u in node.users), default=i)
            self._drop_after.setdefault(last, []).append(node.name)
        # Buffers: kept alive until their last reading kernel, then freed or handed on.
        self._dying: dict[int, list[BufferKey]] = {}
        for buf in plan.buffers.values():
            if not buf.is_output and buf.last_use >= 0:
                self._dying.setdefault(buf.last_use, []).append(buf.key)
        # Device copies of CPU constants the compiled module holds: made on the first call.
        self._held_constants: list[int] | None = None
        # The open value tracking, per call: kernels run with the modes off, so the values
        # they compute are followed here (a count the eager code then reads as a size).
        self._known: KnownValues | None = None

    def __call__(self, args: list[Any]) -> list[Any]:
        engine = self._engine
        plan = self.plan
        env: dict[str, Any] = {}
        keep: dict[BufferKey, Any] = {}
        held: dict[BufferKey, Allocation] = {}
        # Taken one by one, so that no list holds an input past its last use.
        placeholders = args[::-1]
        args.clear()
        result: list[Any] = []
        if self._held_constants is None:
            self._hold_constants()
        self._known = active_known_values()
        with _disable_current_modes(), _inputs_fake_mode(placeholders):
            for i, node in enumerate(self._nodes):
                if node.op == "placeholder":
                    value = placeholders.pop()
                    env[node.name] = value
                    keep[(node.name, 0)] = value
                    del value
                elif node.op == "output":
                    result = list(torch.fx.node.map_arg(node.args[0], lambda n: env[n.name]))
                    break
                else:
                    env[node.name] = self._run(node, i, env, keep, held)
                for key in self._dying.get(i, ()):
                    value = keep.pop(key, None)
                    if plan.buffers[key].reused_later and value is not None:
                        storage = tensor_storage(value, engine.device_type)
                        alloc = engine.table.unbind(storage) if storage is not None else None
                        if alloc is not None:
                            held[key] = alloc
                    del value
                for name in self._drop_after.get(i, ()):
                    env.pop(name, None)
            env.clear()
            keep.clear()
        for alloc in held.values():  # pragma: no cover - every held buffer is reused in plan
            engine.sink.free(alloc)
        return result

    def _hold_constants(self) -> None:
        """Allocate the device copies of constants once, for as long as this graph lives."""
        engine = self._engine
        ids = [
            engine.allocate_synthetic(nbytes, "buffer", "torch.compile constant", what=name)
            for name, nbytes in self.plan.held_constants.items()
        ]
        self._held_constants = ids
        if ids:
            weakref.finalize(self, _free_synthetic, engine, ids)

    def _run(
        self,
        node: torch.fx.Node,
        i: int,
        env: dict[str, Any],
        keep: dict[BufferKey, Any],
        held: dict[BufferKey, Allocation],
    ) -> Any:
        engine = self._engine
        plan = self.plan
        if node.op == "get_attr":
            value = self._call(node, (), {})
            for key in plan.bases.get(node.name, ()):
                # A device constant held by the compiled module: recorded once, when first read.
                keep[key] = value
                storage = tensor_storage(value, engine.device_type)
                error = None if storage is None else engine.sync_storage(storage, "constant")
                if error is not None:
                    raise engine.sink.refused(error)
            return value
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env[n.name])
        if node.target in _rng_wrappers():
            return _run_rng_wrapped(engine, node.target, args, kwargs)
        name = str(node.target)
        made = [plan.buffers[k] for k in plan.bases.get(node.name, ()) if plan.buffers[k].made_at == i]
        if name in WAITS_RETURNING_INPUT and engine.has_emulation(name):
            # A view of its input in the plan; its emulation makes the output share the
            # input's storage (collectives.py), where the meta kernel would make a new one.
            return engine.run_op(node.target, tuple(args), dict(kwargs))
        if plan.kinds[node.name] == "extern" and engine.has_emulation(name):
            # A kernel with CUDA workspaces: its hook allocates them around a fresh output.
            for buf in made:
                if buf.reuses is not None and buf.reuses in held:
                    engine.sink.free(held.pop(buf.reuses))
            out = engine.run_op(node.target, tuple(args), dict(kwargs))
            self._follow_values(node, args, kwargs, out)
            for buf in made:
                keep[buf.key] = _element(out, buf.key[1])
            return out
        out = self._call(node, args, kwargs)
        if plan.kinds[node.name] == "constant":
            # A value computed from CPU constants only (``torch.tensor(0.0)``'s
            # ``lift_fresh_copy``): host memory, as the wrapper keeps it on the CPU (graph.py
            # GraphLowering.get_attr; an extern kernel such as ``index_put`` takes a 0-d CPU
            # value). On the fake group the host and the device share the ``cpu`` fake device,
            # so it is marked as the eager step marks ``lift_fresh`` (distributed.py
            # HOST_TENSOR_EMULATIONS); on meta it is a real CPU tensor already.
            for _, tensor in _tensor_leaves(out):
                mark_host(tensor)
        self._follow_values(node, args, kwargs, out)
        for buf in made:
            tensor = _element(out, buf.key[1])
            keep[buf.key] = tensor
            storage = tensor_storage(tensor, engine.device_type)
            if storage is None:
                continue
            donor = held.pop(buf.reuses, None) if buf.reuses is not None else None
            if donor is None and buf.in_place and buf.reuses in keep:
                # Written in place of an input that dies in this kernel (scheduler.py
                # decide_inplace_update): the input's block, taken now; it is not yet in `held`,
                # which gets a buffer only after the kernel that last reads it.
                dying = tensor_storage(keep.pop(buf.reuses), engine.device_type)
                donor = engine.table.unbind(dying) if dying is not None else None
            if donor is not None:
                engine.table.bind(storage, donor)
            else:
                error = engine.sync_storage(storage, name)
                if error is not None:
                    raise engine.sink.refused(error)
        return out


    def _follow_values(self, node: torch.fx.Node, args: Any, kwargs: Any, out: Any) -> None:
        if self._known is not None and node.op == "call_function":
            # Host bookkeeping, outside the inputs' fake mode (``_inputs_fake_mode``): a graph
            # constant is a real CPU tensor (``tensor(0)``, the ignore index of a compiled
            # loss), whose values ``values.known_value`` reads with ``detach()``, which a fake
            # mode refuses for a real tensor (fake_tensor.py
            # ``validate_and_convert_non_fake_tensors``).
            with unset_fake_temporarily():
                self._known.follow(node.target, tuple(args), dict(kwargs), out)

    def _call(self, node: torch.fx.Node, args: Any, kwargs: Any) -> Any:
        """The node's value, by its FX op (torch/fx/interpreter.py ``Interpreter`` semantics)."""
        if node.op == "get_attr":
            # A constant of the graph module (graph.py GraphLowering.get_attr): not made per call.
            return fetch_attr(self.gm, str(node.target))
        if node.op == "call_method":
            self_obj, *rest = args
            return getattr(self_obj, str(node.target))(*rest, **kwargs)
        if node.op == "call_module":
            return self.gm.get_submodule(str(node.target))(*args, **kwargs)
        return node.target(*args, **kwargs)  # type: ignore[operator]


def _inputs_fake_mode(inputs: list[Any]) -> contextlib.AbstractContextManager[Any]:
    """The fake mode of the graph's fake inputs, to make its new tensors in; else nothing.

    A step recorded under ``FakeTensorMode`` (a fake process group: ``distributed.py``) calls
    the graph with fake tensors; with every mode off, a tensor a kernel makes from nothing
    (``full``, ``empty``) would be a plain tensor, which fake kernels refuse beside fake inputs
    (fake_tensor.py ``validate_and_convert_non_fake_tensors``). Made in the inputs' mode it is
    fake too, as the graph's own fake run made it (AOTAutograd traced it in that mode).
    """
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode(inputs)
    return contextlib.nullcontext() if mode is None else mode


def _free_synthetic(engine: CudaEmulationEngine, ids: list[int]) -> None:
    for alloc_id in ids:
        engine.free_synthetic(alloc_id)


@functools.cache
def _rng_wrappers() -> tuple[Any, Any]:
    """The higher-order ops AOTAutograd wraps a recomputed seeded op in (torch/_prims/rng_prims.py
    ``run_and_save_rng_state``, ``run_with_rng_state``)."""
    from torch._prims import rng_prims

    return rng_prims.run_and_save_rng_state, rng_prims.run_with_rng_state


def _run_rng_wrapped(
    engine: CudaEmulationEngine, wrapper: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """A seeded op under activation checkpointing, as compiled code runs it.

    torch/_functorch/partitioners.py ``functionalize_rng_ops`` wraps a seeded op that backward
    recomputes (SDPA, dropout) in ``run_and_save_rng_state(op, *args)`` in the forward, which
    returns ``(rng state, op's outputs)``, and ``run_with_rng_state(state, op, *args)`` in the
    backward. Inductor runs both as fallback kernels (torch/_inductor/lowering.py
    ``make_fallback``), so the op's outputs are buffers of their own: the op runs through the
    engine (its CUDA emulation, its outputs recorded when made). The state is the host
    generator's, as the HOP's CPU kernel returns it (``torch.get_rng_state()``; on a GPU the
    CUDA generator's state, also on the host): no device memory.
    """
    run_and_save, _ = _rng_wrappers()
    if wrapper is run_and_save:
        op, *rest = args
        return torch.get_rng_state(), engine.run_op(op, tuple(rest), dict(kwargs))
    _state, op, *rest = args
    return engine.run_op(op, tuple(rest), dict(kwargs))


def _tensor_leaves(out: Any) -> list[tuple[int, torch.Tensor]]:
    if isinstance(out, torch.Tensor):
        return [(0, out)]
    if isinstance(out, (list, tuple)):
        return [(i, t) for i, t in enumerate(out) if isinstance(t, torch.Tensor)]
    return []


def _element(out: Any, index: int) -> Any:
    return out[index] if isinstance(out, (list, tuple)) else out


class InductorStandIn:
    """Takes the place of ``torch._inductor.compile_fx.compile_fx`` while a step is recorded.

    A captured graph that AOTAutograd or the plan cannot handle runs as dynamo captured it
    (eagerly, each op recorded as in an eager step), and is counted in ``failed``.

    Attributes:
        plans: ``(kind, plan)`` per compiled graph: ``forward``, ``backward`` or ``inference``.
        graphs: compiled graphs by kind (and, once recorded, dynamo's graph breaks:
            ``compiled.GRAPH_BREAKS``).
        failed: captured graphs recorded eagerly instead, by the error that stopped them.
        cuda_graphs: captured graphs compiled with CUDA graphs asked for (``triton.cudagraphs``:
            ``mode="reduce-overhead"`` or ``"max-autotune"``, torch/_inductor/__init__.py
            ``list_mode_options``), which are not modelled (``warnings``).
    """

    def __init__(self, engine: CudaEmulationEngine) -> None:
        self._engine = engine
        self.plans: list[tuple[str, BufferPlan]] = []
        self.graphs: Counter[str] = Counter()
        self.failed: Counter[str] = Counter()
        self.cuda_graphs = 0

    def warnings(self) -> list[str]:
        """What the recording of the compiled code leaves out: graphs recorded eagerly, and
        CUDA graphs asked for."""
        out = [
            f"torch.compile: {n} captured graph(s) could not be compiled GPU-free ({why}) and "
            "were recorded eagerly"
            for why, n in sorted(self.failed.items())
        ]
        if self.cuda_graphs:
            out.append(
                f"torch.compile: {self.cuda_graphs} captured graph(s) asked for CUDA graphs "
                "(mode='reduce-overhead' or 'max-autotune'), recorded as plain compiled code: "
                "CUDA graph trees keep each graph's memory in a private pool between runs "
                "(torch/_inductor/cudagraph_trees.py), which is not modelled, so a real run "
                "reserves more than this figure; mode='default' is what it predicts"
            )
        return out

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any, **options: Any) -> Any:
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.partitioners import min_cut_rematerialization_partition
        from torch._inductor.decomposition import select_decomp_table

        _fused_sdpa_in(gm, self._engine)
        if (options.get("config_patches") or {}).get("triton.cudagraphs"):
            self.cuda_graphs += 1
        backend = aot_autograd(
            fw_compiler=self._compiler("forward"),
            bw_compiler=self._compiler("backward"),
            inference_compiler=self._compiler("inference"),
            decompositions=select_decomp_table(),
            # compile_fx.py partition_fn: the partitioner Inductor asks for.
            partition_fn=functools.partial(
                min_cut_rematerialization_partition, compiler="inductor"
            ),
            keep_inference_input_mutations=True,
        )
        try:
            return backend(gm, example_inputs)
        except Exception as exc:  # noqa: BLE001 - any failure: record the graph eagerly, and say so
            self.failed[_reason(exc)] += 1
            return gm.forward

    def _compiler(self, kind: str) -> Callable[[torch.fx.GraphModule, Any], PlannedGraph]:
        def compile_graph(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
            try:
                if micro_pipeline_tp_enabled():  # async TP: Inductor's post-grad pass (async_tp.py)
                    rewrite_for_async_tp(gm, example_inputs)
                plan = plan_graph(gm)
            except Exception as exc:  # noqa: BLE001 - run this graph eagerly, and say so
                self.failed[_reason(exc)] += 1
                return _eager(gm)
            self.plans.append((kind, plan))
            self.graphs[kind] += 1
            if plan.symbolic:
                self.graphs[DYNAMIC_SHAPES] += 1
            return PlannedGraph(gm, plan, self._engine)

        return compile_graph


def _reason(exc: Exception) -> str:
    first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _eager(gm: torch.fx.GraphModule) -> Callable[[list[Any]], Any]:
    """A boxed runner of ``gm`` as it is: its ops run through the recorder as eager ops."""

    def run(args: list[Any]) -> Any:
        values = list(args)
        args.clear()
        return gm(*values)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _fused_sdpa_in(
    gm: torch.fx.GraphModule,
    engine: CudaEmulationEngine,
    hook: Callable[..., Any] | None = None,
) -> None:
    """Point SDPA calls of the captured graph at the fused kernel CUDA picks for them.

    Subgraphs too: dynamo captures a checkpointed region (``torch.utils.checkpoint`` or a
    ``checkpoint_wrapper`` block) as the ``tag_activation_checkpoint`` higher-order op whose
    body is a ``GraphModule`` attribute of the graph (torch/_dynamo/variables/higher_order_ops.py
    ``CheckpointHigherOrderVariable``), read by a ``get_attr`` node; the SDPA of a checkpointed
    block is there. Left as it is, AOTAutograd would trace the composite on the fake ``cpu``
    device into ``_scaled_dot_product_flash_attention_for_cpu``, which selective AC's save list
    (CUDA's kernels) does not save, so it would be recomputed and, being seeded, wrapped in
    ``run_and_save_rng_state`` (partitioners.py ``functionalize_rng_ops``), as no GPU does.
    """
    hook = _cuda_sdpa(engine) if hook is None else hook
    changed = False
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            body = getattr(gm, str(node.target), None)
            if isinstance(body, torch.fx.GraphModule):
                _fused_sdpa_in(body, engine, hook)
            continue
        target = node.target
        if node.op == "call_function" and (
            target is torch._C._nn.scaled_dot_product_attention
            or getattr(target, "__name__", None) == "scaled_dot_product_attention"
        ):
            node.target = hook
            changed = True
    if changed:
        gm.recompile()


def _cuda_sdpa(engine: CudaEmulationEngine) -> Callable[..., Any]:
    from oomkit.prediction.tracing.emulations.sdpa import _run_sdpa
    from oomkit.prediction.tracing.emulations.sdpa_backend import current_sdpa_settings

    # The eager path's own hook (emulations/sdpa.py register_sdpa), which carries the target's
    # cuDNN version (Target.cudnn_version); the settings in effect only where none is registered.
    hook = engine.emulation(_SDPA_NAME)

    def fused_sdpa(*args: Any, **kwargs: Any) -> Any:
        ctx = EmulationContext(
            _SDPA_NAME, torch._C._nn.scaled_dot_product_attention, args, kwargs, engine
        )
        if hook is not None:
            return hook(ctx)
        return _run_sdpa(ctx, current_sdpa_settings())

    fused_sdpa.__name__ = "oomkit_fused_sdpa"
    return fused_sdpa

"""Record a training or inference step on the meta device as an allocation trace.

``Tracer`` is the composable recorder; ``trace_step`` (``step_runner.py``) runs it once.

How each fact is observed (all hooks are removed on exit):
- allocations: a TorchDispatchMode sees every aten op's outputs; a storage not seen before is an
  allocation of its ``nbytes`` (views share their base's storage; zero-byte storages are none).
- frees: ``weakref.finalize`` on the storage (``storages.py``): lifetimes follow refcounts.
- module path: global forward pre/post hooks keep a stack of module calls. In backward, autograd
  hooks on each call's outputs and inputs say whose backward runs (see ``_backward_modules.py``),
  so a backward allocation carries the path of the module whose backward made it. A parameter,
  its gradient and its optimizer state are tagged with the module that owns the parameter.
- parameters / buffers: registration hooks, the module stack and ``track()``.
- gradients: ``register_post_accumulate_grad_hook`` on every parameter seen.
- optimizer state: global optimizer step pre/post hooks read ``optimizer.state``.
- saved activations: ``saved_tensors_hooks`` whose pack hook notes the storage.
- values read (``.item()``, ``bool()``): ``value_reads.value_tracking``; compiled code runs
  eagerly, or compiled with Inductor's memory emulated (``compiled.py``); both are reported.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
import torch.nn.modules.module as _module_hooks
import torch.optim.optimizer as _optimizer_hooks
from torch.utils._pytree import tree_leaves

from oomkit.core.gpus import GpuSpec, get_gpu
from oomkit.core.target import Target
from oomkit.prediction.tracing._backward_modules import BackwardCall, BackwardModules
from oomkit.prediction.tracing.autocast import CudaAutocastEmulation
from oomkit.prediction.tracing.categories import Category, Phase, Role
from oomkit.prediction.tracing.compile_backend import InductorStandIn
from oomkit.prediction.tracing.compiled import compiled_code_eager, compiled_code_recorded
from oomkit.prediction.tracing.cuda_device import counting_allocations
from oomkit.prediction.tracing.emulation import CUDA_DIVERGENT_OPS, DEFAULT_EMULATIONS, OpEmulation
from oomkit.prediction.tracing.engine import CudaEmulationEngine
from oomkit.prediction.tracing.fake_storages import detach_saved
from oomkit.prediction.tracing.frames import UserFrameFinder
from oomkit.prediction.tracing.func_transforms import func_transforms_allowed
from oomkit.prediction.tracing.grad_scaler import grad_scaler_warnings, watch_grad_scalers
from oomkit.prediction.tracing.module_paths import ModulePaths, wrapper_hook_warning_silenced
from oomkit.prediction.tracing.optimizers import cuda_optimizer_defaults
from oomkit.prediction.tracing.read_report import (
    compile_assumptions,
    read_assumptions,
    read_warnings,
)
from oomkit.prediction.tracing.recording import TraceRecording, build_recording
from oomkit.prediction.tracing.step_memory import StepMemory
from oomkit.prediction.tracing.storages import Allocation, parameter_name, tensor_storage
from oomkit.prediction.tracing.value_reads import ValueReads, value_tracking
from oomkit.prediction.tracing.values import KnownValues

__all__ = ["Tracer"]

# Categories tagged with the module that owns their parameter rather than where they were made.
_OWNED_CATEGORIES: frozenset[Category] = frozenset({"parameter", "gradient", "optimizer_state"})

# The device whose storages stand for CUDA memory. CPU tensors (AdamW's default ``step``
# counters, ``torch.tensor(1.0)`` scalars) live in host memory on a real GPU run too.
_DEVICE_TYPE = "meta"


@dataclass
class _ModuleCall:
    module: torch.nn.Module
    path: str
    call_id: int
    root_call_id: int
    # Call ids from the outermost call down to this one: how calls nest, for backward.
    lineage: tuple[int, ...]
    # Set when the call ran with grad enabled: its record for backward module tracking.
    backward: BackwardCall | None = None


class Tracer:
    """Records every device storage allocation and free of the code run inside it.

    Use as a context manager; read :attr:`recording` after it exits::

        with Tracer() as tracer:
            tracer.track(model, optimizer)   # storages that exist already
            tracer.mark_step()
            train_step()
        recording = tracer.recording

    One Tracer records once; tracers do not nest.
    """

    def __init__(
        self,
        *,
        emulations: Mapping[str, OpEmulation] | None = None,
        gpu: GpuSpec | None = None,
        values: Mapping[str, Any] | None = None,
        compile: bool = False,
        target: Target | None = None,
    ) -> None:
        """Create a recorder; nothing is installed until the ``with`` block starts.

        Args:
            emulations: per-op hooks by aten overload name; default ``DEFAULT_EMULATIONS``.
            gpu: the target device the CUDA emulations model (its compute capability picks the
                SDPA backend and the cuBLAS workspace size); ``None`` means an H100 SXM.
            values: tensor values read in the step, stated by the line that reads them
                (``{"train.py:42": 1024}``; ``value_reads.value_tracking``).
            compile: record ``torch.compile``d code as compiled (real dynamo and AOTAutograd
                partitioner, Inductor's fusion and buffer reuse emulated; ``compiled.py``)
                rather than running it eagerly.
            target: the machine whose allocator settings and PyTorch version the step's own
                memory reads are answered with (``step_memory``); ``None``: PyTorch's newest.
        """
        self.gpu: GpuSpec = get_gpu("h100-sxm") if gpu is None else gpu
        self._target = target
        self._frames = UserFrameFinder()
        self._log: list[tuple[Any, ...]] = []  # ("alloc", a) | ("free", a, frames) | ("step",)
        self._ids = itertools.count(1)
        self._call_ids = itertools.count(1)
        self._stack: list[_ModuleCall] = []
        self._backward_modules = BackwardModules()
        self._escapes: dict[int, list[Allocation]] = {}
        self._paths = ModulePaths()
        self._optimizer_depth = 0
        # By id with a weakref to check identity: tensors compare elementwise, so no WeakSet.
        self._grad_watched: dict[int, weakref.ref[torch.Tensor]] = {}
        self._tracked: list[weakref.ref[Any]] = []
        self._handles: list[Any] = []
        self._grad_scaler_steps: Counter[str] = Counter()
        self._autocast: CudaAutocastEmulation | None = None
        self._memory: StepMemory | None = None
        self._values = values
        self._value_modes: tuple[KnownValues, ValueReads] | None = None
        self._compiled: Counter[str] = Counter()
        self._compile = compile
        self._stand_in: InductorStandIn | None = None
        # id(param) -> (param, the module that registered it): tags its storages with that path.
        self._owners: dict[int, tuple[weakref.ref[Any], weakref.ref[torch.nn.Module]]] = {}
        self._late_first_seen = 0
        self._late_first_seen_bytes = 0
        self._exit_stack: contextlib.ExitStack | None = None
        self._recording: TraceRecording | None = None
        self.failed_op: tuple[str, BaseException] | None = None
        self.current_stream: Callable[[], int] = lambda: 0  # stream of new allocations
        # Runs the ops, applies the CUDA emulations and keeps the live storages (engine.py).
        self._engine = CudaEmulationEngine(
            _TracerSink(self),
            gpu=self.gpu,
            device_type=_DEVICE_TYPE,
            emulations=DEFAULT_EMULATIONS if emulations is None else emulations,
            divergent_ops=CUDA_DIVERGENT_OPS,
        )
        self._table = self._engine.table

    # ------------------------------------------------------------------ public API

    def __enter__(self) -> Tracer:
        if self._exit_stack is not None or self._recording is not None:
            raise RuntimeError("a Tracer records once; create a new Tracer for a new recording")
        stack = contextlib.ExitStack()
        self._handles += [
            _module_hooks.register_module_forward_pre_hook(self._on_forward_pre),
            _module_hooks.register_module_forward_hook(self._on_forward_post, always_call=True),
            _module_hooks.register_module_parameter_registration_hook(self._on_param_registered),
            _module_hooks.register_module_buffer_registration_hook(self._on_buffer_registered),
            _optimizer_hooks.register_optimizer_step_pre_hook(self._on_optimizer_pre),
            _optimizer_hooks.register_optimizer_step_post_hook(self._on_optimizer_post),
        ]
        stack.callback(self._remove_handles)
        stack.enter_context(wrapper_hook_warning_silenced())  # the hooks above are ours
        stack.callback(self._backward_modules.close)
        # CUDA behaviour of torch.optim (foreach/fused defaults) and of torch.autocast("cuda").
        stack.enter_context(cuda_optimizer_defaults())
        self._autocast = stack.enter_context(CudaAutocastEmulation(self._on_autocast_cached_cast))
        stack.enter_context(watch_grad_scalers(self._grad_scaler_steps))
        self._memory = stack.enter_context(counting_allocations(StepMemory(self._log, self._target)))
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack))
        stack.enter_context(func_transforms_allowed(self._pack, _unpack))
        if self._compile:
            self._stand_in = stack.enter_context(
                compiled_code_recorded(self._engine, self._compiled)
            )
        else:
            stack.enter_context(compiled_code_eager(self._compiled))
        # Below the engine's modes: the engine sees each op first, and the values are followed
        # in the op's own call (an op meta cannot run, with known inputs, is answered there).
        self._value_modes = stack.enter_context(value_tracking(self._values))
        stack.enter_context(self._engine.intercept())
        # FSDP frees and refills parameters with UntypedStorage.resize_, which no aten op shows.
        stack.enter_context(self._engine.storage_resize_accounted())
        # Every op of the recording runs below the frame that entered the tracer, which stays
        # suspended until the `with` block ends: the frames above it are looked up once.
        self._frames.hold(sys._getframe(1))
        stack.callback(self._frames.hold, None)
        self._exit_stack = stack
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._exit_stack is not None, "Tracer.__exit__ without __enter__"
        self._exit_stack.close()
        self._final_scan()
        self._table.close()
        self._recording = self._build()

    @property
    def recording(self) -> TraceRecording:
        """The trace, available once the ``with`` block has exited."""
        if self._recording is None:
            raise RuntimeError("the recording is ready once the Tracer's `with` block has exited")
        return self._recording

    def mark_step(self) -> None:
        """Start a new step: the next event is the first of the step."""
        self._log.append(("step",))

    def track(self, *objects: Any) -> None:
        """Record storages that exist already, as allocated now (before the first step).

        Args:
            objects: ``nn.Module`` (parameters, buffers, their ``.grad``), ``torch.optim``
                optimizers (their state) and tensors (inputs), possibly nested in lists, tuples
                and dicts. Other objects are ignored.
        """
        for obj in tree_leaves(list(objects)):
            if isinstance(obj, torch.nn.Module):
                self._tracked.append(weakref.ref(obj))
                self._paths.name_root(obj)
                self._note_module(obj, recurse=True, first_seen_ok=True)
            elif isinstance(obj, torch.optim.Optimizer):
                self._tracked.append(weakref.ref(obj))
                self._note_optimizer(obj, first_seen_ok=True)
            elif isinstance(obj, torch.Tensor):
                self._note(obj, "input", first_seen_ok=True)

    def add_role(self, tensor: Any, role: Role) -> None:
        """Add ``role`` to the allocation backing ``tensor`` (``distributed.FsdpBufferRoles``)."""
        self._note(tensor, role)

    # ------------------------------------------------------------------ allocations

    def _new_alloc(
        self,
        size: int,
        op: str | None,
        *,
        phase: Phase | None = None,
        explicit: Category | None = None,
    ) -> Allocation:
        call = self._stack[-1] if self._stack else None
        phase = phase or self._phase()
        module = call.path if call else None
        # Outside any forward call (checkpoint's recomputation is one) backward allocations
        # belong to the module whose backward runs.
        if call is None and phase == "backward":
            backward = self._backward_modules.current
            module = backward.path if backward else None
        alloc = Allocation(
            alloc_id=next(self._ids),
            size_bytes=size,
            phase=phase,
            module=module,
            op=op,
            frames=self._frames.find(),
            root_call=call.root_call_id if call else None,
            explicit=explicit,
            stream=self.current_stream(),
        )
        if self._memory is not None:  # raises torch.OutOfMemoryError within ooms_raised
            self._memory.admit(alloc)
        if call is not None:
            self._escapes.setdefault(call.root_call_id, []).append(alloc)
        self._log.append(("alloc", alloc))
        return alloc

    def _first_seen(self, size: int, role: Role, *, expected: bool) -> Allocation:
        """A storage that was not allocated under this tracer: record it now (caller binds it).

        ``expected`` is False when it shows up in use rather than through ``track()``: then the
        recording warns, since its allocation time is unknown.
        """
        if not expected:
            self._late_first_seen += 1
            self._late_first_seen_bytes += size
        alloc = self._new_alloc(size, None, phase="user")
        alloc.module = None
        alloc.roles.add("input")
        alloc.roles.add(role)
        return alloc

    def _on_autocast_cached_cast(self, cast: torch.Tensor) -> None:
        """A weight cast entered autocast's cache: it lives until the outermost region exits."""
        storage = tensor_storage(cast, _DEVICE_TYPE)
        if storage is not None:
            alloc = self._table.lookup(storage)
            if alloc is not None:
                alloc.explicit = "autocast_cache"

    def _phase(self) -> Phase:
        # The autograd engine sets a graph task id on the thread running backward.
        if torch._C._current_graph_task_id() != -1:
            return "backward"
        if self._optimizer_depth:
            return "optimizer"
        if self._stack:
            return "forward"
        return "user"

    def _on_release(self, alloc: Allocation) -> None:
        alloc.live = False
        self._log.append(("free", alloc, self._frames.find()))

    # ------------------------------------------------------------------ roles

    def _note(
        self,
        tensor: Any,
        role: Role,
        *,
        first_seen_ok: bool = False,
        param: torch.Tensor | None = None,
    ) -> Allocation | None:
        """Add ``role`` to ``tensor``'s allocation (returned); ``param``: the parameter it serves."""
        storage = tensor_storage(tensor, _DEVICE_TYPE)
        if storage is None:
            return None
        alloc = self._table.lookup(storage)
        if alloc is None:
            size = storage.nbytes()
            if size == 0:
                return None
            alloc = self._first_seen(size, role, expected=first_seen_ok)
            self._table.bind(storage, alloc)
        alloc.roles.add(role)
        if param is not None and alloc.owner is None:
            owner = self._owners.get(id(param))
            if owner is not None and owner[0]() is param:
                alloc.owner, alloc.param_name = owner[1], parameter_name(owner[1](), param)
        return alloc

    def _own(self, module: torch.nn.Module, param: torch.Tensor) -> None:
        """Record that ``module`` registered ``param`` (the first owner of a shared one wins)."""
        owner = self._owners.get(id(param))
        if owner is None or owner[0]() is not param:
            self._owners[id(param)] = (weakref.ref(param), self._paths.ref(module))

    def _note_module(
        self, module: torch.nn.Module, *, recurse: bool, first_seen_ok: bool = False
    ) -> None:
        owners = module.named_modules() if recurse else [("", module)]
        for _, owner in owners:
            for param in owner.parameters(recurse=False):
                self._own(owner, param)
        for param in module.parameters(recurse=recurse):
            self._watch_grad(param)
            self._note(param, "parameter", first_seen_ok=first_seen_ok, param=param)
            self._note(param.grad, "gradient", first_seen_ok=first_seen_ok, param=param)
        for buffer in module.buffers(recurse=recurse):
            self._note(buffer, "buffer", first_seen_ok=first_seen_ok)

    def _note_optimizer(
        self, optimizer: torch.optim.Optimizer, *, first_seen_ok: bool = False
    ) -> None:
        for group in optimizer.param_groups:
            for param in group["params"]:
                self._watch_grad(param)
                self._note(param, "parameter", first_seen_ok=first_seen_ok, param=param)
                self._note(param.grad, "gradient", first_seen_ok=first_seen_ok, param=param)
        self._note_optimizer_state(optimizer, first_seen_ok=first_seen_ok)

    def _note_optimizer_state(
        self, optimizer: torch.optim.Optimizer, *, first_seen_ok: bool = False
    ) -> None:
        for param, state in optimizer.state.items():
            owner = param if isinstance(param, torch.Tensor) else None
            for value in tree_leaves(state):
                noted = self._note(value, "optimizer_state", first_seen_ok=first_seen_ok, param=owner)
                if noted is not None and noted.optimizer is None:  # the verdict names it
                    noted.optimizer = type(optimizer).__name__

    def _watch_grad(self, param: torch.Tensor) -> None:
        ref = self._grad_watched.get(id(param))
        if (ref is not None and ref() is param) or not (param.requires_grad and param.is_leaf):
            return
        self._grad_watched[id(param)] = weakref.ref(param)
        self._handles.append(param.register_post_accumulate_grad_hook(self._on_grad))

    def _on_grad(self, param: torch.Tensor) -> None:
        self._note(param.grad, "gradient", param=param)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self._note(tensor, "saved")
        # Return an alias without grad_fn: returning ``tensor`` itself would make a saved output
        # (sigmoid, exp) reference its own grad_fn, a cycle that outlives the graph until gc.
        return detach_saved(tensor)

    # ------------------------------------------------------------------ modules and optimizers

    def _on_forward_pre(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        if torch.compiler.is_compiling():
            return  # dynamo traces the global hooks: keep them out of its graph
        is_root = not self._stack
        call_id = next(self._call_ids)
        if not is_root:
            parent = self._stack[-1]
            root_call_id, lineage = parent.root_call_id, (*parent.lineage, call_id)
        else:
            root_call_id, lineage = call_id, (call_id,)
            if torch._C._current_graph_task_id() == -1:
                # Outside backward: a backward that raised may have left calls behind.
                self._backward_modules.clear()
            else:
                # Checkpoint's recomputation: it runs inside the backward of the current call.
                outer = self._backward_modules.current
                if outer is not None:
                    lineage = (*outer.lineage, call_id)
        parent_call = self._stack[-1] if self._stack else None
        path = self._paths.path_of(
            module, (parent_call.module, parent_call.path) if parent_call else None
        )
        call = _ModuleCall(module, path, call_id, root_call_id, lineage)
        self._stack.append(call)
        if torch.is_grad_enabled():
            # Under no_grad / inference_mode there is no backward: no hooks, no cost.
            call.backward = BackwardCall(call.path, lineage)
            self._backward_modules.watch_inputs(call.backward, args)
        self._note_module(module, recurse=False)
        if is_root:
            for leaf in tree_leaves(args):
                storage = tensor_storage(leaf, _DEVICE_TYPE)
                if storage is not None:
                    alloc = self._table.lookup(storage)
                    if alloc is not None and alloc.phase == "user":
                        alloc.roles.add("input")

    def _on_forward_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            return  # dynamo traces the global hooks: keep them out of its graph
        # Pop to this module's call; calls above it whose post hook never ran (an exception
        # inside a hook) go with it. A module without a matching pre hook pops nothing.
        for depth in range(len(self._stack) - 1, -1, -1):
            call = self._stack[depth]
            if call.module is module:
                del self._stack[depth:]
                if call.backward is not None and torch.is_grad_enabled():
                    self._backward_modules.watch_outputs(call.backward, output)
                break
        if not self._stack:
            for call_id in list(self._escapes):
                for alloc in self._escapes.pop(call_id):
                    if alloc.live:
                        alloc.roles.add("escaped")

    def _on_param_registered(self, module: Any, name: str, param: Any) -> None:
        if torch.compiler.is_compiling():
            return  # dynamo traces the global hooks: keep them out of its graph
        if param is not None:
            self._own(module, param)
            self._watch_grad(param)
            self._note(param, "parameter", first_seen_ok=True, param=param)

    def _on_buffer_registered(self, module: Any, name: str, buffer: Any) -> None:
        if torch.compiler.is_compiling():
            return  # dynamo traces the global hooks: keep them out of its graph
        self._note(buffer, "buffer", first_seen_ok=True)

    def _on_optimizer_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._optimizer_depth += 1
        if torch._C._current_graph_task_id() == -1:
            # Not an optimizer stepped from a gradient hook inside backward: backward is over.
            self._backward_modules.clear()
        self._note_optimizer(optimizer)

    def _on_optimizer_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._optimizer_depth = max(0, self._optimizer_depth - 1)
        self._note_optimizer_state(optimizer)

    def _final_scan(self) -> None:
        for ref in self._tracked:
            obj = ref()
            if isinstance(obj, torch.nn.Module):
                self._note_module(obj, recurse=True)
            elif isinstance(obj, torch.optim.Optimizer):
                self._note_optimizer(obj)
        for ref in list(self._grad_watched.values()):
            param = ref()
            if param is not None:
                self._note(param.grad, "gradient", param=param)

    def _remove_handles(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # ------------------------------------------------------------------ result

    @property
    def allocated_anything(self) -> bool:
        """Whether any device storage has been recorded (tracked or made) so far."""
        return any(entry[0] == "alloc" for entry in self._log)

    def _build(self) -> TraceRecording:
        assumptions = dict(sorted(self._engine.assumptions.items()))
        if self._memory is not None:
            assumptions.update(self._memory.assumptions())
        warnings = list(self._warnings())
        if self._value_modes is not None:
            known, reads = self._value_modes
            assumptions.update(read_assumptions(reads, known))
            warnings += read_warnings(reads, self._compiled, compiled_recorded=self._compile)
        if self._stand_in is not None:
            if self._stand_in.graphs:  # a script is recorded ready to compile, and may not
                assumptions.update(compile_assumptions(self._stand_in.graphs))
            warnings += self._stand_in.warnings()
        choices = dict(sorted(self._engine.kernel_choices.items()))
        return build_recording(self._log, self._module_tag, warnings=tuple(warnings),
                               kernel_choices=choices, assumptions=assumptions, sites=self._engine.sites)

    def _module_tag(self, alloc: Allocation, category: Category) -> str | None:
        # A parameter, its gradient and its optimizer state belong to the module owning the
        # parameter (known once the module has a path: tracked, or called in forward).
        if alloc.owner is not None and category in _OWNED_CATEGORIES:
            path = self._paths.of_ref(alloc.owner)
            if path is not None:
                return path
        return alloc.module

    def _warnings(self) -> Iterable[str]:
        for name, count in sorted(self._engine.divergent_calls.items()):
            reason = CUDA_DIVERGENT_OPS[name]
            yield (
                f"{name} ran {count} time(s) and is recorded as meta runs it; its CUDA memory "
                f"({reason}) is not emulated yet"
            )
        yield from self._engine.partial_warnings()
        if self._autocast is not None:
            yield from self._autocast.warnings()
        yield from grad_scaler_warnings(self._grad_scaler_steps)
        if self.gpu.compute_capability is None:
            major, minor = self.gpu.kernel_compute_capability
            yield (
                f"{self.gpu.name} is a plain size with no architecture: the SDPA backend and the "
                f"cuBLAS and attention workspaces were chosen as on compute capability "
                f"{major}.{minor} (an H100); name the GPU (e.g. rtx4090, a100-40gb) for its own"
            )
        if self._late_first_seen:
            yield (
                f"{self._late_first_seen} storage(s) ({self._late_first_seen_bytes} bytes) existed "
                "before tracing and are recorded as allocated when first used; to record them first, "
                "return (step, (model, optimizer)) from a builder, or pass track= to oomkit.predict"
            )


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class _TracerSink:
    """The Tracer's side of the engine (``engine.AllocationSink``): it records, never refuses."""

    def __init__(self, tracer: Tracer) -> None:
        self._tracer = tracer

    def allocate(self, size_bytes: int, op: str | None, *, first_seen: bool) -> Allocation:
        if first_seen:
            return self._tracer._first_seen(size_bytes, "input", expected=False)
        return self._tracer._new_alloc(size_bytes, op)

    def free(self, alloc: Allocation) -> None:
        self._tracer._on_release(alloc)

    def storage_released(self, alloc: Allocation) -> None:
        self._tracer._on_release(alloc)

    def refused(self, error: Exception) -> BaseException:
        return error  # pragma: no cover - allocate never refuses

    def op_failed(self, op: str, error: BaseException) -> None:
        self._tracer.failed_op = (op, error)

    def phase(self) -> Phase:
        return self._tracer._phase()

"""``torch.compile`` inside a traced step: recorded as compiled, or run eagerly; counted either way.

With ``compile=True`` (``oomkit predict --compile``) compiled regions are compiled for real by
dynamo and AOTAutograd, with Inductor's memory plan emulated (:func:`compiled_code_recorded`,
``compile_backend.py``). Otherwise oomkit records what eager PyTorch allocates; it does not model Inductor's generated kernels
(fusion frees intermediates earlier and saves fewer tensors for backward; CUDA graphs keep a
private pool). Dynamo enters compiled code through one function of torch/_dynamo/eval_frame.py,
``_callback_from_stance``, which returns the frame callback for the current stance; under
``torch.compiler.set_stance("force_eager")`` it returns ``None`` and the code runs eagerly. While
:func:`compiled_code_eager` is open that function returns ``None`` for every compiled region, as
``force_eager`` does, and counts the regions entered, by the user's line that entered them.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from oomkit.prediction.tracing._from_data import (
    DATA_CONSTRUCTORS,
    built_on,
    from_python_data,
    made_on,
)
from oomkit.prediction.tracing.stand_ins import (
    is_hidden_file,
    is_library_file,
    is_torch_plumbing,
    read_site,
)

if TYPE_CHECKING:
    from oomkit.prediction.tracing.compile_backend import InductorStandIn
    from oomkit.prediction.tracing.engine import CudaEmulationEngine

__all__ = ["GRAPH_BREAKS", "RECOMPILE_LIMIT", "compiled_code_eager", "compiled_code_recorded"]


@contextlib.contextmanager
def compiled_code_eager(entered: Counter[str]) -> Iterator[None]:
    """While open, compiled functions and modules run eagerly; ``entered`` counts them by site.

    Args:
        entered: ``"train.py:30 in step"`` -> how many times compiled code was entered there.
    """
    try:
        import torch._dynamo.eval_frame as eval_frame
    except ImportError:  # pragma: no cover - a torch without dynamo
        yield
        return
    original = getattr(eval_frame, "_callback_from_stance", None)
    if original is None:  # pragma: no cover - torch before set_stance (2.6)
        yield
        return

    def callback_from_stance(callback: Any) -> Any:
        if callback in (False, None):
            return original(callback)
        entered[_site()] += 1
        return None  # the force_eager stance: run the frame as plain Python

    eval_frame._callback_from_stance = callback_from_stance
    try:
        yield
    finally:
        eval_frame._callback_from_stance = original


@contextlib.contextmanager
def compiled_code_recorded(
    engine: CudaEmulationEngine, entered: Counter[str]
) -> Iterator[InductorStandIn | None]:
    """While open, ``torch.compile`` (Inductor backend) compiles through :class:`InductorStandIn`.

    Dynamo skips compiling while a dispatch mode that does not ignore compile internals is on
    the stack (torch/_dynamo/convert_frame.py ``CatchErrorsWrapper.__call__``), so the
    recorder's dispatch modes say they ignore them (torch/utils/_python_dispatch.py
    ``ignore_compile_internals``); their ``__torch_dispatch__`` runs with dynamo disabled
    (``TorchDispatchMode.__init_subclass__`` wraps it in ``torch._dynamo.disable``). The
    recorder itself is never compiled (:func:`_recorder_never_compiled`). Inductor is reached
    through ``torch._inductor.compile_fx.compile_fx`` (the default backend's
    ``_TorchCompileInductorWrapper`` and ``backend="inductor"`` both look it up when they
    compile), which is replaced. Dynamo's caches are reset on entry and exit, so no compiled code
    made for another recording (or holding this one) is run. Other backends run as they are.

    Args:
        engine: the engine whose storages the compiled graphs' buffers are recorded in.
        entered: counts compiled regions entered, by the user's line.

    Yields:
        The stand-in (its ``plans`` say what was compiled), or None for a torch without dynamo.
    """
    try:
        import torch._dynamo
        import torch._dynamo.eval_frame as eval_frame
        import torch._dynamo.utils
        import torch._inductor.compile_fx as compile_fx_module
        import torch.utils._python_dispatch as python_dispatch
    except ImportError:  # pragma: no cover - a torch without dynamo
        yield None
        return
    from oomkit.prediction.tracing._modes import OpDispatchMode
    from oomkit.prediction.tracing.compile_backend import InductorStandIn
    from oomkit.prediction.tracing.compile_rng_order import rng_states_before_opaque_objects
    from oomkit.prediction.tracing.values import KnownValues

    stand_in = InductorStandIn(engine)
    original_compile_fx = compile_fx_module.compile_fx
    original_stance = eval_frame._callback_from_stance
    mode_classes: tuple[type[Any], ...] = (OpDispatchMode, KnownValues)
    saved = [cls.__dict__.get("ignore_compile_internals") for cls in mode_classes]

    def callback_from_stance(callback: Any) -> Any:
        if callback not in (False, None):
            entered[_site()] += 1
        return original_stance(callback)

    torch._dynamo.reset()
    breaks_before = sum(torch._dynamo.utils.counters["graph_break"].values())
    limits_before = _recompile_limits_hit(torch._dynamo.utils.counters)
    compile_fx_module.compile_fx = stand_in  # type: ignore[assignment]
    eval_frame._callback_from_stance = callback_from_stance
    for mode_class in mode_classes:
        mode_class.ignore_compile_internals = classmethod(lambda cls: True)
    # A mode entered before this (value_tracking opened around the builder, as the CLI does)
    # set the flag "in a mode without ignore_compile_internals" when it was entered
    # (TorchDispatchMode.__enter__), and dynamo's C++ guards fail while it is set, so every call
    # recompiled ("runtime guards failed even though they passed during recompilation-reason
    # analysis"). Recomputed from the modes on the stack now; restored on exit.
    flag_before = python_dispatch._is_in_any_mode_without_ignore_compile_internals
    _set_ignore_flag(
        python_dispatch,
        any(
            not python_dispatch._get_dispatch_stack_at(i).ignore_compile_internals()
            for i in range(torch._C._len_torch_dispatch_stack())
        ),
    )
    try:
        with (
            _recorder_never_compiled(),
            _meta_dispatched_as_cuda(),
            _ddp_compiles_without_modes(),
            rng_states_before_opaque_objects(),
        ):
            yield stand_in
    finally:
        # Each graph break leaves code between captured graphs that runs (and is recorded)
        # eagerly; dynamo counts them (torch/_dynamo/utils.py counters, kept across resets).
        breaks = sum(torch._dynamo.utils.counters["graph_break"].values()) - breaks_before
        if breaks:
            stand_in.graphs[GRAPH_BREAKS] += breaks
        limits = _recompile_limits_hit(torch._dynamo.utils.counters) - limits_before
        if limits:
            stand_in.graphs[RECOMPILE_LIMIT] += limits
        _set_ignore_flag(python_dispatch, flag_before)
        for mode_class, before in zip(mode_classes, saved, strict=True):
            if before is None:
                del mode_class.ignore_compile_internals
            else:  # pragma: no cover - neither class defines it today
                mode_class.ignore_compile_internals = before
        eval_frame._callback_from_stance = original_stance
        compile_fx_module.compile_fx = original_compile_fx
        torch._dynamo.reset()


@contextlib.contextmanager
def _ddp_compiles_without_modes() -> Iterator[None]:
    """While open, a frame compiled inside DDP's forward is traced with the dispatch modes off,
    as every other compiled frame is.

    torch/_dynamo/convert_frame.py ``CatchErrorsWrapper.__call__`` compiles a frame under
    ``_disable_current_modes()``, except inside a ``DistributedDataParallel`` forward
    (``optimize_ddp`` "ddp_optimizer", the default): there it returns early through
    ``_clone_with_backend(DDPOptimizer.compile_fn)`` and calls that callback with the modes
    still on. A GPU process has none on, so both paths trace alike; a recording has its fake
    mode and its own modes on, and dynamo's conversion of the frame's inputs to its fake tensors
    ran an op through them (``meta_utils.py`` ``_backward_error``: "Mixing fake modes"). The
    callback that ``_clone_with_backend`` makes is run here under ``_disable_current_modes()``
    as the other path runs its own; the DDPOptimizer (its split of the graph at DDP's buckets,
    each piece compiled through the backend) runs as it is.
    """
    from torch._dynamo import convert_frame
    from torch.utils._python_dispatch import _disable_current_modes

    classes = [
        cls
        for cls in (convert_frame.ConvertFrame, convert_frame.ConvertFrameAssert)
        if isinstance(cls.__dict__.get("_clone_with_backend"), property)
    ]
    originals = {cls: cls.__dict__["_clone_with_backend"] for cls in classes}

    def without_modes(original: property) -> property:
        def clone_with_backend(self: Any) -> Any:
            clone = original.fget(self)  # type: ignore[misc]

            def make(backend: Any) -> Any:
                callback = clone(backend)

                def call(*args: Any, **kwargs: Any) -> Any:
                    with _disable_current_modes():
                        return callback(*args, **kwargs)

                return call

            return make

        return property(clone_with_backend)

    for cls, original in originals.items():
        setattr(cls, "_clone_with_backend", without_modes(original))  # noqa: B010
    try:
        yield
    finally:
        for cls, original in originals.items():
            setattr(cls, "_clone_with_backend", original)  # noqa: B010


def _set_ignore_flag(python_dispatch: Any, value: bool) -> None:
    """torch/utils/_python_dispatch.py's flag and its copy in dynamo's C++ guards, as
    ``TorchDispatchMode.__enter__`` sets them."""
    from torch._C._dynamo.guards import set_is_in_mode_without_ignore_compile_internals

    python_dispatch._is_in_any_mode_without_ignore_compile_internals = value
    set_is_in_mode_without_ignore_compile_internals(value)


# The count of dynamo's graph breaks in InductorStandIn.graphs (the assumption lists it).
GRAPH_BREAKS = "graph break(s), the code between graphs recorded eagerly"
# The count of compiled functions that hit dynamo's recompile_limit (8 compiles of one code
# object: a new static shape per call under dynamic=False or mark_static, say). Dynamo then
# runs them eagerly on a GPU too (convert_frame.py: "Dynamo recompile limit exceeded"), and
# so they are recorded.
RECOMPILE_LIMIT = (
    "function(s) past dynamo's recompile_limit, run eagerly from then on, as on a GPU"
)


def _recompile_limits_hit(counters: Any) -> int:
    """How many times dynamo gave up on a function at its recompile limit, by its counters
    (``unimplemented``; named ``cache_size_limit`` before torch 2.7)."""
    return sum(
        n
        for reason, n in counters["unimplemented"].items()
        if "recompile limit" in reason.lower() or "cache_size_limit" in reason.lower()
    )
# The recorder's packages: no frame of theirs is ever compiled (models/ is the user's code).
_RECORDER_PACKAGE = "oomkit.prediction.tracing"


@contextlib.contextmanager
def _recorder_never_compiled() -> Iterator[None]:
    """While open, dynamo never compiles the recorder, and traces its function modes as no-ops.

    Two ways dynamo meets the recorder inside a compiled region:

    - It *traces through* the recorder's torch-function modes (torch/_dynamo/variables/
      torch_function.py ``SymbolicTorchFunctionState.call_torch_function_mode`` inlines every
      mode's ``__torch_function__``) and its global module hooks. While dynamo traces,
      ``torch.compiler.is_compiling()`` is True, so the modes' ``__torch_function__`` is
      replaced by one that then only calls the function (the hooks already return): the
      captured graph holds the user's ops, as on a GPU without oomkit.
    - After a graph break, every Python frame that starts is offered to dynamo's frame callback
      (torch/_dynamo/convert_frame.py ``CatchErrorsWrapper.__call__``), a mode's
      ``__torch_function__`` or a hook included, which would compile its eager path (or, with
      ``is_compiling()`` folded to True, skip it). Each code object of the recorder gets the
      frame strategy ``FrameExecStrategy(SKIP, SKIP)`` (torch/_dynamo/eval_frame.py
      ``set_code_exec_strategy``, as ``skip_code`` sets ``(SKIP, DEFAULT)``): checked in C
      before the callback, it runs the frame and everything it calls with the callback off
      (torch/csrc/dynamo/eval_frame_cpp.cpp ``dynamo__custom_eval_frame``: a SKIP recursive
      action makes the recursive callback None), so the recorder's work runs eagerly. It does
      not stop dynamo from tracing through that code: only ``_torchdynamo_disable`` does
      (variables/functions.py), which is why ``torch._dynamo.skip``/``disable`` are not used.
      A ``torch.compile``d function called from there still compiles (its wrapper sets the
      callback itself).

    ``trace_rules.add`` (skip whole files) is not used: it also stops dynamo tracing through the
    module hooks (``check_file`` applies to inlined calls), a graph break per module call.
    """
    import torch._dynamo.eval_frame as eval_frame
    from torch._dynamo.types import FrameAction, FrameExecStrategy

    from oomkit.prediction.tracing._modes import DivergenceFunctionMode
    from oomkit.prediction.tracing.value_reads import ValueReads

    modes: tuple[type[Any], ...] = (ValueReads, DivergenceFunctionMode)
    originals = [mode.__dict__["__torch_function__"] for mode in modes]
    for mode, original in zip(modes, originals, strict=True):
        mode.__torch_function__ = _traced_as_the_function(original)
    codes = _recorder_code()
    never = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)
    for code in codes:
        eval_frame.set_code_exec_strategy(code, never)
    try:
        yield
    finally:
        default = FrameExecStrategy(FrameAction.DEFAULT, FrameAction.DEFAULT)
        for code in codes:
            eval_frame.set_code_exec_strategy(code, default)
        for mode, original in zip(modes, originals, strict=True):
            mode.__torch_function__ = original


@contextlib.contextmanager
def _meta_dispatched_as_cuda() -> Iterator[None]:
    """While open, the Python dispatcher sends an op to autograd on meta as it does on CUDA.

    torch/_meta_registrations.py ``activate_meta`` registers a Python ``Meta`` kernel for every
    op with a decomposition, CompositeImplicitAutograd ones included (``nll_loss``,
    ``var_mean``, ``std``, ``where``, ``dropout``...). Under the Python dispatcher, which dynamo
    and AOTAutograd enable while they trace (torch/_functorch/_aot_autograd/graph_capture.py
    ``_create_graph``), torch/_ops.py ``resolve_key`` then finds a "backend kernel" for
    ``AutogradMeta`` and skips CompositeImplicitAutograd, so the op reaches autograd's
    not-implemented fallback: its output has no grad_fn and AOTAutograd marks it as needing
    none (a compiled ``cross_entropy`` loss cannot be backpropagated). ``AutogradCUDA`` has no
    such kernel and decomposes. Those ``Meta`` kernels are set aside while this is open.
    """
    import torch
    from torch._C import DispatchKey
    from torch._decomp import global_decomposition_table

    ops = {
        op
        for table in global_decomposition_table.values()
        for op in table
        if isinstance(op, torch._ops.OpOverload)
        and DispatchKey.Meta in op.py_kernels
        and torch._C._dispatch_has_kernel_for_dispatch_key(
            op.name(), DispatchKey.CompositeImplicitAutograd
        )
    }
    kernels = {op: op.py_kernels.pop(DispatchKey.Meta) for op in ops}
    for op in ops:
        op._dispatch_cache.clear()
    try:
        yield
    finally:
        for op, kernel in kernels.items():
            op.py_kernels[DispatchKey.Meta] = kernel
            op._dispatch_cache.clear()


_NONE: dict[Any, Any] = {}


def _traced_as_the_function(original: Any) -> Any:
    """A mode's ``__torch_function__`` that dynamo traces as the call of ``func`` alone."""
    import torch

    def __torch_function__(
        self: Any, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if torch.compiler.is_compiling():
            # A function DivergenceFunctionMode.reach_backward replaced in its module comes back
            # here as that wrapper: call what it wraps (the wrapper would enter the mode again).
            func = getattr(self, "_originals", _NONE).get(func, func)
            if func in DATA_CONSTRUCTORS:  # tested here: dynamo traces this for every torch call
                return _as_on_the_gpu(func, args, kwargs or {})
            return func(*args, **(kwargs or {}))
        return original(self, func, types, args, kwargs)

    return __torch_function__


def _as_on_the_gpu(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``func(*args, **kwargs)``, traced by dynamo; a tensor made from data on meta made on the CPU.

    ``torch.tensor(data, device="meta")`` (and ``as_tensor``, ``asarray``, ``new_tensor`` of a
    meta tensor: ``_from_data.py``) takes a shortcut that returns a plain meta tensor,
    with the fake-tensor key excluded and no ``lift_fresh`` (torch/csrc/utils/tensor_new.cpp
    ``internal_new_from_data``: "If the device is Meta, take the shortcut"), so dynamo's fake
    run fails on it ("Please convert all Tensors to FakeTensors first"). On CUDA the data is
    made on the CPU, lifted and moved, which is what is traced here: the graph gets a CPU
    constant (no device memory) and its move to the device, which ``compile_plan`` treats as
    Inductor treats a device copy of constants (ir.py ``DeviceCopy.create``:
    ``constant_to_device``): inlined into its readers, and, past 8 elements
    (torch/_inductor/graph.py ``GraphLowering.get_attr``), copied to the device once and held
    by the compiled graph, as a constant made on CUDA is.
    """
    if from_python_data(func, args, kwargs):
        device = built_on(func, args, kwargs)
        if device is not None and device.type == "meta":
            return made_on(func, args, kwargs, "cpu").to(device)
    return func(*args, **kwargs)


def _recorder_code() -> list[types.CodeType]:
    """Every code object of the recorder's loaded modules: functions, methods, nested ones."""
    found: dict[int, types.CodeType] = {}

    def add_code(code: types.CodeType) -> None:
        if id(code) in found:
            return
        found[id(code)] = code
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                add_code(const)

    def add_object(obj: Any, module_name: str) -> None:
        for _ in range(8):  # decorators' wrappers (functools.wraps) down to the function
            if isinstance(obj, (staticmethod, classmethod)):
                obj = obj.__func__
            elif isinstance(obj, property):
                for part in (obj.fget, obj.fset, obj.fdel):
                    if part is not None:
                        add_object(part, module_name)
                return
            elif isinstance(obj, types.FunctionType):
                if obj.__module__ == module_name:
                    add_code(obj.__code__)
                obj = getattr(obj, "__wrapped__", None)
            else:
                return

    for name, module in list(sys.modules.items()):
        inside = name == _RECORDER_PACKAGE or name.startswith(_RECORDER_PACKAGE + ".")
        if module is None or not inside:
            continue
        for value in list(vars(module).values()):
            if isinstance(value, type) and value.__module__ == name:
                for member in list(vars(value).values()):
                    add_object(member, name)
            else:
                add_object(value, name)
    return list(found.values())


def _site() -> str:
    """The line that entered compiled code: the innermost frame of the user's, or of a preset's
    or ``--hf`` model's step (oomkit's own ``prediction/models``), whichever is closer."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        models = filename.replace("\\", "/").find(_MODELS_PATH)
        if models >= 0:
            return f"{filename[models + 1 :]}:{frame.f_lineno} in {frame.f_code.co_name}"
        if not (
            is_hidden_file(filename) or is_library_file(filename) or is_torch_plumbing(filename)
        ):
            return f"{filename}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    site = read_site()
    return site.location if site is not None else "compiled code"


# Where the preset and Hugging Face steps live (a compiled region they enter is named by them).
_MODELS_PATH = "/oomkit/prediction/models/"

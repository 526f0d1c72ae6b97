"""The torch modes the engine installs: one at the aten level, one at the Python API level.

Why a plain ``TorchDispatchMode`` over meta tensors and not ``FakeTensorMode``: the user builds
the model under ``torch.device("meta")`` and we must see *those* tensors, keeping their identity
(``param.grad``, ``optimizer.state`` keys) and their reference counts untouched. FakeTensorMode
would require converting every real/meta input into a FakeTensor (new objects, a memo that keeps
them alive), caches op results, and adds per-op overhead. Its one advantage, reporting a
``cuda`` device so CUDA-only code paths run, is what the emulation registry provides per op
instead. Meta kernels allocate exactly the outputs, which is what we record.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type

__all__ = ["OpDispatchMode", "DivergenceFunctionMode", "untraced", "watched_functions"]

# > 0 while code that makes no device memory runs (DTensor's sharding propagation on global
# fake shapes): OpDispatchMode then runs ops without recording them.
_untraced_depth = [0]


@contextlib.contextmanager
def untraced() -> Iterator[None]:
    """While open, ops run unrecorded: for host bookkeeping that only derives shapes."""
    _untraced_depth[0] += 1
    try:
        yield
    finally:
        _untraced_depth[0] -= 1


class OpDispatchMode(TorchDispatchMode):
    """Sees every aten op after autograd and decompositions: the ops that allocate.

    ``run_op(func, args, kwargs)`` runs each one (``engine.CudaEmulationEngine.run_op``).

    A CompositeImplicitAutograd op (``linear``, ``matmul``, ``to``) normally decomposes at the
    autograd key, before this mode. Under ``torch.inference_mode()`` the autograd keys are
    excluded, so it arrives here whole, while CUDA still runs its decomposition (``linear`` ->
    ``t`` + ``addmm``: the kernels whose workspaces the emulations add). There, such an aten op
    is decomposed with this mode on, as FakeTensorMode does (torch/_subclasses/fake_tensor.py),
    unless ``keep_whole(name)`` (an emulation hook of its own). Other paths that reach a mode
    below autograd (DTensor's local ops) keep their op whole, as before. Measured on an H200: 8 linears under
    inference_mode + autocast left out the 32 MiB cuBLAS workspace and 1 MiB more
    (validation/fidelity-nvidia-h200-torch2.11.0.json).
    """

    def __init__(
        self,
        run_op: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any],
        keep_whole: Callable[[str], bool] = lambda name: False,
    ) -> None:
        super().__init__()
        self._run_op = run_op
        self._keep_whole = keep_whole
        self._decomposes: dict[Any, bool] = {}  # op -> run as its decomposition here

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if _untraced_depth[0]:
            return func(*args, **(kwargs or {}))
        if any(map(is_traceable_wrapper_subclass_type, types)):
            # A DTensor op: let DTensor dispatch it (its redistributions and collectives, then
            # the op on local shards), with this mode still on the stack for the inner ops
            # (torch/csrc/utils/python_arg_parser.cpp handle_torch_function_no_python_arg_parser:
            # a mode that answers NotImplemented is restored before the subclasses' turn).
            return NotImplemented
        if torch.is_inference_mode_enabled() and self._decomposes_here(func):
            with self:
                out = func.decompose(*args, **(kwargs or {}))
            if out is not NotImplemented:
                return out
        return self._run_op(func, args, kwargs or {})

    def _decomposes_here(self, func: Any) -> bool:
        decomposes = self._decomposes.get(func)
        if decomposes is None:
            # aten ops only: prim:: and custom ops have no CompositeImplicitAutograd entry to ask
            # about (the dispatcher raises for prim::device).
            decomposes = self._decomposes[func] = (
                getattr(func, "namespace", None) == "aten"
                and torch._C._dispatch_has_kernel_for_dispatch_key(
                    func.name(), "CompositeImplicitAutograd"
                )
                and not self._keep_whole(str(func))
            )
        return decomposes


class DivergenceFunctionMode(TorchFunctionMode):
    """Runs Python-level functions whose CUDA memory meta does not reproduce.

    Needed because composite functions such as ``scaled_dot_product_attention`` decompose before
    they reach the dispatch mode, so their aten name never shows up there. ``on_call(name, func,
    args, kwargs)`` runs a watched call (an emulation hook, or the function itself while counting
    it as not emulated) and returns its result.
    """

    def __init__(
        self,
        watched: dict[Callable[..., Any], str],
        on_call: Callable[[str, Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any],
    ):
        super().__init__()
        self._watched = watched
        self._on_call = on_call
        # reach_backward's wrappers -> the functions they wrap. A Python function such as
        # F.dropout passes itself, looked up in its module (so the wrapper), to
        # handle_torch_function; calling the wrapper from here would re-enter this mode.
        self._originals: dict[Callable[..., Any], Callable[..., Any]] = {}
        # The watched functions being run by on_call now. F.dropout, run from here with this
        # mode popped, asks the other function modes on the stack (handle_torch_function), and
        # the one that runs it calls the wrapper, which pushes this mode again: that second
        # entry of the same call runs the function, without on_call (it was counted twice,
        # and its hook ran twice).
        self._running: list[Callable[..., Any]] = []

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        func = self._originals.get(func, func)
        name = self._watched.get(func)
        if name is not None and func not in self._running:
            self._running.append(func)
            try:
                return self._on_call(name, func, args, kwargs or {})
            finally:
                self._running.pop()
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def reach_backward(self) -> Iterator[None]:
        """While open, a watched function called where this mode is not active enters it.

        The autograd engine does not carry torch-function modes into backward (it carries the
        dispatch modes), so a function recomputed there by ``torch.utils.checkpoint`` would run
        unwatched. Each watched function is replaced in its module by a wrapper that enters this
        mode when the mode is off the current stack; the originals come back on exit.
        """
        from torch.overrides import _get_current_function_mode_stack

        patched: list[tuple[Any, str, Any]] = []
        for func, dotted in self._watched.items():
            module_name, _, attr = dotted.rpartition(".")
            owner = sys.modules.get(module_name)
            if owner is None or getattr(owner, attr, None) is not func:
                continue

            @functools.wraps(func)
            def wrapper(*args: Any, _original: Any = func, **kwargs: Any) -> Any:
                if any(mode is self for mode in _get_current_function_mode_stack()):
                    return _original(*args, **kwargs)
                with self:
                    return _original(*args, **kwargs)

            patched.append((owner, attr, func))
            self._originals[wrapper] = func
            setattr(owner, attr, wrapper)
        try:
            yield
        finally:
            for owner, attr, func in reversed(patched):
                setattr(owner, attr, func)
            self._originals.clear()


def watched_functions(names: list[str]) -> dict[Callable[..., Any], str]:
    """Python functions for the dotted names in ``names`` that resolve (``torch.x.y``)."""
    found: dict[Callable[..., Any], str] = {}
    for name in names:
        obj: Any = torch
        parts = name.split(".")
        if parts[0] != "torch":
            continue
        for part in parts[1:]:
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if obj is not None and callable(obj):
            found[obj] = name
    return found

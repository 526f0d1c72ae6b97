"""A CPU tensor fed to a model on the emulated GPU: CUDA's device check, with its likely cause.

On a GPU, ``model(x)`` with the model's parameters on ``cuda`` and ``x`` on the CPU raises
("Expected all tensors to be on the same device", aten/src/ATen/native/TensorIterator /
``check_all_tensors_on_same_device`` and the matmul/embedding device checks). On meta the same
call runs: an op mixing meta and CPU tensors gives a meta result, so the input's bytes would be
missing from the prediction and nothing would say so.

While :func:`cpu_inputs_refused` is open, the outermost module call whose parameters are all
on the traced device (meta) and which is given a CPU tensor of more than one element raises a
``UserCodeError`` at the user's line. The usual cause is ``device = "cuda" if
torch.cuda.is_available() else "cpu"`` evaluated where CUDA looked absent (the file was imported
before oomkit emulated the GPU): the message names that line when the caller's globals hold such
a choice. Modules with their own forward pre-hooks (accelerate's ``AlignDevicesHook`` moves
inputs itself) and ``DataParallel`` (its scatter copies them to its device) are left alone.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.modules.module as _module_hooks
from torch.utils._pytree import tree_leaves

from oomkit.errors import UserCodeError
from oomkit.prediction.tracing.stand_ins import is_hidden_file, is_library_file, shown_path

__all__ = ["cpu_inputs_refused"]

# Modules whose forward moves CPU inputs to the GPU itself (data_parallel.py ``forward``).
_MOVE_INPUTS = (torch.nn.DataParallel,)


def _user_frames() -> Iterator[Any]:
    frame: Any = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not (is_hidden_file(filename) or is_library_file(filename)):
            yield frame
        frame = frame.f_back


@functools.lru_cache(maxsize=64)
def _availability_choices(filename: str) -> dict[str, int]:
    """Module-level names assigned from an expression that asks ``is_available()``, with the
    line of the assignment (``device = "cuda" if torch.cuda.is_available() else "cpu"``)."""
    try:
        with open(filename, encoding="utf-8") as source:
            tree = ast.parse(source.read())
    except (OSError, SyntaxError, ValueError):
        return {}
    found: dict[str, int] = {}
    for node in tree.body:
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
            continue
        asks = any(
            isinstance(sub, ast.Attribute) and sub.attr == "is_available"
            for sub in ast.walk(node.value)
        )
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for target in targets:
            if asks and isinstance(target, ast.Name):
                found[target.id] = node.lineno
    return found


def _is_cpu_choice(value: Any) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cpu"
    return value == "cpu"


def _user_namespaces() -> Iterator[tuple[str, dict[str, Any]]]:
    """The user's frames' module globals, then the user modules their globals and locals name
    (``import settings`` ... ``settings.device``), each with its file."""
    seen: set[str] = set()
    for frame in _user_frames():
        namespaces = [(frame.f_code.co_filename, frame.f_globals)]
        for value in [*frame.f_globals.values(), *frame.f_locals.values()]:
            module_file = getattr(value, "__file__", None)
            if (
                isinstance(value, types.ModuleType)
                and isinstance(module_file, str)
                and not (is_hidden_file(module_file) or is_library_file(module_file))
            ):
                namespaces.append((module_file, vars(value)))
        for filename, namespace in namespaces:
            if filename not in seen:
                seen.add(filename)
                yield filename, namespace


def _cpu_choice_line() -> str | None:
    """``train.py:5`` where a module-level name chose the CPU by asking ``is_available()``."""
    for filename, namespace in _user_namespaces():
        for name, line in _availability_choices(filename).items():
            if _is_cpu_choice(namespace.get(name)):
                return f"{shown_path(filename)}:{line} ({name} = 'cpu')"
    return None


def _user_line() -> str:
    for frame in _user_frames():
        return f"{shown_path(frame.f_code.co_filename)}:{frame.f_lineno}"
    return "a line oomkit could not find"


class _Refusal:
    def __init__(self) -> None:
        self.depth = 0

    def pre(self, module: torch.nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            return
        self.depth += 1
        if self.depth > 1 or module._forward_pre_hooks or isinstance(module, _MOVE_INPUTS):
            return
        params = list(module.parameters())
        if not params or any(p.device.type != "meta" for p in params):
            return
        for leaf in tree_leaves(args):
            if isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu" and leaf.numel() > 1:
                self.depth = 0
                raise UserCodeError(_message(module, leaf))

    def post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            return
        self.depth = max(0, self.depth - 1)


def _message(module: torch.nn.Module, tensor: torch.Tensor) -> str:
    where = _user_line()
    text = (
        f"{where}: a CPU tensor (shape {tuple(tensor.shape)}) goes into {type(module).__name__}, "
        "whose parameters are on the GPU; on a GPU this raises 'Expected all tensors to be on "
        "the same device'."
    )
    choice = _cpu_choice_line()
    if choice is not None:
        return (
            f"{text} {choice} chose the CPU because torch.cuda.is_available() was False when "
            "that line ran (before oomkit emulated the GPU). Let oomkit import the file "
            "(`oomkit predict file.py:function`, or the script itself), or decide the device "
            "inside the builder."
        )
    return f"{text} Move it with .to('cuda') (or create it with device='cuda')."


@contextlib.contextmanager
def cpu_inputs_refused() -> Iterator[None]:
    """While open, a model on the traced device given a CPU tensor raises (module docstring)."""
    refusal = _Refusal()
    handles = [
        _module_hooks.register_module_forward_pre_hook(refusal.pre),
        _module_hooks.register_module_forward_hook(refusal.post, always_call=True),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()

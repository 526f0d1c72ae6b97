"""Module paths for the recorder: each module's ``named_modules()`` path, kept after it dies."""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["ModulePaths", "wrapper_hook_warning_silenced"]


class ModulePaths:
    """Names modules by their path in the model they were first seen in.

    One weakref per module, and the path of each, kept after the module dies (a model built and
    dropped inside the step still names its parameters' storages at the end).
    """

    def __init__(self) -> None:
        self._paths: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
        self._module_refs: weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref[Any]] = (
            weakref.WeakKeyDictionary()
        )
        self._ref_paths: dict[weakref.ref[Any], str] = {}
        self._roots = 0

    def ref(self, module: torch.nn.Module) -> weakref.ref[Any]:
        """The one weakref to ``module`` (its path can be read through it after it dies)."""
        ref = self._module_refs.get(module)
        if ref is None:
            ref = self._module_refs[module] = weakref.ref(module)
        return ref

    def of_ref(self, ref: weakref.ref[Any]) -> str | None:
        """The path of the module behind :meth:`ref`'s ``ref``, if it was named."""
        try:
            return self._ref_paths.get(ref)
        except TypeError:
            # A weakref hashed first after its module died has no hash ("weak object has gone
            # away"); one never hashed was never a key here: the module was not named.
            return None

    def name_root(self, module: torch.nn.Module) -> str:
        """Name a root module and its submodules: ``""`` for the first root, else its type."""
        path = self._paths.get(module)
        if path is None:
            path = "" if self._roots == 0 else type(module).__name__
            self._roots += 1
            for name, sub in module.named_modules(prefix=path):
                self._set(sub, name)
        return path

    def path_of(self, module: torch.nn.Module, parent: tuple[torch.nn.Module, str] | None) -> str:
        """The path of ``module`` called inside ``parent`` (module, path), or as a root if None.

        A module the parent does not hold is named ``<parent path>.<type name>``.
        """
        path = self._paths.get(module)
        if path is not None:
            return path
        original = _compiled_original(module)
        if original is not None:
            # torch.compile(model) wraps the model in an OptimizedModule that calls it: the
            # wrapper is the model itself, so it takes the model's path (no "OptimizedModule").
            path = self.path_of(original, parent)
            self._set(module, path)
            return path
        if parent is None:
            return self.name_root(module)
        parent_module, parent_path = parent
        for name, sub in parent_module.named_modules():
            if sub is module:
                path = f"{parent_path}.{name}" if parent_path else name
                break
        else:
            path = f"{parent_path}.{type(module).__name__}" if parent_path else type(module).__name__
        for name, sub in module.named_modules(prefix=path):
            self._set(sub, name)
        return path

    def _set(self, module: torch.nn.Module, path: str) -> None:
        """Name ``module`` unless it has a name (the first path of a shared module wins).

        An ``OptimizedModule``'s ``_orig_mod`` component is dropped, as the wrapper is.

        torch's ``checkpoint_wrapper`` (selective AC) holds the block as
        ``_checkpoint_wrapped_module``; the name is dropped as torch drops it from parameter
        and state-dict names (torch/distributed/algorithms/_checkpoint/checkpoint_wrapper.py
        ``_CHECKPOINT_PREFIX``), so a wrapped block keeps its path (``layers.0.mlp``).
        """
        path = path.replace("._checkpoint_wrapped_module", "")
        # torch.compile's OptimizedModule holds the model as ``_orig_mod``
        # (torch/_dynamo/eval_frame.py OptimizedModule.__init__): the wrapper is transparent.
        path = ".".join(part for part in path.split(".") if part != "_orig_mod")
        if self._paths.setdefault(module, path) == path:
            self._ref_paths.setdefault(self.ref(module), path)


def _compiled_original(module: torch.nn.Module) -> torch.nn.Module | None:
    """The model a ``torch.compile`` wrapper (``OptimizedModule``) calls; None for others."""
    original = module.__dict__.get("_modules", {}).get("_orig_mod")
    if original is not None and type(module).__name__ == "OptimizedModule":
        return original
    return None


@contextlib.contextmanager
def wrapper_hook_warning_silenced() -> Iterator[None]:
    """While open, torch's warning about global module hooks on a compiled module is silenced.

    torch warns on every call of a ``torch.compile``d module while global module hooks exist
    (torch/_dynamo/eval_frame.py ``OptimizedModule``): under the recorder those hooks are its
    own, which skip compiled code and see the wrapper as the model (:class:`ModulePaths`), so
    the warning says nothing about the user's step.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"Using `torch\.compile\(module\)` when there are global hooks"
        )
        yield

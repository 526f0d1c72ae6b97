"""A library's function replaced while open, whether the library is imported before or during.

A script imports its libraries itself, after oomkit's emulation has begun, and oomkit does not
import a library the script may not use (transformers alone takes seconds). ``patched_on_import``
applies a patch to a module now if it is loaded, else when the script imports it: a finder at
the front of ``sys.meta_path`` (the import system's hook, importlib/_bootstrap.py
``_find_spec``) hands out the module's real spec with its loader's ``exec_module`` followed by
the patch. On exit the finder is removed and every patch applied is undone.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

__all__ = ["patched_on_import"]

# patch(module) replaces what it needs and returns the function that puts it back.
Patch = Callable[[ModuleType], Callable[[], None]]


class _PatchingFinder(importlib.abc.MetaPathFinder):
    """Finds ``name``'s spec with the finders after it and patches the module once loaded."""

    def __init__(self, name: str, patch: Patch, undo: list[Callable[[], None]]) -> None:
        self._name, self._patch, self._undo = name, patch, undo

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self._name:
            return None
        others = [f for f in sys.meta_path if f is not self]
        spec = next(
            (s for f in others if (s := _spec_of(f, fullname, path, target)) is not None), None
        )
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader: Any = spec.loader
        execute, patch, undo = loader.exec_module, self._patch, self._undo

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
                created: ModuleType | None = loader.create_module(spec)
                return created

            def exec_module(self, module: ModuleType) -> None:
                # The module keeps its own loader (inspect and linecache ask it for source).
                module.__loader__ = loader
                if module.__spec__ is not None:
                    module.__spec__.loader = loader
                execute(module)
                undo.append(patch(module))

            def __getattr__(self, attr: str) -> Any:
                return getattr(loader, attr)

        spec.loader = _Loader()
        return spec


def _spec_of(finder: Any, fullname: str, path: Any, target: Any) -> Any:
    find = getattr(finder, "find_spec", None)
    return None if find is None else find(fullname, path, target)


@contextlib.contextmanager
def patched_on_import(name: str, patch: Patch) -> Iterator[None]:
    """While open, module ``name`` has ``patch`` applied: now if it is imported, else as soon
    as it is; undone on exit (module docstring)."""
    undo: list[Callable[[], None]] = []
    finder: _PatchingFinder | None = None
    module = sys.modules.get(name)
    if module is not None:
        undo.append(patch(module))
    else:
        finder = _PatchingFinder(name, patch, undo)
        sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        if finder is not None and finder in sys.meta_path:
            sys.meta_path.remove(finder)
        for put_back in reversed(undo):
            put_back()

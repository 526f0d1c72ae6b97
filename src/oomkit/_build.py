"""Which allocator core this installation runs: compiled by ``setup.py`` (mypyc) or pure Python.

Found without importing the allocator (``oomkit --version`` stays cheap): the path finder that
``import`` uses picks, in one folder, an extension module over the ``.py`` source of the same
name, so asking it where ``caching_allocator`` would load from answers what an import would run.
"""

from __future__ import annotations

from importlib.machinery import EXTENSION_SUFFIXES, PathFinder
from pathlib import Path

__all__ = ["COMPILED", "PURE_PYTHON", "allocator_core"]

COMPILED = "compiled (mypyc)"
PURE_PYTHON = "pure Python"


def allocator_core() -> str:
    """:data:`COMPILED` when ``oomkit.core.allocator.caching_allocator`` loads from an extension
    module, else :data:`PURE_PYTHON`."""
    folder = Path(__file__).resolve().parent / "core" / "allocator"
    spec = PathFinder.find_spec("caching_allocator", [str(folder)])
    origin = spec.origin if spec is not None else None
    compiled = origin is not None and origin.endswith(tuple(EXTENSION_SUFFIXES))
    return COMPILED if compiled else PURE_PYTHON

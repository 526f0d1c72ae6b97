"""Which allocator core a test run imports: the sources, or the wheel's compiled extensions.

`make test` runs the sources of the editable install (pure Python); `make test-compiled` (CI)
runs the core tests again on a wheel built by ``setup.py`` and sets ``OOMKIT_EXPECT_COMPILED=1``.
Each run checks that it tested what it meant to: a wheel that silently fell back to pure Python,
or an extension left in ``src/`` shadowing the sources being edited, fails here.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
from pathlib import Path
from types import FunctionType

from oomkit.core.allocator import CachingAllocator

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "compile_allocator.py"


def _compiled_modules() -> tuple[str, ...]:
    """scripts/compile_allocator.py's MODULES (paths under ``oomkit/``): what setup.py compiles."""
    spec = importlib.util.spec_from_file_location("compile_allocator", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return tuple(module.MODULES)


def _expect_compiled() -> bool:
    return os.environ.get("OOMKIT_EXPECT_COMPILED", "") not in ("", "0")


def test_every_hot_module_comes_from_the_expected_build():
    compiled = _expect_compiled()
    for name in _compiled_modules():
        module = importlib.import_module("oomkit." + name.replace("/", "."))
        suffix = Path(module.__file__ or "").name
        is_extension = any(
            suffix.endswith(ext) for ext in importlib.machinery.EXTENSION_SUFFIXES
        )
        assert is_extension is compiled, f"{name}: {module.__file__}"


def test_malloc_is_a_python_function_only_in_the_pure_build():
    # benchmarks/replay_speed.py names the build from this same test.
    malloc = CachingAllocator.__dict__["malloc"]
    assert isinstance(malloc, FunctionType) is not _expect_compiled()


def test_pools_know_which_build_runs_them():
    """pools.NATIVE picks the best-fit search: the native loop compiled, bisect interpreted."""
    from oomkit.core.allocator import pools

    assert pools.NATIVE is _expect_compiled()


def test_allocator_core_names_the_build_without_importing_it():
    """oomkit._build.allocator_core (``oomkit --version``) asks the import system's path finder,
    so it names the build the allocator's import loaded."""
    from oomkit._build import COMPILED, PURE_PYTHON, allocator_core

    assert allocator_core() == (COMPILED if _expect_compiled() else PURE_PYTHON)


def test_allocator_core_prefers_an_extension_as_import_does(tmp_path, monkeypatch):
    """In a copy of the package folder, an extension beside caching_allocator.py is what the
    finder (and import) picks."""
    import oomkit._build as build

    package = tmp_path / "oomkit"
    (package / "core" / "allocator").mkdir(parents=True)
    (package / "core" / "allocator" / "caching_allocator.py").write_text("")
    monkeypatch.setattr(build, "__file__", str(package / "_build.py"))
    assert build.allocator_core() == build.PURE_PYTHON
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    (package / "core" / "allocator" / f"caching_allocator{suffix}").write_bytes(b"")
    assert build.allocator_core() == build.COMPILED

"""Build hook: a wheel built from this repository carries the compiled allocator core (issue 19).

Everything about the package is in ``pyproject.toml``; this file only adds one build step. After
setuptools copies the sources into the wheel's build folder, the allocator's hot modules there
are compiled with mypyc (``scripts/compile_allocator.py``'s ``compile_core``) into extensions
beside their ``.py`` files, which Python imports in their place; the wheel is then tagged for
this interpreter and platform. ``pip install .`` therefore gives the compiled core (624k-779k
events/s on real traces with verify, against 443k-542k pure: README "Performance").

- ``OOMKIT_PURE_PYTHON=1`` builds a pure-Python wheel (no compiler needed).
- Without a C compiler (or when mypyc fails) the build says so and falls back to the pure-Python
  modules, unless ``OOMKIT_REQUIRE_COMPILED=1`` (CI) makes that an error.
- The editable install of the dev set-up (``pip install -e``) is never compiled: the tests run
  the sources being edited, and a stale extension would shadow them.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
COMPILER_SCRIPT = ROOT / "scripts" / "compile_allocator.py"


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


def _compiler() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_oomkit_compile_allocator", COMPILER_SCRIPT)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {COMPILER_SCRIPT}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compiling() -> bool:
    return not _flag("OOMKIT_PURE_PYTHON")


class BuildPyCompiled(build_py):
    """``build_py``, then mypyc on the copied allocator core (not in editable mode)."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        build_lib = Path(self.build_lib)
        compiler = _compiler()
        for stale in compiler.built(build_lib):  # an earlier build's, in a reused build folder
            stale.unlink()
        if not _compiling():
            return
        try:
            placed = compiler.compile_core(build_lib, build_lib)
        except Exception as exc:  # no compiler, no mypyc, a mypyc error: fall back, say so
            if _flag("OOMKIT_REQUIRE_COMPILED"):
                raise SystemExit(
                    f"oomkit: compiling the allocator core failed ({exc}) and "
                    "OOMKIT_REQUIRE_COMPILED is set"
                ) from exc
            print(
                f"oomkit: compiling the allocator core failed ({exc}); this build is pure "
                "Python (same results, about 1.4x slower replays). Install a C compiler and "
                "mypy to compile it, or set OOMKIT_PURE_PYTHON=1 to skip this step.",
                file=sys.stderr,
            )
            return
        for path in placed:
            print(f"oomkit: compiled {path.relative_to(build_lib)}")


class CompiledDistribution(Distribution):
    """Tells bdist_wheel that the wheel holds extensions (a cpXY-platform tag, not py3-none-any)
    unless a pure-Python build was asked for."""

    def has_ext_modules(self) -> bool:
        return _compiling()


if __name__ == "__main__":  # setuptools' build backend runs this file as __main__
    setup(cmdclass={"build_py": BuildPyCompiled}, distclass=CompiledDistribution)

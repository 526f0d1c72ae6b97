"""Build hook: a wheel built from this repository carries the compiled allocator core (issue 19).

Everything about the package is in ``pyproject.toml``; this file only adds one build step. After
setuptools copies the sources into the wheel's build folder, the allocator's hot modules there
are compiled with mypyc (``scripts/compile_allocator.py``'s ``compile_core``) into extensions
beside their ``.py`` files, which Python imports in their place; the wheel is then tagged for
this interpreter and platform (a build that compiled nothing is tagged ``py3-none-any``: the tag
is decided after the compile, ``BdistWheelTagged``). ``pip install .`` therefore gives the compiled core (2.2M-3.2M
events/s, median 2.83M, on the six largest real traces with verify from prepared inputs, against
676k-822k pure, 2026-11-29: docs/benchmarks.md "Against a plain re-implementation").

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

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools before 70.1: the wheel package's (a build requirement)
    from wheel.bdist_wheel import bdist_wheel  # type: ignore[no-redef]

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
        _set_compiled(self.distribution, False)  # until the compile below succeeds
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
                "Python (same results, about 2.5-4x slower replays). Install a C compiler and "
                "mypy to compile it, or set OOMKIT_PURE_PYTHON=1 to skip this step.",
                file=sys.stderr,
            )
            return
        _set_compiled(self.distribution, bool(placed))
        for path in placed:
            print(f"oomkit: compiled {path.relative_to(build_lib)}")


def _set_compiled(distribution: Distribution, compiled: bool) -> None:
    if isinstance(distribution, CompiledDistribution):
        distribution.compiled_core = compiled


class CompiledDistribution(Distribution):
    """Tells bdist_wheel whether the wheel holds extensions (a cpXY-platform tag, not
    py3-none-any): once ``build_py`` ran, whether it compiled the core; before, whether it will
    try (no ``OOMKIT_PURE_PYTHON``), which is what ``build`` picks its folder by."""

    compiled_core: bool | None = None  # set by BuildPyCompiled.run

    def has_ext_modules(self) -> bool:
        if self.compiled_core is not None:
            return self.compiled_core
        return _compiling()


class BdistWheelTagged(bdist_wheel):
    """``bdist_wheel`` that compiles (``build_py``) before it decides the wheel's tag: setuptools
    decides it from ``has_ext_modules`` when its options are finalized, before anything is
    built, so a build whose compile failed and fell back was tagged for this interpreter and
    platform although it held pure Python only."""

    def run(self) -> None:
        if not self.skip_build:
            self.run_command("build_py")  # compiles, or falls back; `build` then skips it
        self.root_is_pure = not self.distribution.has_ext_modules()
        super().run()


if __name__ == "__main__":  # setuptools' build backend runs this file as __main__
    setup(
        cmdclass={"build_py": BuildPyCompiled, "bdist_wheel": BdistWheelTagged},
        distclass=CompiledDistribution,
    )

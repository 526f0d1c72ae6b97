"""Build the compiled allocator core with mypyc in place (issue 19 item 2); ``--clean`` removes it.

A wheel built from this repository (``pip install .``, ``pip wheel .``) is compiled by
``setup.py``, which calls :func:`compile_core` on the wheel's build folder; the editable install
of the dev set-up stays pure Python. This script compiles the modules that
every malloc and free runs (blocks, the active blocks, pools, best fit, the allocator, its
constants, stats, settings and device memory), the seeding and ``snapshot()`` of every replay (state) and the
replay loop itself (``core/replay/engine.py``, issue 41) into C extensions placed beside their
sources in ``src/``; Python then imports them in
place of the ``.py`` files, and removing them (``--clean``) brings the pure-Python modules back.
The tests pass on both (run them after building to check a build).

mypyc type-checks what it compiles and everything that imports; the package's ``__init__``
names the whole API for type checkers (torch included), so the allocator is compiled in a copy
of the tree that holds only ``oomkit.errors``, ``oomkit.core.allocator`` (it imports nothing
else) and what the replay loop imports (its hooks, trace columns, record and the trace event
model, copied and type-checked, not compiled, under package ``__init__`` files that import
nothing), and the built extensions are copied back.

Compiled code checks argument types where it is called (``malloc(1.5)`` would raise TypeError
before the method's own check). So that bad input gets the same ``AllocatorUsageError`` /
``ConfigError`` as in pure Python, the copy's ``CachingAllocator`` methods that users call, and
``state.seed_segment`` with the ``_check_seed`` it calls first, take ``Any`` arguments (their own
checks run first); the sources in ``src/`` are not changed. Once checked, ``seed_segment`` hands
its ints and bools to ``state._seed_checked``, which keeps its types (the seeding itself runs on
native integers, issue 41).

Needs ``mypy`` (which ships mypyc) and a C compiler: ``pip install mypy``, then
``python scripts/compile_allocator.py``.
"""

from __future__ import annotations

import argparse
import ast
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = SRC / "oomkit" / "core" / "allocator"
# The modules of the hot path, compiled together (a final constant of one is inlined in another).
# state (seeding the start state, snapshot()) runs once per replay: compiled, it took 3-4% off the
# instructions of a real-trace verify (issue 19, measured with valgrind's cachegrind).
MODULES = (
    "core/allocator/block",
    # The active blocks (issue 41): malloc and free add and remove a block with native calls.
    "core/allocator/active_blocks",
    "core/allocator/pools",
    "core/allocator/best_fit",
    "core/allocator/caching_allocator",
    "core/allocator/constants",
    "core/allocator/stats",
    "core/allocator/settings",
    "core/allocator/state",
    # Seeding's reserved-bytes and counter updates and a new segment's cudaMalloc (issue 41).
    "core/allocator/device_memory",
    # The replay loop (issue 41): compiled with the allocator, its calls to malloc and free are
    # native calls, and it reads the trace's integer columns without boxing.
    "core/replay/engine",
)
# Packages that hold compiled modules.
PACKAGES = ("core/allocator", "core/replay")
# What the loop imports besides the allocator, copied (not compiled) so mypyc can type-check it;
# the copy's package __init__ files import nothing (the real ones import the whole layer).
_LOOP_SOURCES = ("core/replay/columns", "core/replay/hooks", "core/replay/result", "core/trace/events")
_TRACE_INIT = """\"\"\"oomkit.core.trace (the event model only, to compile the replay loop).\"\"\"

from oomkit.core.trace.events import TraceEvent

__all__ = ["TraceEvent"]
"""
# Public methods that keep their argument types: they are documented to take checked ints (the
# replay loop's requests) or the allocator's own blocks, so a compiled caller passes native
# integers and native objects.
_TYPED_METHODS = ("serve", "serve_block", "free_served", "complete_served")
_MYPY_CONFIG = """[mypy]
python_version = {version}
[mypy-sortedcontainers.*]
ignore_missing_imports = True
[mypy-sortedcontainers]
ignore_missing_imports = True
"""


def _public_arguments_any(path: Path) -> None:
    """Rewrite ``path`` (the copy of caching_allocator.py) so the public methods of
    ``CachingAllocator`` (and its constructor) take ``Any`` arguments."""
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "CachingAllocator":
            for item in node.body:
                if not isinstance(item, ast.FunctionDef):
                    continue
                if item.name.startswith("_") and item.name != "__init__":
                    continue
                if item.name in _TYPED_METHODS:
                    continue
                args = item.args
                for arg in (*args.posonlyargs, *args.args[1:], *args.kwonlyargs):
                    arg.annotation = ast.Name(id="Any", ctx=ast.Load())
    path.write_text(ast.unparse(tree) + "\n")


def _function_arguments_any(path: Path, names: tuple[str, ...]) -> None:
    """Rewrite ``path`` (a copy) so the module-level functions ``names`` take ``Any`` arguments
    (all but the first, the allocator's parts): ``state.seed_segment`` and the ``_check_seed``
    it calls first, and ``state.seed_reservation``, whose checks must raise AllocatorUsageError
    on bad input, not TypeError."""
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            args = node.args
            positional = [*args.posonlyargs, *args.args]
            skip = 1 if node.name == "seed_segment" else 0
            for arg in (*positional[skip:], *args.kwonlyargs):
                arg.annotation = ast.Name(id="Any", ctx=ast.Load())
    # (state.py imports Any itself.)
    path.write_text(ast.unparse(tree) + "\n")


class CompileError(RuntimeError):
    """mypyc could not compile the allocator core (no compiler, a type error, ...)."""


def built(root: Path = SRC) -> list[Path]:
    """The compiled files under ``root`` (a folder holding ``oomkit/``): the extensions and
    mypyc's runtime."""
    found = [*root.glob("*__mypyc*")]
    for name in PACKAGES:
        package = root / "oomkit" / name
        found += [*package.glob("*.so"), *package.glob("*.pyd")]
    return sorted(found)


def clean() -> int:
    for path in built():
        path.unlink()
        print(f"removed {path.relative_to(SRC.parent)}")
    return 0


def compile_core(source: Path, dest: Path) -> list[Path]:
    """Compile the allocator core of the ``oomkit`` package under ``source`` and place the
    extensions under ``dest`` (``src/`` for this script; a wheel's build folder for
    ``setup.py``), beside their ``.py`` sources; mypyc's runtime goes to ``dest``'s top.

    Returns:
        The files placed.

    Raises:
        CompileError: mypyc failed (nothing is placed).
    """
    package_source = source / "oomkit" / "core" / "allocator"
    with tempfile.TemporaryDirectory(prefix="oomkit-mypyc-") as tmp:
        root = Path(tmp)
        package = root / "oomkit"
        (package / "core").mkdir(parents=True)
        (package / "__init__.py").write_text('"""oomkit (the allocator only, to compile it)."""\n')
        (package / "core" / "__init__.py").write_text('"""oomkit.core."""\n')
        shutil.copy(source / "oomkit" / "errors.py", package / "errors.py")
        shutil.copytree(
            package_source,
            package / "core" / "allocator",
            ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyd"),
        )
        for folder in ("replay", "trace"):
            (package / "core" / folder).mkdir()
            (package / "core" / folder / "__init__.py").write_text(
                _TRACE_INIT if folder == "trace" else f'"""oomkit.core.{folder}."""\n'
            )
        loop = [name for name in MODULES if not name.startswith("core/allocator/")]
        for name in (*loop, *_LOOP_SOURCES):
            shutil.copy(source / "oomkit" / f"{name}.py", package / f"{name}.py")
        _public_arguments_any(package / "core" / "allocator" / "caching_allocator.py")
        _function_arguments_any(
            package / "core" / "allocator" / "state.py",
            ("seed_segment", "_check_seed", "seed_reservation"),
        )
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        (root / "mypy.ini").write_text(_MYPY_CONFIG.format(version=version))
        files = [f"oomkit/{name}.py" for name in MODULES]
        done = subprocess.run(
            [sys.executable, "-m", "mypyc", "--config-file", "mypy.ini", *files], cwd=root
        )
        if done.returncode != 0:
            raise CompileError(f"mypyc exited with status {done.returncode}")
        placed = []
        for ext in (*root.glob("*__mypyc*.so"), *root.glob("*__mypyc*.pyd")):
            placed.append(Path(shutil.copy(ext, dest / ext.name)))
        for name in PACKAGES:
            compiled = package / name
            for ext in (*compiled.glob("*.so"), *compiled.glob("*.pyd")):
                placed.append(Path(shutil.copy(ext, dest / "oomkit" / name / ext.name)))
    return sorted(placed)


def build() -> int:
    clean()
    try:
        compile_core(SRC, SRC)
    except CompileError as exc:
        print(f"{exc}; nothing was installed (the pure-Python modules stay in use)")
        return 1
    for path in built():
        print(f"built {path.relative_to(SRC.parent)}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clean", action="store_true", help="remove the compiled modules")
    args = parser.parse_args()
    return clean() if args.clean else build()


if __name__ == "__main__":
    raise SystemExit(main())

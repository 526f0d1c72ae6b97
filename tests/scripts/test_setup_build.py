"""setup.py: a wheel built from the repository compiles the allocator core, or says why not."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _setup_module():
    spec = importlib.util.spec_from_file_location("oomkit_setup", REPO / "setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not __main__: setup() is not called
    return module


class _FakeCompiler:
    """Stands in for scripts/compile_allocator.py: records calls, fails when told to."""

    class CompileError(RuntimeError):
        pass

    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.compiled: list[Path] = []

    def built(self, root: Path) -> list[Path]:
        return sorted((root / "oomkit" / "core" / "allocator").glob("*.so"))

    def compile_core(self, source: Path, dest: Path) -> list[Path]:
        if self.fail:
            raise self.CompileError("mypyc exited with status 1")
        out = dest / "oomkit" / "core" / "allocator" / "block.cpython-test.so"
        out.write_bytes(b"\x7fELF")
        self.compiled.append(source)
        return [out]


def _run_build_py(setup, tmp_path, monkeypatch, compiler, *, editable=False):
    monkeypatch.setattr(setup, "_compiler", lambda: compiler)
    build_lib = tmp_path / "lib"
    (build_lib / "oomkit" / "core" / "allocator").mkdir(parents=True, exist_ok=True)
    dist = setup.CompiledDistribution({"name": "oomkit-test", "packages": []})
    command = setup.BuildPyCompiled(dist)
    command.build_lib = str(build_lib)
    command.editable_mode = editable
    command.ensure_finalized()
    command.run()
    _run_build_py.distribution = dist  # type: ignore[attr-defined]
    return build_lib


def test_the_build_compiles_the_copied_core(tmp_path, monkeypatch, capsys):
    setup = _setup_module()
    monkeypatch.delenv("OOMKIT_PURE_PYTHON", raising=False)
    compiler = _FakeCompiler(fail=False)
    build_lib = _run_build_py(setup, tmp_path, monkeypatch, compiler)
    assert compiler.compiled == [build_lib]
    assert "oomkit: compiled oomkit/core/allocator/block.cpython-test.so" in capsys.readouterr().out
    assert setup.CompiledDistribution().has_ext_modules() is True
    assert _run_build_py.distribution.has_ext_modules() is True


def test_a_failed_compile_falls_back_to_pure_python_and_says_so(tmp_path, monkeypatch, capsys):
    setup = _setup_module()
    monkeypatch.delenv("OOMKIT_PURE_PYTHON", raising=False)
    monkeypatch.delenv("OOMKIT_REQUIRE_COMPILED", raising=False)
    build_lib = _run_build_py(setup, tmp_path, monkeypatch, _FakeCompiler(fail=True))
    err = capsys.readouterr().err
    assert "compiling the allocator core failed (mypyc exited with status 1)" in err
    assert "this build is pure Python" in err and "OOMKIT_PURE_PYTHON=1" in err
    assert list((build_lib / "oomkit" / "core" / "allocator").glob("*.so")) == []
    # The wheel is then tagged as pure Python (BdistWheelTagged reads this after the build).
    assert _run_build_py.distribution.has_ext_modules() is False


def test_require_compiled_turns_the_fallback_into_an_error(tmp_path, monkeypatch):
    setup = _setup_module()
    monkeypatch.delenv("OOMKIT_PURE_PYTHON", raising=False)
    monkeypatch.setenv("OOMKIT_REQUIRE_COMPILED", "1")
    with pytest.raises(SystemExit, match="OOMKIT_REQUIRE_COMPILED is set"):
        _run_build_py(setup, tmp_path, monkeypatch, _FakeCompiler(fail=True))


def test_pure_python_flag_skips_the_compile_and_drops_stale_extensions(tmp_path, monkeypatch):
    setup = _setup_module()
    monkeypatch.setenv("OOMKIT_PURE_PYTHON", "1")
    stale = tmp_path / "lib" / "oomkit" / "core" / "allocator" / "pools.cpython-old.so"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"old")
    compiler = _FakeCompiler(fail=False)
    _run_build_py(setup, tmp_path, monkeypatch, compiler)
    assert compiler.compiled == [] and not stale.exists()
    assert setup.CompiledDistribution().has_ext_modules() is False


def test_the_editable_install_is_never_compiled(tmp_path, monkeypatch):
    setup = _setup_module()
    monkeypatch.delenv("OOMKIT_PURE_PYTHON", raising=False)
    compiler = _FakeCompiler(fail=False)
    _run_build_py(setup, tmp_path, monkeypatch, compiler, editable=True)
    assert compiler.compiled == []


def _repository_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "repo"
    copy.mkdir()
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md"):
        shutil.copy(REPO / name, copy / name)
    shutil.copytree(REPO / "scripts", copy / "scripts")
    shutil.copytree(
        REPO / "src", copy / "src", ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info")
    )
    return copy


def _wheel_of(copy: Path, out: Path, env: dict[str, str]) -> Path:
    """Build a wheel of ``copy`` with pip and this environment's setuptools; its path."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(out), str(copy)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    (wheel,) = out.glob("*.whl")
    return wheel


def test_a_pure_wheel_is_tagged_for_any_platform_and_holds_no_extension(tmp_path):
    """A real build (pip, this environment's setuptools) of a copy of the repository with
    OOMKIT_PURE_PYTHON=1 and a stale extension in its build folder."""
    copy = _repository_copy(tmp_path)
    stale = copy / "build" / "lib" / "oomkit" / "core" / "allocator" / "block.cpython-old.so"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"old")
    wheel = _wheel_of(copy, tmp_path / "wheels", {**_base_env(), "OOMKIT_PURE_PYTHON": "1"})
    assert wheel.name.endswith("-py3-none-any.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "oomkit/core/allocator/caching_allocator.py" in names
    assert [n for n in names if n.endswith(".so")] == []


def test_a_wheel_whose_compile_failed_is_tagged_as_pure_python(tmp_path):
    """A real build where compiling fails (the copy's compiler script raises, as mypyc does
    without a C compiler): the fallback wheel holds no extension and says so in its tag and its
    WHEEL file, instead of claiming this interpreter and platform."""
    copy = _repository_copy(tmp_path)
    (copy / "scripts" / "compile_allocator.py").write_text(
        "def built(root):\n    return []\n\n\n"
        "def compile_core(source, dest):\n    raise RuntimeError('no C compiler here')\n"
    )
    wheel = _wheel_of(copy, tmp_path / "wheels", _base_env())
    assert wheel.name.endswith("-py3-none-any.whl")
    archive = zipfile.ZipFile(wheel)
    assert [n for n in archive.namelist() if n.endswith(".so")] == []
    (metadata,) = [n for n in archive.namelist() if n.endswith(".dist-info/WHEEL")]
    text = archive.read(metadata).decode()
    assert "Root-Is-Purelib: true" in text and "Tag: py3-none-any" in text


def _base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("OOMKIT_")}

"""The installed torch's version, read from torch/version.py: torch and its metadata not imported."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oomkit.core.gpus import cuda_versions
from oomkit.core.gpus.installed_torch import installed_torch_version
from oomkit.scenario import target as scenario_target

REPO = Path(__file__).resolve().parents[3]
pytest.importorskip("torch")


def _fake_torch(root: Path, version_py: str | None) -> None:
    """A ``torch`` package under ``root`` that must never be imported, with ``version.py``."""
    package = root / "torch"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("raise ImportError('never imported')\n")
    if version_py is not None:
        (package / "version.py").write_text(version_py)


def test_the_installed_torch_gives_what_the_metadata_and_the_import_give():
    """On this install: the same string as importlib.metadata and torch.__version__, and the
    one reader behind cuda_versions and the scenario's major.minor."""
    import torch

    version = installed_torch_version()
    assert version == importlib.metadata.version("torch") == torch.__version__
    assert cuda_versions.installed_torch_version is installed_torch_version
    assert cuda_versions.installed_cuda_build().cuda_version == (
        cuda_versions.cuda_build_for(version).cuda_version
    )
    major, minor = version.split(".")[:2]
    assert scenario_target.installed_torch_version() == f"{major}.{minor}"


def test_the_version_py_an_import_would_load_wins_else_the_metadata(tmp_path, monkeypatch):
    """A torch first on sys.path is read from its version.py (the one import torch loads);
    without that file, or with no __version__ line in it, the metadata answers."""
    real = importlib.metadata.version("torch")
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # find_spec would return its spec
    _fake_torch(tmp_path, "from typing import Optional\n\n__version__ = '9.9.9+cu999'\ndebug = False\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert installed_torch_version() == "9.9.9+cu999"
    assert scenario_target.installed_torch_version() == "9.9"
    assert cuda_versions.installed_cuda_build().source == "torch 9.9.9+cu999"
    (tmp_path / "torch" / "version.py").write_text("git_version = 'abc'\n")
    assert installed_torch_version() == real
    (tmp_path / "torch" / "version.py").unlink()
    assert installed_torch_version() == real


def test_no_torch_found_is_none(monkeypatch):
    """Where no torch can be imported, there is no version: None, and the scenario's too."""
    found = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torch" else found(name, *a)
    )
    assert installed_torch_version() is None
    assert scenario_target.installed_torch_version() is None


def test_a_torch_module_without_a_spec_falls_back_to_the_metadata(monkeypatch):
    """A stand-in ``torch`` in sys.modules without ``__spec__`` (find_spec raises ValueError):
    the metadata's version, as before."""
    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))
    assert installed_torch_version() == importlib.metadata.version("torch")


@settings(max_examples=25, deadline=None)
@given(
    version=st.from_regex(r"\A[0-9]{1,2}\.[0-9]{1,2}\.[0-9]{1,2}(a0)?(\+[a-z0-9.]{1,12})?\Z"),
    quote=st.sampled_from(["'", '"']),
    spaces=st.sampled_from(["=", " = ", "  =\t"]),
)
def test_any_written_version_line_reads_back(version, quote, spaces):
    """Whatever version and quoting tools/generate_torch_version.py writes, it reads back."""
    with tempfile.TemporaryDirectory() as root:
        _fake_torch(Path(root), f"__all__ = ['__version__']\n__version__{spaces}{quote}{version}{quote}\n")
        saved_torch = sys.modules.pop("torch", None)
        sys.path.insert(0, root)
        try:
            assert installed_torch_version() == version
        finally:
            sys.path.remove(root)
            if saved_torch is not None:
                sys.modules["torch"] = saved_torch


def test_a_gpu_target_reads_the_version_without_torch_or_the_metadata():
    """``Target.resolve("h100")`` (what --gpu does) in a fresh interpreter: the CUDA of the
    installed torch is found, and neither torch nor importlib.metadata was imported."""
    probe = (
        "import json, sys\n"
        "from oomkit.core.target import Target\n"
        "target = Target.resolve('h100')\n"
        "print(json.dumps({'cuda': target.cuda_version, 'modules': sorted(sys.modules)}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
        timeout=60,
        check=True,
    )
    data = json.loads(out.stdout.strip().splitlines()[-1])
    assert data["cuda"] == cuda_versions.cuda_build_for(installed_torch_version()).cuda_version
    assert "torch" not in data["modules"]
    assert "importlib.metadata" not in data["modules"]

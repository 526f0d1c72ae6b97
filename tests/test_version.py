"""oomkit's version: one constant in _version.py, which setuptools reads for the package metadata."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest

import oomkit
from oomkit.interfaces.cli import main

ROOT = Path(__file__).parents[1]


def test_pyproject_reads_the_version_from_the_constant():
    """pyproject.toml writes no second version: setuptools reads ``oomkit._version.__version__``."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    setuptools_expand = pytest.importorskip("setuptools.config.expand")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"]
    assert project["project"]["dynamic"] == ["version"]
    attr = project["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "oomkit._version.__version__"
    # The same call setuptools makes when it builds the metadata (it reads the module statically).
    read = setuptools_expand.read_attr(attr, package_dir={"": "src"}, root_dir=ROOT)
    assert read == oomkit.__version__ == "0.1.0"


def test_version_matches_the_installed_metadata():
    """When pip installed oomkit, its metadata records the same version ``oomkit.__version__``
    says."""
    try:
        installed = metadata.version("oomkit")
    except metadata.PackageNotFoundError:
        pytest.skip("oomkit is not installed (a source tree on PYTHONPATH)")
    assert oomkit.__version__ == installed


def test_cli_version_flag_prints_the_version_and_the_allocator_core(capsys):
    """``oomkit --version`` prints ``oomkit <__version__> (allocator core: ...)`` and exits 0;
    the core named is the one the allocator's import loads."""
    from types import FunctionType

    from oomkit.core.allocator import CachingAllocator

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    pure = isinstance(CachingAllocator.__dict__["malloc"], FunctionType)
    core = "pure Python" if pure else "compiled (mypyc)"
    assert capsys.readouterr().out == f"oomkit {oomkit.__version__} (allocator core: {core})\n"

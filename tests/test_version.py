"""oomkit's version: read from the package metadata, with a fallback for an uninstalled tree."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest

import oomkit
from oomkit._version import UNKNOWN_VERSION, installed_version
from oomkit.interfaces.cli import main

PYPROJECT = Path(__file__).parents[1] / "pyproject.toml"


def _pyproject_version() -> str:
    match = re.search(r'^version = "([^"]+)"$', PYPROJECT.read_text(), re.MULTILINE)
    assert match is not None
    return match.group(1)


def test_version_is_the_installed_metadata():
    """``oomkit.__version__`` is what pip recorded from pyproject.toml, not a second literal."""
    try:
        installed = metadata.version("oomkit")
    except metadata.PackageNotFoundError:
        pytest.skip("oomkit is not installed (a source tree on PYTHONPATH)")
    assert oomkit.__version__ == installed == _pyproject_version()


def test_an_uninstalled_distribution_reads_as_unknown():
    """Without metadata (a source tree that was never pip-installed) the version is 0+unknown."""
    assert installed_version("oomkit-no-such-distribution") == UNKNOWN_VERSION == "0+unknown"


def test_cli_version_flag_prints_the_version(capsys):
    """``oomkit --version`` prints ``oomkit <__version__>`` and exits 0."""
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"oomkit {oomkit.__version__}\n"

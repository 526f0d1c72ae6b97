"""Tests of the prediction layer. This folder holds ``_tiny_hf`` (tiny transformers configs),
which the tests in models/ and tracing/ import: pytest's default ``prepend`` import mode puts a
conftest's folder on ``sys.path`` before it collects the tests below it. ``rows_module`` gives the tests of
``benchmarks/torchtitan_rows.py`` that script as a module, ``validation_script``
``scripts/validate_on_gpu.py``."""

import importlib
import sys
from pathlib import Path

import pytest

_BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
_SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _script_module(folder: Path, name: str):
    """``folder/name.py`` imported as a module (its functions, not its CLI)."""
    sys.path.insert(0, str(folder))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(folder))


@pytest.fixture(scope="module")
def rows_module():
    """``benchmarks/torchtitan_rows.py`` imported as a module (its functions, not its CLI)."""
    return _script_module(_BENCHMARKS, "torchtitan_rows")


@pytest.fixture(scope="module")
def validation_script():
    """``scripts/validate_on_gpu.py`` imported as a module (its runs and predictions)."""
    return _script_module(_SCRIPTS, "validate_on_gpu")

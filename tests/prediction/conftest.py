"""Tests of the prediction layer. This folder holds ``_tiny_hf`` (tiny transformers configs),
which the tests in models/ and tracing/ import: pytest's default ``prepend`` import mode puts a
conftest's folder on ``sys.path`` before it collects the tests below it. ``rows_module`` gives the tests of
``benchmarks/torchtitan_rows.py`` that script as a module, ``validation_script``
``scripts/validate_on_gpu.py``."""

import sys
from pathlib import Path

import pytest

_BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
_SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture(scope="module")
def rows_module():
    """``benchmarks/torchtitan_rows.py`` imported as a module (its functions, not its CLI)."""
    sys.path.insert(0, str(_BENCHMARKS))
    try:
        import torchtitan_rows
    finally:
        sys.path.remove(str(_BENCHMARKS))
    return torchtitan_rows


@pytest.fixture(scope="module")
def validation_script():
    """``scripts/validate_on_gpu.py`` imported as a module (its runs and predictions)."""
    sys.path.insert(0, str(_SCRIPTS))
    try:
        import validate_on_gpu
    finally:
        sys.path.remove(str(_SCRIPTS))
    return validate_on_gpu

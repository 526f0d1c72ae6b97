"""A torchtitan registry module of the tests' own, as ``_torchtitan_two_blocks``: llama3's
``debugmodel_float8`` cut to its first 2 blocks. torchtitan 0.3.0 converts the linears in
``model_registry`` (``Float8LinearConverter``, rowwise), before the cut: both blocks' 5 linears
and the LM head stay converted, as in the registry's 6-block config, which records in twice the
time."""

from __future__ import annotations

from typing import Any

from _torchtitan_cut import first_blocks
from torchtitan.models.llama3.config_registry import llama3_debugmodel_float8

__all__ = ["llama3_debug_two_blocks_float8"]


def llama3_debug_two_blocks_float8() -> Any:
    """``llama3_debugmodel_float8`` with 2 transformer blocks instead of 6."""
    return first_blocks(llama3_debugmodel_float8(), 2)

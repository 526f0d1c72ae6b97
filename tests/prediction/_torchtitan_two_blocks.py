"""A torchtitan registry module of the tests' own (``--torchtitan _torchtitan_two_blocks:...``,
as torchtitan's launcher takes a module outside torchtitan: torchtitan/config/manager.py
``_load_config``): llama3's debug model cut to its first 2 blocks, so that a compiled job records
in seconds. The rest of ``llama3_debugmodel`` (dim 256, 16 heads, vocab 2,048) is kept."""

from __future__ import annotations

from typing import Any

from _torchtitan_cut import first_blocks
from torchtitan.models.llama3.config_registry import llama3_debugmodel

__all__ = ["llama3_debug_two_blocks"]


def llama3_debug_two_blocks() -> Any:
    """``llama3_debugmodel`` with 2 transformer blocks instead of 6."""
    return first_blocks(llama3_debugmodel(), 2)

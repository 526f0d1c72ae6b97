"""A torchtitan registry module of the tests' own (``_torchtitan_four_blocks:...``, as
torchtitan's launcher takes a module outside torchtitan: torchtitan/config/manager.py
``_load_config``): llama3's debug model cut to its first 4 blocks, for the pipeline jobs whose
first stage must keep more bytes than the last one (2 blocks a stage, where 1 does not), in two
thirds of the 6-block model's time. ``tests`` is on ``sys.path`` (pytest's ``prepend`` mode for
``tests/conftest.py``), so any test folder names it. The rest of ``llama3_debugmodel`` (dim 256,
16 heads, vocab 2,048) is kept."""

from __future__ import annotations

from typing import Any

from _torchtitan_cut import first_blocks
from torchtitan.models.llama3.config_registry import llama3_debugmodel

__all__ = ["llama3_debug_four_blocks"]


def llama3_debug_four_blocks() -> Any:
    """``llama3_debugmodel`` with 4 transformer blocks instead of 6."""
    return first_blocks(llama3_debugmodel(), 4)

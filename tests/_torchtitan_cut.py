"""What the tests' torchtitan registry modules share: a registry config cut to its first blocks.

The registry modules (``_torchtitan_four_blocks``, and ``_torchtitan_two_blocks`` /
``_torchtitan_two_blocks_float8`` in tests/prediction) are named by module and function, as
torchtitan's launcher takes a module outside torchtitan (torchtitan/config/manager.py
``_load_config``); each is one such function. ``tests`` is on ``sys.path`` (pytest's
``prepend`` mode for ``tests/conftest.py``)."""

from __future__ import annotations

from typing import Any

__all__ = ["first_blocks"]


def first_blocks(config: Any, blocks: int) -> Any:
    """``config`` (a torchtitan registry config) with only its model's first ``blocks``
    transformer blocks; the rest of the model (dim, heads, vocabulary, Float8 conversion) is
    kept."""
    config.model_spec.model.layers = config.model_spec.model.layers[:blocks]
    return config

"""torchtitan registry configs for the published rows torchtitan 0.3.0's own registry refuses.

``--torchtitan torchtitan_long_configs:llama3_8b_256k`` (this folder on ``sys.path``, as
``torchtitan_rows.py`` puts it), a module of one's own as torchtitan's launcher takes one
(torchtitan/config/manager.py ``_load_config``: a module outside torchtitan). Llama 3.1 8B
trained on 262,144 tokens (the 8B FSDP 1 x CP 8 row; ``llama3_405b_256k`` for the 405B FSDP 1 x
TP 8 x PP 8 x CP 8 row): 0.3.0's ``llama3_8b`` and ``llama3_405b`` size RoPE for
131,072 positions and ``Decoder.Config.update_from_config`` refuses a longer ``seq_len`` before
any ``--override.imports`` applies; 2024's torchtitan sized its RoPE table from the job's
``seq_len`` (torchtitan/train.py at 9dec370: ``model_config.max_seq_len =
job_config.training.seq_len``). Here each block's RoPE allows 262,144 positions; the trainer
then sizes the cache to ``training.seq_len`` as for any job.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torchtitan.models.llama3.config_registry import llama3_8b, llama3_405b

__all__ = ["llama3_8b_256k", "llama3_405b_256k"]

_POSITIONS = 262_144


def _long(config: Any) -> Any:
    for layer in config.model_spec.model.layers:
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=_POSITIONS)
    return config


def llama3_8b_256k() -> Any:
    """``llama3_8b`` with RoPE for 262,144 positions."""
    return _long(llama3_8b())


def llama3_405b_256k() -> Any:
    """``llama3_405b`` with RoPE for 262,144 positions."""
    return _long(llama3_405b())

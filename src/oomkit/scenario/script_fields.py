"""The fields of a whole training script in ``[model]``, checked together: each needs the script.

``ModelSection`` (``sections.py``) calls ``check_script_fields`` after its other checks: the
script's own arguments, its torchrun world size, the rank or ranks to record of it, and the
argument ``fit`` varies. Each refusal is a ``ValueError`` whose text says what to give.
"""

from __future__ import annotations

from typing import Any

__all__ = ["check_script_fields"]


def check_script_fields(model: Any) -> None:
    """Raise ``ValueError`` for a script field without a script, or ranks that contradict."""
    if model.script_world_size is not None and model.script is None:
        raise ValueError(
            "model.script_world_size is a torchrun script's ranks: give model.script "
            "(oomkit predict train.py --world-size 8), or drop it"
        )
    _check_ranks(model.script_rank, model.script_all_ranks, model.script_world_size)
    if model.script_batch_arg is not None:
        _check_batch_arg(model.script_batch_arg, model.script)
    if model.script_args and model.script is None:
        raise ValueError(
            "model.script_args are a script's own arguments: give model.script "
            "(oomkit predict train.py -- ARGS), or drop them"
        )


def _check_ranks(rank: int | None, all_ranks: bool, world: int | None) -> None:
    """--rank R / --all-ranks of a torchrun script: with its --world-size, one of them."""
    given = [name for name, value in (("--rank", rank), ("--all-ranks", all_ranks or None))
             if value is not None]
    if not given:
        return
    if world is None:
        raise ValueError(
            f"{' and '.join(given)} pick ranks of a torchrun script: add --world-size N "
            "(oomkit predict train.py --world-size 8 --rank 7)"
        )
    if len(given) == 2:
        raise ValueError("--rank R and --all-ranks exclude each other: give one")
    if rank is not None and rank >= world:
        raise ValueError(
            f"--rank {rank} is outside the script's {world} ranks (--world-size {world}): use 0 "
            f"to {world - 1}"
        )


def _check_batch_arg(name: str, script: str | None) -> None:
    """``model.script_batch_arg``: one word naming a script's argument, with a script."""
    if script is None:
        raise ValueError(
            "--batch-arg (model.script_batch_arg) names a whole script's batch argument: give "
            "the script (oomkit fit train.py --batch-arg --batch_size -- ARGS), or drop it"
        )
    if not name.strip("-") or "=" in name or any(c.isspace() or not c.isprintable() for c in name):
        raise ValueError(
            f"--batch-arg takes the name of the script's batch argument as its parser spells "
            f"it, one word without a value (e.g. --batch_size, --per_device_train_batch_size, "
            f"data.batch_size); got {name!r}"
        )

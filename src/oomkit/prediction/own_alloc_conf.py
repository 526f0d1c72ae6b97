"""The allocator setting a user's own code sets: ``os.environ["PYTORCH_CUDA_ALLOC_CONF"]``.

A script (or a ``file.py:function``'s module) that sets ``PYTORCH_CUDA_ALLOC_CONF`` (or
``PYTORCH_ALLOC_CONF``) in ``os.environ`` runs with that setting: PyTorch reads the variable
when its caching allocator is first used (c10/core/AllocatorConfig.cpp ``parseArgs`` from the
environment), after the code that set it. oomkit does not read its own environment for the
target (``--alloc-conf``); what the user's code left changed, against the variables before it
ran, is replayed as the target's PyTorch reads it (``AllocatorConfig.from_env``: which
variable, which rules), in place of the target's setting, as ``PYTORCH_CUDA_ALLOC_CONF=X python
train.py`` runs with the script's own. The variables are then restored, since this process
goes on where the user's would end.

Where it may differ: a setting made after the first CUDA tensor has no effect on a real run,
and is replayed here all the same.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from collections.abc import Iterator, Mapping

from oomkit.core.allocator.config import AllocatorConfig
from oomkit.core.allocator.versions import ALLOC_CONF_VARIABLES, behaviour_for
from oomkit.core.target import Target
from oomkit.errors import ConfigError

__all__ = ["OwnSetting", "watching_own_setting", "with_own_setting"]


@dataclasses.dataclass
class OwnSetting:
    """What :func:`watching_own_setting` saw: the allocator variables the user's code left
    changed, as set then (``None``: it changed none)."""

    variables: dict[str, str | None] | None = None


@contextlib.contextmanager
def watching_own_setting() -> Iterator[OwnSetting]:
    """While open, the user's code runs; on exit the variables it left changed are noted in
    the record yielded, and set back, since this process goes on where the user's would end."""
    before = _variables()
    own = OwnSetting()
    try:
        yield own
    finally:
        after = _variables()
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if after != before:
            own.variables = after


def _variables() -> dict[str, str | None]:
    """The variables PyTorch's releases read their allocator setting from, as set now."""
    return {name: os.environ.get(name) for name in ALLOC_CONF_VARIABLES}


def with_own_setting(
    target: Target, variables: Mapping[str, str | None], who: str
) -> tuple[Target, str, list[str]]:
    """``target`` with the setting ``who`` ("the script") left in ``variables``.

    Returns:
        The target, the assumption that says so, and warnings: what PyTorch would warn about
        the variables, and a setting of the caller's (``--alloc-conf``) that it replaces.

    Raises:
        ConfigError: the setting is one the target's PyTorch rejects (the run would fail at
            its first CUDA allocation).
    """
    given = {name: value for name, value in variables.items() if value is not None}
    behaviour = behaviour_for(target.torch_version)
    name = behaviour.variable_read(given)
    shown = "its allocator variables unset" if name is None else f"{name}={given[name]!r}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            config = AllocatorConfig.from_env(given, target.torch_version)
        except ConfigError as exc:
            raise ConfigError(
                f"{who} sets {shown} itself, which its run would refuse at its first CUDA "
                f"allocation: {exc}"
            ) from exc
    notes = [str(w.message) for w in caught]
    if target.allocator_config not in (AllocatorConfig(), config):
        notes.append(
            f"--alloc-conf {target.alloc_conf!r} is not what {who} runs with: it sets {shown} "
            f"itself, which replaces it (predicted with its own; remove that line to predict "
            "with --alloc-conf)"
        )
    assumption = (
        f"{who} sets {shown} itself, read as torch {behaviour.version_text} reads it: "
        f"replayed with {str(config) or 'the default settings'}"
    )
    return dataclasses.replace(target, allocator_config=config), assumption, notes

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

A write after the recording's first device request has no effect on a real run (PyTorch has
parsed the variable by then): the variables are read as they stood before it, and a warning
says so. Where it may differ: PyTorch may parse the variable earlier than its first allocation
(at CUDA's lazy initialisation, which ``torch.cuda.get_device_properties`` also starts); a write
between the two is replayed here though a real run may ignore it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping

from oomkit.core.allocator.config import AllocatorConfig
from oomkit.core.allocator.versions import (
    ALLOC_CONF_VARIABLES,
    alloc_conf_variables,
    behaviour_for,
)
from oomkit.core.target import Target
from oomkit.errors import ConfigError

__all__ = ["OwnSetting", "watching_own_setting", "with_own_setting", "with_own_setting_said"]


@dataclasses.dataclass
class OwnSetting:
    """What :func:`watching_own_setting` saw of the allocator variables the user's code set.

    Attributes:
        variables: the variables as PyTorch read them, at its allocator's first use, where the
            code had changed them by then (``None``: unchanged).
        late: the variables as the code left them, where it changed them after the
            allocator's first use, which PyTorch ignores (``None``: no such change).
    """

    variables: dict[str, str | None] | None = None
    late: dict[str, str | None] | None = None

    @property
    def changed(self) -> bool:
        """Whether the code set any of them, in time or too late."""
        return self.variables is not None or self.late is not None


@contextlib.contextmanager
def watching_own_setting() -> Iterator[OwnSetting]:
    """While open, the user's code runs; on exit what it did to the allocator variables is in
    the record yielded, and they are set back, since this process goes on where the user's
    would end.

    PyTorch parses the variable once, when its caching allocator is first used
    (c10/cuda/CUDAAllocatorConfig.cpp ``CUDAAllocatorConfig::instance``, a function-local
    static), so a write after the recording's first device request changes nothing in a real
    run: the variables are read as they stood at the first such write.
    """
    before = alloc_conf_variables()
    own = OwnSetting()
    read: list[dict[str, str | None]] = []  # the variables at the allocator's first use
    environ_type = type(os.environ)
    writes = {name: getattr(environ_type, name) for name in ("__setitem__", "__delitem__")}

    def noting(write: Callable[..., None]) -> Callable[..., None]:
        def noted(mapping: object, key: object, *value: object) -> None:
            if mapping is os.environ and key in ALLOC_CONF_VARIABLES and not read:
                if _allocator_used():
                    read.append(alloc_conf_variables())
            write(mapping, key, *value)

        return noted

    for name, write in writes.items():
        setattr(environ_type, name, noting(write))
    try:
        yield own
    finally:
        for name, write in writes.items():
            setattr(environ_type, name, write)
        after = alloc_conf_variables()
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        first_use = read[0] if read else after
        if first_use != before:
            own.variables = first_use
        if after != first_use:
            own.late = after


def _allocator_used() -> bool:
    """Whether a recording in progress has requested device memory (without importing torch
    where no recording could have run)."""
    cuda_device = sys.modules.get("oomkit.prediction.tracing.cuda_device")
    return cuda_device is not None and bool(cuda_device.allocator_used())


def with_own_setting(
    target: Target, own: OwnSetting, who: str
) -> tuple[Target, str | None, list[str]]:
    """``target`` with the setting ``who`` ("the script") set itself, as ``own`` saw it.

    Returns:
        The target, the assumption that says so (``None``: the setting PyTorch read is the
        default one, unchanged), and warnings: a setting made too late, what PyTorch would warn
        about the variables, and a setting of the caller's (``--alloc-conf``) it replaces.

    Raises:
        ConfigError: the setting is one the target's PyTorch rejects (the run would fail at
            its first CUDA allocation).
    """
    notes = []
    if own.late is not None:
        read = "its setting as it was then" if own.variables is not None else "the default"
        done = _shown(own.late, target)
        done = "unsets its allocator variable" if done.endswith("unset") else f"sets {done}"
        notes.append(
            f"{who} {done} after its first CUDA allocation, which PyTorch ignores: it reads "
            f"the variable once, when its allocator is first used, so the run keeps {read} "
            "(predicted with it). Change it before the first CUDA tensor, at the top of the "
            "script, for it to apply"
        )
    if own.variables is None:
        return target, None, notes
    shown = _shown(own.variables, target)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            config = AllocatorConfig.from_env(_given(own.variables), target.torch_version)
        except ConfigError as exc:
            raise ConfigError(
                f"{who} sets {shown} itself, which its run would refuse at its first CUDA "
                f"allocation: {exc}"
            ) from exc
    notes.extend(str(w.message) for w in caught)
    if target.allocator_config not in (AllocatorConfig(), config):
        notes.append(
            f"--alloc-conf {target.alloc_conf!r} is not what {who} runs with: it sets {shown} "
            f"itself, which replaces it (predicted with its own; remove that line to predict "
            "with --alloc-conf)"
        )
    assumption = (
        f"{who} sets {shown} itself, read as torch "
        f"{behaviour_for(target.torch_version).version_text} reads it: replayed with "
        f"{str(config) or 'the default settings'}"
    )
    return dataclasses.replace(target, allocator_config=config), assumption, notes


def with_own_setting_said(target: Target, own: OwnSetting, who: str) -> tuple[Target, list[str]]:
    """``with_own_setting`` for a search, whose result has warnings and no assumptions: the
    assumption is its first warning (``"allocator setting: ..."``)."""
    target, assumption, notes = with_own_setting(target, own, who)
    said = [] if assumption is None else [f"allocator setting: {assumption}"]
    return target, [*said, *notes]


def _given(variables: Mapping[str, str | None]) -> dict[str, str]:
    return {name: value for name, value in variables.items() if value is not None}


def _shown(variables: Mapping[str, str | None], target: Target) -> str:
    """The variable the target's PyTorch reads, as set (``PYTORCH_CUDA_ALLOC_CONF='...'``)."""
    given = _given(variables)
    name = behaviour_for(target.torch_version).variable_read(given)
    return "its allocator variables unset" if name is None else f"{name}={given[name]!r}"

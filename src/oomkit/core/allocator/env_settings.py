"""Which allocator-settings variable a PyTorch release reads from an environment, and what it gets.

ref §9.1: exactly one variable is parsed, the first one set in the release's order; the others
are never merged in. :func:`settings_from_environ` answers that as a record, without warning or
raising, so that ``oomkit doctor`` can show every variable and ``AllocatorConfig.from_env`` can
warn from the same facts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from oomkit.core.allocator.config import AllocatorConfig
from oomkit.core.allocator.versions import ALLOC_CONF_VARIABLES, behaviour_for
from oomkit.errors import ConfigError

__all__ = [
    "ALLOC_CONF_VARIABLES",
    "NO_CACHING_VARIABLES",
    "EnvSettings",
    "EnvVariable",
    "VariableStatus",
    "scan_backend",
    "settings_from_environ",
]

# §9.1 "Other environment variables": any value bypasses the cache (the HIP name: MAIN26).
NO_CACHING_VARIABLES = ("PYTORCH_NO_CUDA_MEMORY_CACHING", "PYTORCH_NO_HIP_MEMORY_CACHING")

# "read": parsed; "shadowed": set, but an earlier name in the release's order is set too;
# "not_read": set, but this release never reads that name; "unset": not in the environment.
VariableStatus = Literal["read", "shadowed", "not_read", "unset"]


@dataclass(frozen=True)
class EnvVariable:
    """One settings variable as a release sees it.

    Attributes:
        name: the variable's name.
        value: its value, or None when unset.
        status: see ``VariableStatus``.
        deprecated: this release prints "<name> is deprecated, use PYTORCH_ALLOC_CONF instead"
            when it reads it (CFG-2.9, PR #167659).
    """

    name: str
    value: str | None
    status: VariableStatus
    deprecated: bool = False


@dataclass(frozen=True)
class EnvSettings:
    """What one PyTorch release makes of an environment's allocator settings.

    Attributes:
        torch_version: the release modelled, as ``"2.9"``.
        variables: every name of ``ALLOC_CONF_VARIABLES``, those the release reads first, in
            its order (§9.1), then the ones it never reads.
        read_from: the variable that is parsed, or None when none is set.
        text: the string parsed ("" when nothing is set).
        backend: the ``backend`` the string names ("native" when it names none).
        config: the native allocator's settings, or None when the string is rejected.
        error: PyTorch's objection to the string (raised at the first CUDA allocation), or None.
        caching_disabled_by: the ``PYTORCH_NO_*_MEMORY_CACHING`` variable that is set, or None.
    """

    torch_version: str
    variables: tuple[EnvVariable, ...]
    read_from: str | None
    text: str
    backend: str
    config: AllocatorConfig | None
    error: str | None
    caching_disabled_by: str | None

    def variable(self, name: str) -> EnvVariable:
        """The record of one variable by name."""
        for var in self.variables:
            if var.name == name:
                return var
        raise KeyError(name)


def scan_backend(text: str) -> str:
    """The ``backend`` a settings string names, as the load-time scan finds it; "native" if none.

    Mirrors the static initializer that picks the allocator before any parsing (MAIN26
    ``BackendStaticInitializer``): it looks for a ``backend:<name>`` pair and ignores the rest.
    """
    for item in text.split(","):
        key, sep, value = item.partition(":")
        if sep and key.strip() == "backend":
            return value.strip()
    return "native"


def settings_from_environ(
    environ: Mapping[str, str], torch_version: str | None = None
) -> EnvSettings:
    """Which variable ``torch_version`` reads from ``environ``, and what it parses (§9.1).

    Args:
        environ: the environment (``os.environ`` or a dict).
        torch_version: the release to mirror, e.g. ``"2.9.1"``; None = the newest released.

    Returns:
        The record; a string PyTorch would reject gives ``config=None`` and its ``error``.

    Raises:
        ConfigError: the version string cannot be read.
    """
    b = behaviour_for(torch_version)
    read_from = b.variable_read(environ)
    variables: list[EnvVariable] = []
    for name in b.env_vars + tuple(n for n in ALLOC_CONF_VARIABLES if n not in b.env_vars):
        value = environ.get(name)
        status: VariableStatus
        if value is None:
            status = "unset"
        elif name not in b.env_vars:
            status = "not_read"
        else:
            status = "read" if name == read_from else "shadowed"
        variables.append(EnvVariable(name, value, status, name in b.deprecated_env_vars))
    text = "" if read_from is None else environ[read_from]
    backend = scan_backend(text)
    config: AllocatorConfig | None = None
    error: str | None = None
    if backend == "native":
        try:
            config = AllocatorConfig.parse(text, torch_version=torch_version)
        except ConfigError as exc:
            error = str(exc)
    caching_off = next((n for n in NO_CACHING_VARIABLES if environ.get(n) is not None), None)
    return EnvSettings(
        torch_version=b.version_text,
        variables=tuple(variables),
        read_from=read_from,
        text=text,
        backend=backend,
        config=config,
        error=error,
        caching_disabled_by=caching_off,
    )

"""Names a package exports on first use (PEP 562): the one ``__getattr__``/``__dir__`` pair.

``oomkit``, ``oomkit.diagnose`` and ``oomkit.interfaces.reports`` import their API lazily, so a
command imports only the modules it uses (issue 19 item 4: start-up).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    namespace: dict[str, Any], table: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The package's module ``__getattr__`` and ``__dir__``.

    Args:
        namespace: the package's ``globals()``; a name is stored there once imported, so later
            lookups never reach ``__getattr__`` again.
        table: exported name -> the module that defines it.
    """
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(table))

    return __getattr__, __dir__

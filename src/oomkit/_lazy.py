"""What is made on first use: a package's exported names, and regular expressions.

``lazy_exports`` is the one PEP 562 ``__getattr__``/``__dir__`` pair; ``LazyPattern`` a compiled
pattern's stand-in that compiles when first matched.

``oomkit``, ``oomkit.diagnose`` and ``oomkit.interfaces.reports`` import their API lazily, so a
command imports only the modules it uses (issue 19 item 4: start-up); a module whose patterns
only some of its callers match compiles them when first matched (issue 41 item 4).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterator, Mapping
from importlib import import_module
from types import ModuleType
from typing import Any

__all__ = ["LazyPattern", "lazy_exports"]


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
    shadowed = frozenset(name for name, module in table.items() if module == f"{package}.{name}")
    if shadowed:
        _exports_over_submodules(package, shadowed)

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


def _exports_over_submodules(package: str, names: frozenset[str]) -> None:
    """Keep an exported name bound to its object when a submodule of the same name is imported.

    Importing ``package.name`` for the first time binds the package's attribute ``name`` to
    that submodule (importlib._bootstrap ``_find_and_load_unlocked``: ``setattr(parent_module,
    child, module)``, after the submodule ran). A package that imported its exports eagerly
    rebound the name right after; a lazy one would keep the submodule, and ``from
    oomkit.runtime import resilient`` would give the module ``resilient``, not the function,
    once anything had imported ``oomkit.runtime.resilient``. The package's module object gets a
    class whose ``__setattr__`` stores the submodule's export of that name instead.
    """
    module = sys.modules[package]

    def __setattr__(self: ModuleType, name: str, value: Any) -> None:
        if name in names and isinstance(value, ModuleType) and value.__name__ == f"{package}.{name}":
            value = getattr(value, name)
        ModuleType.__setattr__(self, name, value)

    module.__class__ = type(f"{package}:module", (ModuleType,), {"__setattr__": __setattr__})


class LazyPattern:
    """A regular expression compiled when it is first matched, with ``re.Pattern``'s methods.

    ``re.compile`` costs 0.1-0.5 ms a pattern; at module level every command that imports the
    module pays it, also the ones that never match (``oomkit explain SNAPSHOT`` imports the
    OOM-text records, not their parser). Compiling is idempotent, so two threads racing on the
    first match at worst compile twice.
    """

    __slots__ = ("_compiled", "flags", "pattern")

    def __init__(self, pattern: str, flags: int = 0) -> None:
        self.pattern = pattern
        self.flags = flags
        self._compiled: re.Pattern[str] | None = None

    @property
    def compiled(self) -> re.Pattern[str]:
        """The compiled pattern (compiled on the first call)."""
        compiled = self._compiled
        if compiled is None:
            compiled = self._compiled = re.compile(self.pattern, self.flags)
        return compiled

    def match(self, string: str, pos: int = 0, endpos: int = sys.maxsize) -> re.Match[str] | None:
        return self.compiled.match(string, pos, endpos)

    def search(self, string: str, pos: int = 0, endpos: int = sys.maxsize) -> re.Match[str] | None:
        return self.compiled.search(string, pos, endpos)

    def finditer(
        self, string: str, pos: int = 0, endpos: int = sys.maxsize
    ) -> Iterator[re.Match[str]]:
        return self.compiled.finditer(string, pos, endpos)

    def sub(self, repl: str | Callable[[re.Match[str]], str], string: str, count: int = 0) -> str:
        return self.compiled.sub(repl, string, count)

    def __repr__(self) -> str:
        return f"LazyPattern({self.pattern!r}, {self.flags!r})"

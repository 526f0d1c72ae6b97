"""The ``lexArgs`` / ``consumeToken`` settings parser of torch <= 2.8 (CUDAAllocatorConfig, CFG-2.8).

One pass over the tokens; every separator is checked; only ``' '`` is dropped by the lexer; option
values go through ``std::stoi`` (ref/cuda-caching-allocator.md §9.2).
"""

from __future__ import annotations

from oomkit.core.allocator._c_numbers import stoi
from oomkit.core.allocator._config_parser import ConfigParser

__all__ = ["LegacyParser"]


class LegacyParser(ConfigParser):
    """CUDAAllocatorConfig::parseArgs before the ConfigTokenizer (torch <= 2.8)."""

    # §9.2: before CFG-2.9 the lexer dropped only spaces.
    whitespace = frozenset(" ")

    def _passes(self) -> None:
        """CUDAAllocatorConfig::parseArgs / CFG-2.8: one pass, separators checked."""
        tokens = self.tokens
        i = 0
        while i < len(tokens):
            key = tokens[i]
            handler = self.handlers.get(key)
            if handler is None:
                raise self._unknown(key)
            if key != "backend":
                # parseArgs: every option but backend counts as native-specific.
                self.used_native_option = True
            i = handler(i)
            if i + 1 < len(tokens):
                i += 1
                self._expect(i, ",")
            i += 1

    def _expect(self, i: int, sep: str) -> None:
        """lexArgs consumeToken: the separator must be there."""
        if i >= len(self.tokens) or self.tokens[i] != sep:
            got = "the end" if i >= len(self.tokens) else repr(self.tokens[i])
            key = self.tokens[i - 1] if 0 < i <= len(self.tokens) else "max_split_size_mb"
            raise self._error(
                f"expected '{sep}' after {key!r} but found {got}", "max_split_size_mb"
            )

    def _signed_int(self, token: str) -> int:
        # §9.2: before CFG-2.9 integers go through stoi (then the cast to size_t).
        return stoi(token)

"""The ``ConfigTokenizer`` settings parsers of torch >= 2.9 (Accelerator then CUDA pass, CFG-2.9+).

Separator tokens are not checked (``checkToken``'s result is ignored), every ``std::isspace``
character is dropped, values go through ``std::stoull``, and the common keys are read in a pass
before the CUDA-specific ones (ref/cuda-caching-allocator.md §9.2).
"""

from __future__ import annotations

from oomkit.core.allocator._c_numbers import stoull
from oomkit.core.allocator._config_parser import ConfigParser

__all__ = ["TokenizerParser"]

# Keys AcceleratorAllocatorConfig parses (CFG-2.9 / CFG-main); the rest are CUDAAllocatorConfig's.
_ACCELERATOR_KEYS = frozenset(
    {
        "large_segment_size_mb",
        "max_split_size_mb",
        "max_non_split_rounding_mb",
        "garbage_collection_threshold",
        "roundup_power2_divisions",
        "expandable_segments",
        "pinned_use_background_threads",
        "pinned_max_round_threshold_mb",
        "pinned_max_cached_size_mb",
    }
)


class TokenizerParser(ConfigParser):
    """AcceleratorAllocatorConfig::parseArgs then CUDAAllocatorConfig::parseArgs (torch >= 2.9)."""

    # ConfigTokenizer drops std::isspace characters (C locale); lexArgs dropped only ' ' (§9.2).
    whitespace = frozenset(" \t\n\v\f\r")

    def _passes(self) -> None:
        """AcceleratorAllocatorConfig::parseArgs then CUDAAllocatorConfig::parseArgs."""
        tokens = self.tokens
        n = len(tokens)
        if self.b.configurable_large_segment_size:
            # CFG-main: large_segment_size_mb is read first, wherever it is, and
            # max_non_split_rounding goes back to it on every parse.
            for i in range(n):
                if tokens[i] == "large_segment_size_mb":
                    self._large_segment_size(i)
            self.values["max_non_split_rounding_bytes"] = None
        accelerator = _ACCELERATOR_KEYS & self.b.config_keys
        for device_pass in (False, True):
            i = 0
            while i < n:
                key = tokens[i]
                if key == "large_segment_size_mb" and key in self.handlers:
                    i = self._skip_key(i)  # read in the first pass above
                elif key in self.handlers and (key in accelerator) != device_pass:
                    if device_pass and key != "backend":
                        # CUDAAllocatorConfig::parseArgs: only its own keys count here.
                        self.used_native_option = True
                    i = self.handlers[key](i)
                elif key in self.b.config_keys:
                    i = self._skip_key(i)
                elif device_pass or self.b.configurable_large_segment_size:
                    # CFG-main rejects in the Accelerator pass, CFG-2.9 in the CUDA pass.
                    raise self._unknown(key)
                else:
                    i = self._skip_key(i)
                if i + 1 < n:
                    i += 1  # ConfigTokenizer::checkToken(",") result is ignored
                i += 1

    def _expect(self, i: int, sep: str) -> None:
        """ConfigTokenizer::checkToken: its result is ignored, so nothing is checked."""

    def _signed_int(self, token: str) -> int:
        # §9.2: CFG-2.9 and later read integers with stoull.
        return stoull(token)

    def _skip_key(self, i: int) -> int:
        """ConfigTokenizer::skipKey: step over a value or a whole [ ... ] list."""
        j, value = self._value(i)
        if value != "[":
            return j
        while j + 1 < len(self.tokens):
            j += 1
            if self.tokens[j] == "]":
                return j
        raise self._error(f"the list after {self.tokens[i]!r} has no closing ']'", self.tokens[i])

"""What PyTorch's two settings parsers share: the tokens, the option readers and the messages.

``LegacyParser`` (``_legacy_parser``, torch <= 2.8) and ``TokenizerParser`` (``_tokenizer_parser``,
torch >= 2.9) subclass :class:`ConfigParser` and supply the passes over the tokens, the separator
check and the integer conversion (ref/cuda-caching-allocator.md §9.2).
"""

from __future__ import annotations

import dataclasses
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

from oomkit.core.allocator._c_numbers import NumberError, stod, stoull
from oomkit.core.allocator._config_limits import (
    DEFAULT_DIVISIONS,
    LARGE_BUFFER_MB,
    LAST_SLOT,
    MAX_MB,
    MIB,
    MIN_LARGE_SEGMENT_MB,
    PINNED_MAX_REGISTER_THREADS,
    is_pow2,
)
from oomkit.core.allocator.constants import ROUNDUP_POWER2_INTERVALS
from oomkit.core.allocator.versions import TorchBehaviour, config_key_since
from oomkit.errors import ConfigError

if TYPE_CHECKING:
    # config.py imports the parsers; the parsers build its record from the base they are given.
    from oomkit.core.allocator.config import AllocatorConfig

__all__ = ["ASYNC_REFUSED", "BOOL_FIELDS", "EXAMPLES", "ConfigParser"]

# backend:cudaMallocAsync hands allocation to the CUDA driver's stream-ordered pool
# (c10/cuda/CUDAMallocAsyncAllocator.cpp, cudaMallocAsync / cudaMemPool*): none of the native
# allocator's blocks, splits, rounding or caching applies, so simulating it as native would give
# a wrong answer. Refused wherever a setting is read for a simulation.
ASYNC_REFUSED = (
    "allocator setting {text!r} selects backend:cudaMallocAsync, which oomkit does not "
    "simulate: oomkit models PyTorch's native caching allocator only, and cudaMallocAsync "
    "leaves caching to the CUDA driver's memory pool (CUDAMallocAsyncAllocator.cpp), so its "
    "peaks and out-of-memory points differ. Remove backend:cudaMallocAsync (or write "
    "backend:native) to see what the native allocator would do; measure cudaMallocAsync on a "
    "GPU with `oomkit experiment`."
)

# lexArgs / ConfigTokenizer: these characters are tokens of their own (§9.2).
_SEPARATORS = frozenset(",:[]")

# A correct setting for each key, shown in error messages.
EXAMPLES = {
    "max_split_size_mb": "max_split_size_mb:128",
    "max_non_split_rounding_mb": "max_split_size_mb:128,max_non_split_rounding_mb:64",
    "large_segment_size_mb": "large_segment_size_mb:32",
    "garbage_collection_threshold": "garbage_collection_threshold:0.6",
    "roundup_power2_divisions": "roundup_power2_divisions:[256:1,512:2,>:8]",
    "backend": "backend:native",
    "per_process_memory_fraction": "per_process_memory_fraction:0.8",
    "pinned_num_register_threads": "pinned_num_register_threads:8",
    "pinned_reserve_segment_size_mb": "pinned_reserve_segment_size_mb:64",
    "pinned_max_round_threshold_mb": "pinned_max_round_threshold_mb:64",
    "pinned_max_cached_size_mb": "pinned_max_cached_size_mb:1024",
}

# Boolean keys -> the field they set (hip spellings are accepted like PyTorch does).
BOOL_FIELDS = {
    "expandable_segments": "expandable_segments",
    "release_lock_on_cudamalloc": "release_lock_on_cudamalloc",
    "release_lock_on_hipmalloc": "release_lock_on_cudamalloc",
    "pinned_use_cuda_host_register": "pinned_use_cuda_host_register",
    "pinned_use_hip_host_register": "pinned_use_cuda_host_register",
    "pinned_use_background_threads": "pinned_use_background_threads",
    "graph_capture_record_stream_reuse": "graph_capture_record_stream_reuse",
    "pinned_free_catch_all": "pinned_free_catch_all",
    "throw_on_cudamalloc_oom": "throw_on_cudamalloc_oom",
}


class ConfigParser(ABC):
    """One run of a PyTorch settings parser over a string, starting from ``base``."""

    # The characters the lexer drops inside and between tokens.
    whitespace: frozenset[str]

    def __init__(
        self,
        text: str,
        behaviour: TorchBehaviour,
        base: AllocatorConfig,
        env_var: str,
        *,
        runtime: bool = False,
        native_only: bool = True,
    ) -> None:
        if not isinstance(text, str):
            raise ConfigError(
                f"allocator settings must be a string; got {text!r}. "
                f"Example: {env_var}=max_split_size_mb:128"
            )
        self.text = text
        self.b = behaviour
        self.env_var = env_var
        self.runtime = runtime
        self.native_only = native_only
        self.base = base
        self.tokens = self._tokenize(text)
        self.values: dict[str, object] = {
            f.name: getattr(base, f.name) for f in dataclasses.fields(base)
        }
        # parseArgs: these options go back to their defaults on every parse (§9.1).
        self.values["max_split_size_bytes"] = None
        self.values["roundup_power2_divisions"] = DEFAULT_DIVISIONS
        self.values["garbage_collection_threshold"] = 0.0
        self.used_async = False
        self.used_native_option = False
        handlers: dict[str, Callable[[int], int]] = {
            "max_split_size_mb": self._max_split_size,
            "max_non_split_rounding_mb": self._max_non_split_rounding,
            "large_segment_size_mb": self._large_segment_size,
            "garbage_collection_threshold": self._gc_threshold,
            "roundup_power2_divisions": self._roundup,
            "backend": self._backend,
            "per_process_memory_fraction": self._fraction,
            "pinned_num_register_threads": self._register_threads,
            "pinned_reserve_segment_size_mb": self._pinned_reserve,
            "pinned_max_round_threshold_mb": self._pinned_capped,
            "pinned_max_cached_size_mb": self._pinned_capped,
        }
        for key in BOOL_FIELDS:
            handlers[key] = self._bool
        self.handlers = {k: h for k, h in handlers.items() if k in behaviour.config_keys}

    # -------------------------------------------------------------- what the parsers differ in

    @abstractmethod
    def _passes(self) -> None:
        """Walk the tokens, calling the handler of each key (parseArgs)."""

    @abstractmethod
    def _expect(self, i: int, sep: str) -> None:
        """The separator ``sep`` should be token ``i`` (checked only by the legacy parser)."""

    @abstractmethod
    def _signed_int(self, token: str) -> int:
        """The integer conversion the parser applies to option values."""

    # -------------------------------------------------------------- driver

    def run(self) -> AllocatorConfig:
        """The config the settings string gives, or ConfigError where PyTorch rejects it."""
        self._passes()
        if self.used_async and self.used_native_option:
            # parseArgs: TORCH_WARN when cudaMallocAsync meets native-only options.
            warnings.warn(
                "backend:cudaMallocAsync ignores max_split_size_mb, roundup_power2_divisions, "
                "and garbage_collect_threshold (PyTorch's warning); oomkit models only "
                "backend:native.",
                UserWarning,
                stacklevel=3,
            )
        try:
            return dataclasses.replace(self.base, **self.values)  # type: ignore[arg-type]
        except ConfigError as exc:
            # Reachable only when runtime_update mixes versions (e.g. a MAIN26 large segment
            # size with an older release's max_split_size minimum).
            raise self._error(str(exc), "max_split_size_mb") from exc

    def _tokenize(self, text: str) -> list[str]:
        """lexArgs / ConfigTokenizer: split at , : [ ] and drop whitespace (§9.2)."""
        drop = self.whitespace
        tokens: list[str] = []
        buf: list[str] = []
        for ch in text:
            if ch in _SEPARATORS:
                if buf:
                    tokens.append("".join(buf))
                    buf.clear()
                tokens.append(ch)
            elif ch not in drop:
                buf.append(ch)
        if buf:
            tokens.append("".join(buf))
        return tokens

    # -------------------------------------------------------------- tokens

    def _error(self, problem: str, key: str, example: str | None = None) -> ConfigError:
        example = example or EXAMPLES.get(key) or f"{key}:True"
        return ConfigError(
            f"invalid allocator setting {self.text!r} (torch {self.b.version_text} rules): "
            f"{problem}{'' if problem.endswith(('.', '?')) else '.'} "
            f"Example: {self.env_var}={example}"
        )

    def _unknown(self, key: str) -> ConfigError:
        pytorch = self.b.unknown_key_message.format(key=key)
        hint = ""
        introduced = _introduced_later(key, self.b)
        if introduced:
            hint = f"; {key} needs {introduced}"
        else:
            import difflib  # only for a misspelt key (issue 41 item 4: start-up)

            close = difflib.get_close_matches(key, sorted(self.b.config_keys), n=1)
            if close:
                hint = f"; did you mean {close[0]}?"
        return self._error(f'unknown key, PyTorch says "{pytorch}"{hint}', "max_split_size_mb")

    def _value(self, i: int) -> tuple[int, str]:
        """The key at ``i`` is followed by ':' and a value; the index and text of the value."""
        key = self.tokens[i]
        self._expect(i + 1, ":")
        if i + 2 >= len(self.tokens):
            raise self._error(f"{key!r} has no value", key)
        return i + 2, self.tokens[i + 2]

    def _int(self, token: str, key: str, *, unsigned: bool = False) -> int:
        try:
            return stoull(token) if unsigned else self._signed_int(token)
        except NumberError as exc:
            raise self._error(f"{key} value {token!r} {exc}", key) from None

    def _float(self, token: str, key: str) -> float:
        try:
            return stod(token)
        except NumberError as exc:
            raise self._error(f"{key} value {token!r} {exc}", key) from None

    # -------------------------------------------------------------- options

    def _size_minimum_mb(self) -> int:
        if self.b.configurable_large_segment_size:
            return int(self.values["large_segment_size_bytes"]) // MIB  # type: ignore[call-overload]
        return LARGE_BUFFER_MB

    def _split_like(self, i: int, field: str) -> int:
        """parseMaxSplitSize / parseMaxNonSplitRoundingSize: a minimum, then a cap."""
        key = self.tokens[i]
        j, token = self._value(i)
        mb = self._int(token, key)
        minimum = self._size_minimum_mb()
        if self.b.max_split_size_min_inclusive:
            ok, rule = mb >= minimum, f">= {minimum}"
        else:
            ok, rule = mb > minimum, f"> {minimum}"
        if not ok:
            raise self._error(f"{key} must be {rule} (MB); got {mb}", key)
        self.values[field] = min(mb, MAX_MB) * MIB
        return j

    def _max_split_size(self, i: int) -> int:
        return self._split_like(i, "max_split_size_bytes")

    def _max_non_split_rounding(self, i: int) -> int:
        return self._split_like(i, "max_non_split_rounding_bytes")

    def _large_segment_size(self, i: int) -> int:
        key = self.tokens[i]
        j, token = self._value(i)
        mb = self._int(token, key)
        if mb <= MIN_LARGE_SEGMENT_MB:
            raise self._error(f"{key} must be > {MIN_LARGE_SEGMENT_MB} (MB); got {mb}", key)
        self.values["large_segment_size_bytes"] = min(mb, MAX_MB) * MIB
        return j

    def _gc_threshold(self, i: int) -> int:
        key = self.tokens[i]
        j, token = self._value(i)
        value = self._float(token, key)
        if not 0.0 < value < 1.0:
            raise self._error(f"{key} must be in (0.0, 1.0); got {token!r}", key)
        self.values["garbage_collection_threshold"] = value
        return j

    def _fraction(self, i: int) -> int:
        key = self.tokens[i]
        j, token = self._value(i)
        value = self._float(token, key)
        if not 0.0 <= value <= 1.0:
            raise self._error(f"{key} must be in [0.0, 1.0]; got {token!r}", key)
        self.values["per_process_memory_fraction"] = value
        return j

    def _bool(self, i: int) -> int:
        key = self.tokens[i]
        j, token = self._value(i)
        if token not in ("True", "False"):
            raise self._error(
                f"{key} must be exactly True or False; got {token!r}", key, f"{key}:True"
            )
        self.values[BOOL_FIELDS[key]] = token == "True"
        return j

    def _backend(self, i: int) -> int:
        key = self.tokens[i]
        j, token = self._value(i)
        if token not in ("native", "cudaMallocAsync"):
            raise self._error(
                f"unknown allocator backend {token!r}; options are native and cudaMallocAsync",
                key,
            )
        if self.runtime and token != self.base.backend:
            # parseAllocatorConfig: TORCH_INTERNAL_ASSERT runtime backend == load-time backend.
            raise self._error(
                f"backend cannot change at runtime (loaded with {self.base.backend}, got "
                f"{token}); set it in {self.env_var} before the process starts",
                key,
            )
        if token == "cudaMallocAsync" and self.native_only:
            raise ConfigError(ASYNC_REFUSED.format(text=self.text))
        self.used_async = token == "cudaMallocAsync"
        self.values["backend"] = token
        return j

    def _register_threads(self, i: int) -> int:
        key = self.tokens[i]
        j, token = self._value(i)
        value = self._int(token, key)
        if not is_pow2(value):
            raise self._error(f"{key} must be a power of two; got {value}", key)
        if value > PINNED_MAX_REGISTER_THREADS:
            raise self._error(f"{key} must be <= {PINNED_MAX_REGISTER_THREADS}; got {value}", key)
        self.values["pinned_num_register_threads"] = value
        return j

    def _pinned_reserve(self, i: int) -> int:
        key = self.tokens[i]
        j, token = self._value(i)
        value = self._int(token, key)
        if value <= 0:
            raise self._error(f"{key} must be > 0; got {value}", key)
        self.values["pinned_reserve_segment_size_bytes"] = value * MIB
        return j

    def _pinned_capped(self, i: int) -> int:
        key = self.tokens[i]
        j, token = self._value(i)
        value = min(self._int(token, key), MAX_MB) * MIB
        field = key.replace("_mb", "_bytes")
        self.values[field] = value
        return j

    def _roundup(self, i: int) -> int:
        """parseRoundUpPower2Divisions: ``N`` or ``[b:v,...,>:v]`` (§2.2, §9.3)."""
        key = self.tokens[i]
        j, token = self._value(i)
        if token != "[":
            value = self._int(token, key)
            if not is_pow2(value):
                raise self._error(f"{key} must be a power of two; got {value}", key, f"{key}:4")
            self.values["roundup_power2_divisions"] = (value,) * ROUNDUP_POWER2_INTERVALS
            return j
        if not self.b.roundup_bracket_form:
            raise self._error(f"the [..] form of {key} needs torch >= 2.0", key, f"{key}:4")
        tokens = self.tokens
        slots = list(DEFAULT_DIVISIONS)
        last_index = 0
        first = True
        while True:
            j += 1
            if j >= len(tokens):
                raise self._error(f"the list after {key!r} has no closing ']'", key)
            if tokens[j] == "]":
                break
            boundary_token = tokens[j]
            self._expect(j + 1, ":")
            j += 2
            if j >= len(tokens):
                raise self._error(f"{key} entry {boundary_token!r} has no value", key)
            value = self._int(tokens[j], key)
            if value != 0 and not is_pow2(value):
                raise self._error(
                    f"{key} divisions must be a power of two or 0; got {value} for "
                    f"{boundary_token!r}",
                    key,
                )
            if boundary_token == ">":
                # §9.3: >= 2.9 fills after the last listed slot; <= 2.8 from it (inclusive).
                start = last_index + 1 if self.b.roundup_fill_after_last else last_index
                for k in range(start, ROUNDUP_POWER2_INTERVALS):
                    slots[k] = value
            else:
                boundary = self._int(boundary_token, key, unsigned=True)
                if not is_pow2(boundary):
                    raise self._error(
                        f"{key} interval {boundary_token!r} must be a power of two (MB)", key
                    )
                index = min(boundary.bit_length() - 1, LAST_SLOT)
                if first:
                    # The first entry also fills every lower slot.
                    for k in range(index):
                        slots[k] = value
                    first = False
                slots[index] = value
                last_index = index
            if j + 1 >= len(tokens):
                raise self._error(f"the list after {key!r} has no closing ']'", key)
            if tokens[j + 1] != "]":
                j += 1
                self._expect(j, ",")
        self.values["roundup_power2_divisions"] = tuple(slots)
        return j


def _introduced_later(key: str, b: TorchBehaviour) -> str | None:
    """'torch >= X.Y' when a newer release accepts ``key``, else None."""
    since = config_key_since(key)
    if since is None or since <= b.version:
        return None
    return f"torch >= {since[0]}.{since[1]}"

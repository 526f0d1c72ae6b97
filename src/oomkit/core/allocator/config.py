"""``PYTORCH_CUDA_ALLOC_CONF`` as a frozen record, parsed exactly as PyTorch parses it.

``AllocatorConfig.parse`` mirrors the parsers of ref/cuda-caching-allocator.md §9: the
``lexArgs`` parser of ``CUDAAllocatorConfig`` / CFG-2.8 (torch <= 2.8) and the
``ConfigTokenizer`` parsers of ``AcceleratorAllocatorConfig`` + ``CUDAAllocatorConfig``
(CFG-2.9, CFG-main). Every string PyTorch rejects raises :class:`ConfigError`; a few strings
PyTorch accepts look odd (``512.7`` reads as 512; in >= 2.9 the separator tokens are not checked,
so ``max_split_size_mb,128`` reads as ``max_split_size_mb:128``) and are accepted the same way.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from oomkit.core.allocator.constants import MIN_LARGE_ALLOC, ROUNDUP_POWER2_INTERVALS, SIZE_MAX
from oomkit.core.allocator.versions import TorchBehaviour, behaviour_for, config_key_since
from oomkit.errors import ConfigError

__all__ = ["AllocatorConfig", "Backend"]

Backend = Literal["native", "cudaMallocAsync"]

_MiB = 1 << 20
# kLargeBuffer / kMB: the fixed large segment size, and the max_split minimum before MAIN26.
_LARGE_BUFFER_MB = 20
# CFG-main parseLargeSegmentSize: large_segment_size_mb must be > kMinLargeAlloc / kMB (10).
_MIN_LARGE_SEGMENT_MB = MIN_LARGE_ALLOC // _MiB
# parseMaxSplitSize and friends: values are capped at SIZE_MAX / kMB before scaling.
_MAX_MB = SIZE_MAX // _MiB
# CUDAAllocatorConfig::pinned_max_register_threads(): 128.
_PINNED_MAX_REGISTER_THREADS = 128
_DEFAULT_DIVISIONS = (0,) * ROUNDUP_POWER2_INTERVALS
_LAST_SLOT = ROUNDUP_POWER2_INTERVALS - 1
_SEPARATORS = frozenset(",:[]")
# ConfigTokenizer drops std::isspace characters (C locale); lexArgs dropped only ' ' (§9.2).
_C_SPACE = frozenset(" \t\n\v\f\r")
_ENV_VAR = "PYTORCH_CUDA_ALLOC_CONF"

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

# A correct setting for each key, shown in error messages.
_EXAMPLES = {
    "max_split_size_mb": "max_split_size_mb:128",
    "max_non_split_rounding_mb": "max_split_size_mb:128,max_non_split_rounding_mb:64",
    "large_segment_size_mb": "large_segment_size_mb:32",
    "garbage_collection_threshold": "garbage_collection_threshold:0.6",
    "roundup_power2_divisions": "roundup_power2_divisions:[256:1,512:2,>:8]",
    "backend": "backend:cudaMallocAsync",
    "per_process_memory_fraction": "per_process_memory_fraction:0.8",
    "pinned_num_register_threads": "pinned_num_register_threads:8",
    "pinned_reserve_segment_size_mb": "pinned_reserve_segment_size_mb:64",
    "pinned_max_round_threshold_mb": "pinned_max_round_threshold_mb:64",
    "pinned_max_cached_size_mb": "pinned_max_cached_size_mb:1024",
}

# Boolean keys -> the field they set (hip spellings are accepted like PyTorch does).
_BOOL_FIELDS = {
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


def _is_pow2(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


@dataclass(frozen=True, slots=True)
class AllocatorConfig:
    """The settings of PyTorch's native CUDA caching allocator (ref §9.3, §9.4).

    Sizes are bytes. ``None`` means "not set" where PyTorch's default is not a plain number.
    Build one with :meth:`parse` / :meth:`from_env`; direct construction is validated against
    the newest release's rules (``parse`` applies the rules of the version it is given).
    """

    # §6: None = unlimited (SIZE_MAX; memory_stats shows -1).
    max_split_size_bytes: int | None = None
    # §6 / PR #136174: None = the default, large_segment_size_bytes (fixed 20 MiB before MAIN26).
    max_non_split_rounding_bytes: int | None = None
    # §2.2: one value per slot [2^k MiB, 2^(k+1) MiB); 0 = no power-of-two rounding.
    roundup_power2_divisions: tuple[int, ...] = _DEFAULT_DIVISIONS
    # §7: 0.0 = off; otherwise in (0, 1).
    garbage_collection_threshold: float = 0.0
    # §8.
    expandable_segments: bool = False
    # §1 / PR #172056: segment size for 1-10 MiB requests (configurable only in MAIN26).
    large_segment_size_bytes: int = _LARGE_BUFFER_MB * _MiB
    # §9.3 (≈2.9+): applied when the device allocator is created; None = not set (1.0).
    per_process_memory_fraction: float | None = None
    # §9.3: no effect on decisions.
    release_lock_on_cudamalloc: bool = False
    backend: Backend = "native"
    # Accepted, recorded, not modelled (§9.3 / §9.4).
    graph_capture_record_stream_reuse: bool = False
    throw_on_cudamalloc_oom: bool = False
    pinned_use_cuda_host_register: bool = False
    pinned_num_register_threads: int = 1
    pinned_use_background_threads: bool = False
    pinned_reserve_segment_size_bytes: int | None = None
    pinned_max_round_threshold_bytes: int | None = None
    pinned_max_cached_size_bytes: int | None = None
    pinned_free_catch_all: bool = False

    def __post_init__(self) -> None:
        divisions = tuple(self.roundup_power2_divisions)
        object.__setattr__(self, "roundup_power2_divisions", divisions)
        object.__setattr__(
            self, "garbage_collection_threshold", float(self.garbage_collection_threshold)
        )
        if self.per_process_memory_fraction is not None:
            object.__setattr__(
                self, "per_process_memory_fraction", float(self.per_process_memory_fraction)
            )
        problem = self._problem()
        if problem is not None:
            raise ConfigError(f"invalid AllocatorConfig: {problem}")

    def _problem(self) -> str | None:
        """What makes this record unreachable from any valid settings string, or None."""
        lseg = self.large_segment_size_bytes
        if (
            not _is_mib_multiple(lseg)
            or lseg <= _MIN_LARGE_SEGMENT_MB * _MiB
            or lseg > _MAX_MB * _MiB
        ):
            return (
                f"large_segment_size_bytes must be a whole number of MiB above 10 MiB; got {lseg!r}"
                ". Example: large_segment_size_bytes=32 * 2**20"
            )
        for name in ("max_split_size_bytes", "max_non_split_rounding_bytes"):
            value = getattr(self, name)
            if value is not None and (
                not _is_mib_multiple(value) or value < lseg or value > _MAX_MB * _MiB
            ):
                return (
                    f"{name} must be None or a whole number of MiB >= large_segment_size_bytes "
                    f"({lseg}); got {value!r}. Example: {name}=128 * 2**20"
                )
        divisions = self.roundup_power2_divisions
        if len(divisions) != ROUNDUP_POWER2_INTERVALS or not all(
            type(d) is int and (d == 0 or _is_pow2(d)) and d <= SIZE_MAX for d in divisions
        ):
            return (
                "roundup_power2_divisions must be 16 ints, each 0 or a power of two; got "
                f"{divisions!r}. Example: roundup_power2_divisions=(4,) * 16"
            )
        gc = self.garbage_collection_threshold
        if not 0.0 <= gc < 1.0:
            return (
                f"garbage_collection_threshold must be 0.0 (off) or in (0, 1); got {gc!r}. "
                "Example: garbage_collection_threshold=0.6"
            )
        if 0.0 < abs(gc) < sys.float_info.min:
            return f"garbage_collection_threshold {gc!r} is subnormal; std::stod cannot read it"
        fraction = self.per_process_memory_fraction
        if fraction is not None and 0.0 < abs(fraction) < sys.float_info.min:
            return (
                f"per_process_memory_fraction {fraction!r} is subnormal; std::stod cannot read it"
            )
        if fraction is not None and not 0.0 <= fraction <= 1.0:
            return (
                f"per_process_memory_fraction must be None or in [0, 1]; got {fraction!r}. "
                "Example: per_process_memory_fraction=0.8"
            )
        if self.backend not in ("native", "cudaMallocAsync"):
            return f"backend must be 'native' or 'cudaMallocAsync'; got {self.backend!r}"
        threads = self.pinned_num_register_threads
        if type(threads) is not int or not _is_pow2(threads) or threads > 128:
            return f"pinned_num_register_threads must be a power of two <= 128; got {threads!r}"
        reserve = self.pinned_reserve_segment_size_bytes
        if reserve is not None and (not _is_mib_multiple(reserve) or reserve <= 0):
            return f"pinned_reserve_segment_size_bytes must be None or MiB > 0; got {reserve!r}"
        for name in ("pinned_max_round_threshold_bytes", "pinned_max_cached_size_bytes"):
            value = getattr(self, name)
            if value is not None and (not _is_mib_multiple(value) or value > _MAX_MB * _MiB):
                return f"{name} must be None or a whole number of MiB; got {value!r}"
        return None

    # ------------------------------------------------------------------ hot path

    def divisions_for(self, size_bytes: int) -> int:
        """The ``roundup_power2_divisions`` value for a size (§2.2).

        AcceleratorAllocatorConfig::roundup_power2_divisions: slot ``floor(log2(n)) - 20``
        clamped to ``[0, 15]``.

        Args:
            size_bytes: a request size in bytes.

        Returns:
            The division count of the slot (0 = no power-of-two rounding).
        """
        idx = size_bytes.bit_length() - 21
        if idx <= 0:
            return self.roundup_power2_divisions[0]
        if idx >= _LAST_SLOT:
            return self.roundup_power2_divisions[_LAST_SLOT]
        return self.roundup_power2_divisions[idx]

    @property
    def roundup_enabled(self) -> bool:
        """Whether any slot rounds (round_size only rounds with divisions > 1, §2.1)."""
        return max(self.roundup_power2_divisions) > 1

    @property
    def effective_max_non_split_rounding_bytes(self) -> int:
        """The oversize slack of §6 rule 2 in bytes: the setting, else large_segment_size.

        Versions without ``max_non_split_rounding_mb`` (< 2.6) always use 20 MiB; see
        ``TorchBehaviour.configurable_non_split_rounding``.
        """
        if self.max_non_split_rounding_bytes is not None:
            return self.max_non_split_rounding_bytes
        return self.large_segment_size_bytes

    # ------------------------------------------------------------------ text

    def __str__(self) -> str:
        """The canonical settings string; ``AllocatorConfig.parse(str(c)) == c``.

        Only non-default options appear, in a fixed order; the default config is ``""``.
        The roundup list is written so that both ``>`` fill rules (§9.3) read it the same.
        """
        parts: list[str] = []
        if self.backend != "native":
            parts.append(f"backend:{self.backend}")
        if self.large_segment_size_bytes != _LARGE_BUFFER_MB * _MiB:
            parts.append(f"large_segment_size_mb:{self.large_segment_size_bytes // _MiB}")
        if self.max_split_size_bytes is not None:
            parts.append(f"max_split_size_mb:{self.max_split_size_bytes // _MiB}")
        if self.max_non_split_rounding_bytes is not None:
            parts.append(f"max_non_split_rounding_mb:{self.max_non_split_rounding_bytes // _MiB}")
        divisions = _format_divisions(self.roundup_power2_divisions)
        if divisions:
            parts.append(f"roundup_power2_divisions:{divisions}")
        if self.garbage_collection_threshold != 0.0:
            parts.append(f"garbage_collection_threshold:{self.garbage_collection_threshold!r}")
        if self.per_process_memory_fraction is not None:
            parts.append(f"per_process_memory_fraction:{self.per_process_memory_fraction!r}")
        for key in (
            "expandable_segments",
            "release_lock_on_cudamalloc",
            "throw_on_cudamalloc_oom",
            "graph_capture_record_stream_reuse",
            "pinned_use_cuda_host_register",
            "pinned_use_background_threads",
            "pinned_free_catch_all",
        ):
            if getattr(self, key):
                parts.append(f"{key}:True")
        if self.pinned_num_register_threads != 1:
            parts.append(f"pinned_num_register_threads:{self.pinned_num_register_threads}")
        for key, value in (
            ("pinned_reserve_segment_size_mb", self.pinned_reserve_segment_size_bytes),
            ("pinned_max_round_threshold_mb", self.pinned_max_round_threshold_bytes),
            ("pinned_max_cached_size_mb", self.pinned_max_cached_size_bytes),
        ):
            if value is not None:
                parts.append(f"{key}:{value // _MiB}")
        return ",".join(parts)

    @classmethod
    def coerce(
        cls, value: str | AllocatorConfig | None, torch_version: str | None = None
    ) -> AllocatorConfig:
        """What a ``alloc_conf=`` argument means: ``None`` the defaults, a string parsed, a config as is.

        Raises:
            ConfigError: a string PyTorch would reject.
        """
        if value is None:
            return cls()
        if isinstance(value, AllocatorConfig):
            return value
        return cls.parse(value, torch_version=torch_version)

    @classmethod
    def parse(cls, text: str, torch_version: str | None = None) -> AllocatorConfig:
        """Read a ``PYTORCH_CUDA_ALLOC_CONF`` string the way a PyTorch release reads it.

        Args:
            text: e.g. ``"max_split_size_mb:128,expandable_segments:True"``; ``""`` = defaults.
            torch_version: the release whose parser to mirror; None = newest released.

        Returns:
            The configuration the allocator would run with.

        Raises:
            ConfigError: PyTorch would reject the string (the message says why, with an
                example), or the version string cannot be read.
        """
        return _Parser(text, behaviour_for(torch_version), cls(), _ENV_VAR).run()

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, torch_version: str | None = None
    ) -> AllocatorConfig:
        """The configuration a PyTorch release reads from the environment (§9.1).

        Only the first variable of ``TorchBehaviour.env_vars`` that is set is parsed (even if
        empty); the others are ignored, with a warning when they would have said something
        else. Releases that print a deprecation warning for the variable they read warn here.

        Args:
            environ: the environment; None = ``os.environ``.
            torch_version: the release to mirror; None = newest released.

        Returns:
            The configuration, or the default one when no variable is set.

        Raises:
            ConfigError: the variable that is read holds a setting PyTorch would reject.
        """
        env: Mapping[str, str] = os.environ if environ is None else environ
        b = behaviour_for(torch_version)
        known = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
        for name in b.env_vars:
            text = env.get(name)
            if text is None:
                continue
            for other in known:
                if other != name and env.get(other) not in (None, text):
                    warnings.warn(
                        f"{other} is ignored: torch {_v(b)} reads only the first of "
                        f"{', '.join(b.env_vars)} that is set, here {name}. Put every "
                        f"setting in {name}.",
                        UserWarning,
                        stacklevel=2,
                    )
            if name in b.deprecated_env_vars:
                # CFG-2.9 C10_ALLOCATOR_CONFIG_PARSE_ENV: TORCH_WARN_ONCE (PR #167659).
                warnings.warn(
                    f"torch {_v(b)} prints '{name} is deprecated, use PYTORCH_ALLOC_CONF instead'.",
                    UserWarning,
                    stacklevel=2,
                )
            config = _Parser(text, b, cls(), name).run()
            if (
                b.alloc_conf_ignores_expandable_segments
                and name == "PYTORCH_ALLOC_CONF"
                and config.expandable_segments
            ):
                # §9.1, issue #183387: torch 2.9 ignores expandable_segments given this way.
                warnings.warn(
                    f"torch {_v(b)} ignores expandable_segments set only through "
                    "PYTORCH_ALLOC_CONF (pytorch issue #183387); modelling it as off. Set "
                    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True instead.",
                    UserWarning,
                    stacklevel=2,
                )
                config = dataclasses.replace(config, expandable_segments=False)
            return config
        for name in known:
            if name in env:
                warnings.warn(
                    f"{name} is set but torch {_v(b)} does not read it (it reads "
                    f"{', '.join(b.env_vars)}); modelling the default settings.",
                    UserWarning,
                    stacklevel=2,
                )
        return cls()

    def runtime_update(self, text: str, torch_version: str | None = None) -> AllocatorConfig:
        """The config after ``torch.cuda.memory._set_allocator_settings(text)`` (§9.1, §13.21).

        ``max_split_size``, every roundup slot and the GC threshold go back to their defaults
        unless ``text`` sets them (in MAIN26 releases, ``max_non_split_rounding`` too); every
        other option keeps its value unless ``text`` sets it. ``backend`` cannot change.

        Args:
            text: the settings string passed to ``_set_allocator_settings``.
            torch_version: the release to mirror; None = newest released.

        Returns:
            The new configuration.

        Raises:
            ConfigError: PyTorch would reject the string, or it names another backend.
        """
        return _Parser(text, behaviour_for(torch_version), self, _ENV_VAR, runtime=True).run()


def _is_mib_multiple(value: object) -> bool:
    return type(value) is int and value >= 0 and value % _MiB == 0


def _v(b: TorchBehaviour) -> str:
    return f"{b.version[0]}.{b.version[1]}"


def _format_divisions(slots: tuple[int, ...]) -> str:
    """The roundup value that re-creates ``slots``; "" for all zeros.

    The first entry fills every lower slot; the entries after it set one slot each, up to the
    first slot of the trailing run, so ``>`` gives the same result whether it fills from the
    last listed slot (<= 2.8) or after it (>= 2.9).
    """
    first = slots[0]
    if all(s == first for s in slots):
        return "" if first == 0 else str(first)
    lead_end = 0
    while slots[lead_end + 1] == first:
        lead_end += 1
    last = slots[_LAST_SLOT]
    tail_start = _LAST_SLOT
    while slots[tail_start - 1] == last:
        tail_start -= 1
    entries = [f"{1 << lead_end}:{first}"]
    entries += [f"{1 << k}:{slots[k]}" for k in range(lead_end + 1, tail_start + 1)]
    if tail_start < _LAST_SLOT:
        entries.append(f">:{last}")
    return "[" + ",".join(entries) + "]"


# ---------------------------------------------------------------------- numbers (C++ rules)

_INT_RE = re.compile(r"[ \t\n\v\f\r]*([+-]?)(\d+)")
_HEX_FLOAT_RE = re.compile(
    r"[ \t\n\v\f\r]*([+-]?0[xX](?:[0-9a-fA-F]+\.?[0-9a-fA-F]*|\.[0-9a-fA-F]+)(?:[pP][+-]?\d+)?)"
)
_DEC_FLOAT_RE = re.compile(r"[ \t\n\v\f\r]*([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)")
_SPECIAL_FLOAT_RE = re.compile(
    r"[ \t\n\v\f\r]*([+-]?)(inf(?:inity)?|nan(?:\([0-9A-Za-z_]*\))?)", re.IGNORECASE
)


class _NumberError(Exception):
    """std::invalid_argument / std::out_of_range from stoi, stoull or stod."""


def _stoi(token: str) -> int:
    """std::stoi then the cast to size_t PyTorch applies (negative values wrap)."""
    match = _INT_RE.match(token)
    if match is None:
        raise _NumberError("is not an integer")
    value = int(match[2]) * (-1 if match[1] == "-" else 1)
    if not -(2**31) <= value < 2**31:
        raise _NumberError("is out of the range of a C int (stoi)")
    return value % 2**64


def _stoull(token: str) -> int:
    """std::stoull / stoul: a leading '-' negates modulo 2^64, like strtoull."""
    match = _INT_RE.match(token)
    if match is None:
        raise _NumberError("is not an integer")
    magnitude = int(match[2])
    if magnitude > SIZE_MAX:
        raise _NumberError("is out of the range of a 64-bit unsigned integer (stoull)")
    return (-magnitude if match[1] == "-" else magnitude) % 2**64


def _stod(token: str) -> float:
    """std::stod: the longest floating-point prefix; overflow and underflow are errors."""
    special = _SPECIAL_FLOAT_RE.match(token)
    if special is not None:
        sign = -1.0 if special[1] == "-" else 1.0
        return sign * (math.inf if special[2].lower().startswith("inf") else math.nan)
    hex_match = _HEX_FLOAT_RE.match(token)
    if hex_match is not None:
        text = hex_match[1]
        if not re.search(r"[pP]", text):
            text += "p0"
        value = float.fromhex(text)
        mantissa = text.split("x", 1)[-1].split("X", 1)[-1].split("p")[0].split("P")[0]
    else:
        dec_match = _DEC_FLOAT_RE.match(token)
        if dec_match is None:
            raise _NumberError("is not a number")
        value = float(dec_match[1])
        mantissa = re.split(r"[eE]", dec_match[1])[0]
    if math.isinf(value):
        raise _NumberError("is out of the range of a double (stod)")
    if abs(value) < sys.float_info.min and any(c not in "0.+-" for c in mantissa):
        raise _NumberError("is too small for a double (stod underflow)")
    return value


# ---------------------------------------------------------------------- the parser


class _Parser:
    """One run of PyTorch's settings parser(s) over a string, starting from ``base``."""

    def __init__(
        self,
        text: str,
        behaviour: TorchBehaviour,
        base: AllocatorConfig,
        env_var: str,
        *,
        runtime: bool = False,
    ) -> None:
        if not isinstance(text, str):
            raise ConfigError(
                f"allocator settings must be a string; got {text!r}. "
                f"Example: {env_var}=max_split_size_mb:128"
            )
        self.text = text
        self.b = behaviour
        self.legacy = behaviour.config_parser == "legacy"
        self.env_var = env_var
        self.runtime = runtime
        self.base = base
        self.tokens = self._tokenize(text)
        self.values: dict[str, object] = {
            f.name: getattr(base, f.name) for f in dataclasses.fields(AllocatorConfig)
        }
        # parseArgs: these options go back to their defaults on every parse (§9.1).
        self.values["max_split_size_bytes"] = None
        self.values["roundup_power2_divisions"] = _DEFAULT_DIVISIONS
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
        for key in _BOOL_FIELDS:
            handlers[key] = self._bool
        self.handlers = {k: h for k, h in handlers.items() if k in behaviour.config_keys}

    # -------------------------------------------------------------- driver

    def run(self) -> AllocatorConfig:
        if self.legacy:
            self._run_legacy()
        else:
            self._run_tokenizer()
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
            return AllocatorConfig(**self.values)  # type: ignore[arg-type]
        except ConfigError as exc:
            # Reachable only when runtime_update mixes versions (e.g. a MAIN26 large segment
            # size with an older release's max_split_size minimum).
            raise self._error(str(exc), "max_split_size_mb") from exc

    def _tokenize(self, text: str) -> list[str]:
        """lexArgs / ConfigTokenizer: split at , : [ ] and drop whitespace (§9.2)."""
        drop = frozenset(" ") if self.legacy else _C_SPACE
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

    def _run_legacy(self) -> None:
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
                self._separator(i, ",")
            i += 1

    def _run_tokenizer(self) -> None:
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

    # -------------------------------------------------------------- tokens

    def _error(self, problem: str, key: str, example: str | None = None) -> ConfigError:
        example = example or _EXAMPLES.get(key) or f"{key}:True"
        return ConfigError(
            f"invalid allocator setting {self.text!r} (torch {_v(self.b)} rules): {problem}"
            f"{'' if problem.endswith(('.', '?')) else '.'} Example: {self.env_var}={example}"
        )

    def _unknown(self, key: str) -> ConfigError:
        pytorch = self.b.unknown_key_message.format(key=key)
        hint = ""
        introduced = _introduced_later(key, self.b)
        if introduced:
            hint = f"; {key} needs {introduced}"
        else:
            close = difflib.get_close_matches(key, sorted(self.b.config_keys), n=1)
            if close:
                hint = f"; did you mean {close[0]}?"
        return self._error(f'unknown key, PyTorch says "{pytorch}"{hint}', "max_split_size_mb")

    def _separator(self, i: int, sep: str) -> None:
        """lexArgs consumeToken: the separator must be there (legacy parser only)."""
        if i >= len(self.tokens) or self.tokens[i] != sep:
            got = "the end" if i >= len(self.tokens) else repr(self.tokens[i])
            key = self.tokens[i - 1] if 0 < i <= len(self.tokens) else "max_split_size_mb"
            raise self._error(
                f"expected '{sep}' after {key!r} but found {got}", "max_split_size_mb"
            )

    def _value(self, i: int) -> tuple[int, str]:
        """The key at ``i`` is followed by ':' (checked only by the legacy parser) and a value."""
        key = self.tokens[i]
        if self.legacy:
            self._separator(i + 1, ":")
        if i + 2 >= len(self.tokens):
            raise self._error(f"{key!r} has no value", key)
        return i + 2, self.tokens[i + 2]

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

    def _int(self, token: str, key: str, *, unsigned: bool = False) -> int:
        try:
            if self.legacy and not unsigned:
                return _stoi(token)
            return _stoull(token)
        except _NumberError as exc:
            raise self._error(f"{key} value {token!r} {exc}", key) from None

    def _float(self, token: str, key: str) -> float:
        try:
            return _stod(token)
        except _NumberError as exc:
            raise self._error(f"{key} value {token!r} {exc}", key) from None

    # -------------------------------------------------------------- options

    def _size_minimum_mb(self) -> int:
        if self.b.configurable_large_segment_size:
            return int(self.values["large_segment_size_bytes"]) // _MiB  # type: ignore[call-overload]
        return _LARGE_BUFFER_MB

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
        self.values[field] = min(mb, _MAX_MB) * _MiB
        return j

    def _max_split_size(self, i: int) -> int:
        return self._split_like(i, "max_split_size_bytes")

    def _max_non_split_rounding(self, i: int) -> int:
        return self._split_like(i, "max_non_split_rounding_bytes")

    def _large_segment_size(self, i: int) -> int:
        key = self.tokens[i]
        j, token = self._value(i)
        mb = self._int(token, key)
        if mb <= _MIN_LARGE_SEGMENT_MB:
            raise self._error(f"{key} must be > {_MIN_LARGE_SEGMENT_MB} (MB); got {mb}", key)
        self.values["large_segment_size_bytes"] = min(mb, _MAX_MB) * _MiB
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
        self.values[_BOOL_FIELDS[key]] = token == "True"
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
        self.used_async = token == "cudaMallocAsync"
        self.values["backend"] = token
        return j

    def _register_threads(self, i: int) -> int:
        key = self.tokens[i]
        j, token = self._value(i)
        value = self._int(token, key)
        if not _is_pow2(value):
            raise self._error(f"{key} must be a power of two; got {value}", key)
        if value > _PINNED_MAX_REGISTER_THREADS:
            raise self._error(f"{key} must be <= {_PINNED_MAX_REGISTER_THREADS}; got {value}", key)
        self.values["pinned_num_register_threads"] = value
        return j

    def _pinned_reserve(self, i: int) -> int:
        key = self.tokens[i]
        j, token = self._value(i)
        value = self._int(token, key)
        if value <= 0:
            raise self._error(f"{key} must be > 0; got {value}", key)
        self.values["pinned_reserve_segment_size_bytes"] = value * _MiB
        return j

    def _pinned_capped(self, i: int) -> int:
        key = self.tokens[i]
        j, token = self._value(i)
        value = min(self._int(token, key), _MAX_MB) * _MiB
        field = key.replace("_mb", "_bytes")
        self.values[field] = value
        return j

    def _roundup(self, i: int) -> int:
        """parseRoundUpPower2Divisions: ``N`` or ``[b:v,...,>:v]`` (§2.2, §9.3)."""
        key = self.tokens[i]
        j, token = self._value(i)
        if token != "[":
            value = self._int(token, key)
            if not _is_pow2(value):
                raise self._error(f"{key} must be a power of two; got {value}", key, f"{key}:4")
            self.values["roundup_power2_divisions"] = (value,) * ROUNDUP_POWER2_INTERVALS
            return j
        if not self.b.roundup_bracket_form:
            raise self._error(f"the [..] form of {key} needs torch >= 2.0", key, f"{key}:4")
        tokens = self.tokens
        slots = list(_DEFAULT_DIVISIONS)
        last_index = 0
        first = True
        while True:
            j += 1
            if j >= len(tokens):
                raise self._error(f"the list after {key!r} has no closing ']'", key)
            if tokens[j] == "]":
                break
            boundary_token = tokens[j]
            if self.legacy:
                self._separator(j + 1, ":")
            j += 2
            if j >= len(tokens):
                raise self._error(f"{key} entry {boundary_token!r} has no value", key)
            value = self._int(tokens[j], key)
            if value != 0 and not _is_pow2(value):
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
                if not _is_pow2(boundary):
                    raise self._error(
                        f"{key} interval {boundary_token!r} must be a power of two (MB)", key
                    )
                index = min(boundary.bit_length() - 1, _LAST_SLOT)
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
                if self.legacy:
                    self._separator(j, ",")
        self.values["roundup_power2_divisions"] = tuple(slots)
        return j


def _introduced_later(key: str, b: TorchBehaviour) -> str | None:
    """'torch >= X.Y' when a newer release accepts ``key``, else None."""
    since = config_key_since(key)
    if since is None or since <= b.version:
        return None
    return f"torch >= {since[0]}.{since[1]}"

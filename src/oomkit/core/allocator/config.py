"""``PYTORCH_CUDA_ALLOC_CONF`` as a frozen record, parsed exactly as PyTorch parses it.

``AllocatorConfig.parse`` mirrors the parsers of ref/cuda-caching-allocator.md §9: the
``lexArgs`` parser of ``CUDAAllocatorConfig`` / CFG-2.8 (torch <= 2.8, ``_legacy_parser``) and the
``ConfigTokenizer`` parsers of ``AcceleratorAllocatorConfig`` + ``CUDAAllocatorConfig``
(CFG-2.9, CFG-main; ``_tokenizer_parser``). Every string PyTorch rejects raises
:class:`ConfigError`; a few strings PyTorch accepts look odd (``512.7`` reads as 512; in >= 2.9 the
separator tokens are not checked, so ``max_split_size_mb,128`` reads as ``max_split_size_mb:128``)
and are accepted the same way.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from oomkit.core.allocator._config_limits import (
    DEFAULT_DIVISIONS,
    LARGE_BUFFER_MB,
    LAST_SLOT,
    MAX_MB,
    MIB,
    MIN_LARGE_SEGMENT_MB,
    is_mib_multiple,
    is_pow2,
)
from oomkit.core.allocator._config_parser import ConfigParser
from oomkit.core.allocator._legacy_parser import LegacyParser
from oomkit.core.allocator._tokenizer_parser import TokenizerParser
from oomkit.core.allocator.constants import ROUNDUP_POWER2_INTERVALS, SIZE_MAX
from oomkit.core.allocator.versions import ALLOC_CONF_VARIABLES, ConfigParserKind, behaviour_for
from oomkit.errors import ConfigError

__all__ = ["AllocatorConfig", "Backend"]

Backend = Literal["native", "cudaMallocAsync"]

_ENV_VAR = "PYTORCH_CUDA_ALLOC_CONF"
# §9.2: the parser each TorchBehaviour.config_parser names.
_PARSERS: dict[ConfigParserKind, type[ConfigParser]] = {
    "legacy": LegacyParser,
    "tokenizer": TokenizerParser,
}


@dataclass(frozen=True, slots=True)
class AllocatorConfig:
    """The settings of PyTorch's native CUDA caching allocator (c10/core/AllocatorConfig.cpp parseArgs).

    Sizes are bytes. ``None`` means "not set" where PyTorch's default is not a plain number.
    Build one with :meth:`parse` / :meth:`from_env`; direct construction is validated against
    the newest release's rules (``parse`` applies the rules of the version it is given).
    """

    # §6: None = unlimited (SIZE_MAX; memory_stats shows -1).
    max_split_size_bytes: int | None = None
    # §6 / PR #136174: None = the default, large_segment_size_bytes (fixed 20 MiB before MAIN26).
    max_non_split_rounding_bytes: int | None = None
    # §2.2: one value per slot [2^k MiB, 2^(k+1) MiB); 0 = no power-of-two rounding.
    roundup_power2_divisions: tuple[int, ...] = DEFAULT_DIVISIONS
    # §7: 0.0 = off; otherwise in (0, 1).
    garbage_collection_threshold: float = 0.0
    # §8.
    expandable_segments: bool = False
    # §1 / PR #172056: segment size for 1-10 MiB requests (configurable only in MAIN26).
    large_segment_size_bytes: int = LARGE_BUFFER_MB * MIB
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
        if not is_mib_multiple(lseg) or lseg <= MIN_LARGE_SEGMENT_MB * MIB or lseg > MAX_MB * MIB:
            return (
                f"large_segment_size_bytes must be a whole number of MiB above 10 MiB; got {lseg!r}"
                ". Example: large_segment_size_bytes=32 * 2**20"
            )
        for name in ("max_split_size_bytes", "max_non_split_rounding_bytes"):
            value = getattr(self, name)
            if value is not None and (
                not is_mib_multiple(value) or value < lseg or value > MAX_MB * MIB
            ):
                return (
                    f"{name} must be None or a whole number of MiB >= large_segment_size_bytes "
                    f"({lseg}); got {value!r}. Example: {name}=128 * 2**20"
                )
        divisions = self.roundup_power2_divisions
        if len(divisions) != ROUNDUP_POWER2_INTERVALS or not all(
            type(d) is int and (d == 0 or is_pow2(d)) and d <= SIZE_MAX for d in divisions
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
        if type(threads) is not int or not is_pow2(threads) or threads > 128:
            return f"pinned_num_register_threads must be a power of two <= 128; got {threads!r}"
        reserve = self.pinned_reserve_segment_size_bytes
        if reserve is not None and (not is_mib_multiple(reserve) or reserve <= 0):
            return f"pinned_reserve_segment_size_bytes must be None or MiB > 0; got {reserve!r}"
        for name in ("pinned_max_round_threshold_bytes", "pinned_max_cached_size_bytes"):
            value = getattr(self, name)
            if value is not None and (not is_mib_multiple(value) or value > MAX_MB * MIB):
                return f"{name} must be None or a whole number of MiB; got {value!r}"
        return None

    # ------------------------------------------------------------------ hot path

    def divisions_for(self, size_bytes: int) -> int:
        """The ``roundup_power2_divisions`` value for a size (CUDACachingAllocator.cpp roundup_power2_divisions).

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
        if idx >= LAST_SLOT:
            return self.roundup_power2_divisions[LAST_SLOT]
        return self.roundup_power2_divisions[idx]

    @property
    def roundup_enabled(self) -> bool:
        """Whether any slot rounds (round_size only rounds with divisions > 1: CUDACachingAllocator.cpp round_size)."""
        return max(self.roundup_power2_divisions) > 1

    @property
    def effective_max_non_split_rounding_bytes(self) -> int:
        """The oversize slack (CUDACachingAllocator.cpp get_free_block's max_non_split_rounding) in bytes: the setting, else large_segment_size.

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
        The roundup list is written so that both ``>`` fill rules (AllocatorConfig.cpp parseRoundUpPower2Divisions) read it the same.
        """
        parts: list[str] = []
        if self.backend != "native":
            parts.append(f"backend:{self.backend}")
        if self.large_segment_size_bytes != LARGE_BUFFER_MB * MIB:
            parts.append(f"large_segment_size_mb:{self.large_segment_size_bytes // MIB}")
        if self.max_split_size_bytes is not None:
            parts.append(f"max_split_size_mb:{self.max_split_size_bytes // MIB}")
        if self.max_non_split_rounding_bytes is not None:
            parts.append(f"max_non_split_rounding_mb:{self.max_non_split_rounding_bytes // MIB}")
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
                parts.append(f"{key}:{value // MIB}")
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
    def parse(
        cls, text: str, torch_version: str | None = None, *, native_only: bool = True
    ) -> AllocatorConfig:
        """Read a ``PYTORCH_CUDA_ALLOC_CONF`` string the way a PyTorch release reads it.

        Args:
            text: e.g. ``"max_split_size_mb:128,expandable_segments:True"``; ``""`` = defaults.
            torch_version: the release whose parser to mirror; None = newest released.
            native_only: refuse ``backend:cudaMallocAsync``, which oomkit cannot simulate (the
                default: every setting read for a simulation). ``False`` accepts what PyTorch
                accepts, to check a setting a real process will run (``oomkit experiment``).

        Returns:
            The configuration the allocator would run with.

        Raises:
            ConfigError: PyTorch would reject the string (the message says why, with an
                example), the version string cannot be read, or the string selects
                ``backend:cudaMallocAsync`` with ``native_only``.
        """
        b = behaviour_for(torch_version)
        return _PARSERS[b.config_parser](text, b, cls(), _ENV_VAR, native_only=native_only).run()

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, torch_version: str | None = None
    ) -> AllocatorConfig:
        """The configuration a PyTorch release reads from the environment (c10/core/AllocatorConfig.cpp: PYTORCH_CUDA_ALLOC_CONF and its siblings).

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
        name = b.variable_read(env)
        if name is None:
            for unread in ALLOC_CONF_VARIABLES:
                if unread in env:
                    warnings.warn(
                        f"{unread} is set but torch {b.version_text} does not read it (it reads "
                        f"{', '.join(b.env_vars)}); modelling the default settings.",
                        UserWarning,
                        stacklevel=2,
                    )
            return cls()
        text = env[name]
        for other in ALLOC_CONF_VARIABLES:
            if other != name and env.get(other) not in (None, text):
                warnings.warn(
                    f"{other} is ignored: torch {b.version_text} reads only the first of "
                    f"{', '.join(b.env_vars)} that is set, here {name}. Put every "
                    f"setting in {name}.",
                    UserWarning,
                    stacklevel=2,
                )
        if name in b.deprecated_env_vars:
            # CFG-2.9 C10_ALLOCATOR_CONFIG_PARSE_ENV: TORCH_WARN_ONCE (PR #167659).
            warnings.warn(
                f"torch {b.version_text} prints '{name} is deprecated, use PYTORCH_ALLOC_CONF instead'.",
                UserWarning,
                stacklevel=2,
            )
        config = _PARSERS[b.config_parser](text, b, cls(), name).run()
        if b.drops_expandable_segments(name, config.expandable_segments):
            # §9.1, issue #183387: torch 2.9 ignores expandable_segments given this way.
            warnings.warn(
                f"torch {b.version_text} ignores expandable_segments set only through "
                "PYTORCH_ALLOC_CONF (pytorch issue #183387); modelling it as off. Set "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True instead.",
                UserWarning,
                stacklevel=2,
            )
            config = dataclasses.replace(config, expandable_segments=False)
        return config

    def runtime_update(self, text: str, torch_version: str | None = None) -> AllocatorConfig:
        """The config after ``torch.cuda.memory._set_allocator_settings(text)`` (torch/cuda/memory.py, AllocatorConfig.cpp parseArgs).

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
        b = behaviour_for(torch_version)
        return _PARSERS[b.config_parser](text, b, self, _ENV_VAR, runtime=True).run()


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
    last = slots[LAST_SLOT]
    tail_start = LAST_SLOT
    while slots[tail_start - 1] == last:
        tail_start -= 1
    entries = [f"{1 << lead_end}:{first}"]
    entries += [f"{1 << k}:{slots[k]}" for k in range(lead_end + 1, tail_start + 1)]
    if tail_start < LAST_SLOT:
        entries.append(f">:{last}")
    return "[" + ",".join(entries) + "]"

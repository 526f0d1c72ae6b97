"""What differs between PyTorch releases, as one frozen record per ``major.minor``.

``behaviour_for("2.4.0+cu121")`` answers every version question the allocator, its config
parser and the OOM message need, so no other module compares version numbers. It is the only
per-release record: the simulator, the config parser and the OOM message all read it. The facts come
from ref/cuda-caching-allocator.md (§0 sources, §3.6, §6, §7, §9, §12, Appendix A); release
numbers the ref marks "≈" are inferred from PR dates, not read from tags.

Assumption (not verifiable from the stored sources): the 2026 ``main`` changes seen in MAIN26
(the creation-order tie-break, PR #183591, May 2026; ``large_segment_size_mb``, PR #172056,
Jan 2026; the per-process fraction rules of §7/§9.5; the MAIN26 env-var order of §9.1) are in
every release >= 2.12, and in none before. 2.14 is the newest release modelled.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from oomkit.errors import ConfigError

__all__ = [
    "ALLOC_CONF_VARIABLES",
    "NEWEST_RELEASED_TORCH",
    "OLDEST_MODELLED_TORCH",
    "ConfigParserKind",
    "OomMessageVariant",
    "TorchBehaviour",
    "alloc_conf_variables",
    "behaviour_for",
    "config_key_since",
    "parse_torch_version",
    "require_modelled",
]

# §9.1: every name some release reads the device allocator's settings from.
ALLOC_CONF_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")


def alloc_conf_variables(environ: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """``ALLOC_CONF_VARIABLES`` as set in ``environ`` now (``None``: ``os.environ``)."""
    env: Mapping[str, str] = os.environ if environ is None else environ
    return {name: env.get(name) for name in ALLOC_CONF_VARIABLES}


# torch 2.14.1 is the newest release known to oomkit; ``None`` means this version.
NEWEST_RELEASED_TORCH = "2.14"
# The oldest release modelled: Appendix A's version history starts with 1.10's
# max_split_size_mb (PR #44742); the ref has no source for the allocator before it.
OLDEST_MODELLED_TORCH = "1.10"
# What "main" / "nightly" build: one minor past the newest release (same behaviour).
_MAIN_VERSION = (2, 15)
# First release assumed to carry the 2026 main (MAIN26) changes; see the module docstring.
_MAIN26 = (2, 12)

OomMessageVariant = Literal["classic", "v2_1", "v2_2"]
# "legacy": the lexArgs/consumeToken parser (<= 2.8): separators are checked, only spaces are
# dropped, integers go through stoi. "tokenizer": ConfigTokenizer (CFG-2.9 and later): separator
# tokens are not checked (checkToken's result is ignored), all whitespace is dropped, integers
# go through stoull, common keys are parsed in a pass before the CUDA-specific ones (§9.2).
ConfigParserKind = Literal["legacy", "tokenizer"]

# §12.3: the documentation link at the end of the >= 2.2 OOM message.
_OLD_DOCS_URL = "https://pytorch.org/docs/stable/notes/cuda.html#environment-variables"
_NEW_DOCS_URL = (
    "https://docs.pytorch.org/docs/stable/notes/cuda.html"
    "#optimizing-memory-usage-with-pytorch-cuda-alloc-conf"
)

# Config keys by the release that first accepts them (ref §9.3, §9.4, Appendix A).
_KEYS_SINCE: dict[str, tuple[int, int]] = {
    # Appendix A: PR #44742 (≈1.10).
    "max_split_size_mb": (1, 10),
    # Appendix A: PR #74213 / #73673 (1.12).
    "roundup_power2_divisions": (1, 12),
    "garbage_collection_threshold": (1, 12),
    # Appendix A: backend:cudaMallocAsync (≈1.13 / 2.0).
    "backend": (2, 0),
    # Appendix A: expandable_segments (2.1); release_lock / pinned-register options (≈2.1-2.2).
    "expandable_segments": (2, 1),
    "release_lock_on_cudamalloc": (2, 1),
    "release_lock_on_hipmalloc": (2, 1),
    "pinned_use_cuda_host_register": (2, 1),
    "pinned_use_hip_host_register": (2, 1),
    "pinned_num_register_threads": (2, 1),
    # Not dated by the ref; present in CFG-2.8. Assumed ≈2.5.
    "pinned_use_background_threads": (2, 5),
    # §9.3 / Appendix A: PR #136174 (Sep 2024, ≈2.6).
    "max_non_split_rounding_mb": (2, 6),
    # §9.3 / Appendix A: ≈2.9+ (PR #149601 onward); pinned_reserve_segment_size_mb is in CUDA-CFG.
    "per_process_memory_fraction": (2, 9),
    "graph_capture_record_stream_reuse": (2, 9),
    "pinned_reserve_segment_size_mb": (2, 9),
    # §9.3 / §9.4: MAIN26 only (large_segment_size_mb is PR #172056, Jan 2026).
    "large_segment_size_mb": _MAIN26,
    "throw_on_cudamalloc_oom": _MAIN26,
    "pinned_free_catch_all": _MAIN26,
    "pinned_max_round_threshold_mb": _MAIN26,
    "pinned_max_cached_size_mb": _MAIN26,
}


@dataclass(frozen=True, slots=True)
class TorchBehaviour:
    """The allocator-relevant behaviour of one PyTorch ``major.minor`` release.

    Every field is a plain value so hot paths can read it without further version logic.
    """

    # (major, minor) the behaviour models; "main"/"nightly" is one past NEWEST_RELEASED_TORCH.
    version: tuple[int, int]
    # §3.6: equal-size free blocks ordered by segment creation counter (PR #183591, MAIN26);
    # False: the lowest device address wins.
    tie_break_by_creation_order: bool
    # §6 / PR #136174 (≈2.6): max_non_split_rounding_mb exists; else the slack is fixed 20 MiB.
    configurable_non_split_rounding: bool
    # §1 / PR #172056 (MAIN26): large_segment_size_mb exists; else kLargeBuffer (20 MiB).
    configurable_large_segment_size: bool
    # §9.3 / §13.23: max_split_size_mb (and max_non_split_rounding_mb) must be >= the large
    # segment size (CFG-2.8 and later); before, > 20.
    max_split_size_min_inclusive: bool
    # §9.1: the env vars PyTorch tries, in order; only the first one set is parsed.
    env_vars: tuple[str, ...]
    # §9.1 (CFG-2.9, PR #167659): reading these prints "is deprecated, use PYTORCH_ALLOC_CONF".
    deprecated_env_vars: tuple[str, ...]
    # §9.1, issue #183387: in 2.9.1 expandable_segments given only through PYTORCH_ALLOC_CONF
    # was silently ignored for CUDA.
    alloc_conf_ignores_expandable_segments: bool
    # §9.2: which parser reads the string (see ConfigParserKind).
    config_parser: ConfigParserKind
    # §9.2: unknown keys are always an error; this is the wording PyTorch uses.
    unknown_key_message: str
    # §9.3: every key this release accepts.
    config_keys: frozenset[str]
    # §9.3 / Appendix A (≈2.0): roundup_power2_divisions accepts the [b:v,...,>:v] form.
    roundup_bracket_form: bool
    # §9.3 / §13.22: `>:v` fills the slots after the last listed one (CFG-2.9 and later);
    # False (<= 2.8): from the last listed slot inclusive, overwriting it.
    roundup_fill_after_last: bool
    # §9.1 "Runtime changes": _set_allocator_settings also resets max_non_split_rounding to
    # large_segment_size (MAIN26 only; it came with PR #172056's parseArgs).
    runtime_resets_non_split_rounding: bool
    # §7 / §9.5: a fraction limit exists only for fraction < 1, allowed = round(f * total)
    # (MAIN26); False: any set_per_process_memory_fraction call sets trunc(f * total) (V24).
    fraction_limit_only_below_one: bool
    # §7 / PR #134338 (Aug 2024, ≈2.5): GC and OOM step 8 skip expandable blocks.
    gc_skips_expandable: bool
    # §12.3: OOM message wording: "classic" (<= 2.0), "v2_1" ("capacty" typo), "v2_2".
    oom_message_variant: OomMessageVariant
    # §12.3: documentation link in the OOM message (docs.pytorch.org in MAIN26; real 2.8+ OOM
    # logs show it too).
    oom_docs_url: str
    # §3.5: MAIN26 get_pool searches open allocation scopes newest first (allocation_scopes_,
    # reversed); V24 get_pool walks captures_underway oldest first.
    pool_scopes_newest_first: bool
    # §4 step 9 / §5.3: MAIN26 skips release_cached_blocks only in a real capture
    # (is_capture_context); V24 skips Step 9 whenever any scope is open, and its emptyCache
    # fails an internal assert ("captures_underway.empty()").
    release_skips_only_real_capture: bool
    # §3.5 / Appendix A (≈2.8-2.9): MemPool(use_on_oom=True) and try_mempool_fallback (Step 7).
    mempool_use_on_oom: bool
    # §3.5 / §4 step 11 (MAIN26): MemPool(no_split=True), should_split's no_split_pools.
    mempool_no_split: bool
    # §4 step 6.3 / §12.4 (MAIN26): throw_on_cudamalloc_oom's preemptive rejection.
    oom_rejection: bool
    # MAIN26 emptyCache(mempool_id): release one freeable private pool.
    empty_cache_per_pool: bool

    @property
    def version_text(self) -> str:
        """``"major.minor"``, as messages name the release (``"2.4"``)."""
        return f"{self.version[0]}.{self.version[1]}"

    def variable_read(self, environ: Mapping[str, str]) -> str | None:
        """§9.1: the one variable this release parses, the first of ``env_vars`` that is set
        (even to ""); the others are never merged in. None when none is set."""
        return next((name for name in self.env_vars if environ.get(name) is not None), None)

    def drops_expandable_segments(self, variable: str | None, expandable: bool) -> bool:
        """§9.1, pytorch/pytorch#183387: whether this release runs without expandable segments
        although the string read from ``variable`` asks for them (2.9.1 ignores the setting
        when it comes only through ``PYTORCH_ALLOC_CONF``)."""
        return (
            self.alloc_conf_ignores_expandable_segments
            and variable == "PYTORCH_ALLOC_CONF"
            and expandable
        )

    @property
    def has_alloc_conf_env(self) -> bool:
        """§9.1: whether this release reads ``PYTORCH_ALLOC_CONF`` at all (≈2.9+)."""
        return "PYTORCH_ALLOC_CONF" in self.env_vars

    @property
    def has_per_process_memory_fraction_key(self) -> bool:
        """§9.3: whether ``per_process_memory_fraction`` is a config key (≈2.9+)."""
        return "per_process_memory_fraction" in self.config_keys


_VERSION_RE = re.compile(
    r"^v?(?P<major>\d+)\.(?P<minor>\d+)"
    r"(?:\.(?P<patch>\d+))?"
    # pre/dev/local suffixes: 2.6.0a0+git123, 2.4.0+cu121, 2.5.0rc1, 2.6.0.dev20240101
    r"(?:(?:a|b|rc|alpha|beta|\.?dev|\.post)\d*)*"
    r"(?:\+[0-9A-Za-z.\-_]+)?$"
)
_NEWEST_ALIASES = frozenset({"main", "master", "nightly"})


def parse_torch_version(torch_version: str | None) -> tuple[int, int]:
    """The ``(major, minor)`` a version string names.

    Args:
        torch_version: ``"2.4"``, ``"2.4.1"``, ``"2.4.0+cu121"``, ``"2.6.0a0+git123"``,
            ``"main"`` / ``"nightly"`` (newest behaviour), or None (newest release).

    Returns:
        ``(major, minor)``.

    Raises:
        ConfigError: the text is not a PyTorch version.
    """
    if torch_version is None:
        return _split(NEWEST_RELEASED_TORCH)
    if not isinstance(torch_version, str):
        raise ConfigError(
            f"torch_version must be a string like '2.4.1'; got {torch_version!r}. "
            "Example: torch_version=torch.__version__"
        )
    text = torch_version.strip()
    if text.lower() in _NEWEST_ALIASES:
        return _MAIN_VERSION
    match = _VERSION_RE.match(text)
    if match is None:
        raise ConfigError(
            f"cannot read PyTorch version {torch_version!r}; expected 'major.minor[.patch]' with "
            "an optional suffix, or 'main'/'nightly'. Example: torch_version='2.4.0+cu121'"
        )
    return int(match["major"]), int(match["minor"])


def require_modelled(torch_version: str) -> None:
    """Refuse a target release newer than the development branch oomkit models (``"99.0"``
    would otherwise be modelled as main, its CUDA called that release's default wheel's), or
    older than the oldest it models (``OLDEST_MODELLED_TORCH``: ``"1.0"`` would otherwise get
    1.10's rules and a CUDA its wheel never had).

    Raises:
        ConfigError: the version cannot be read, is past main, or is before 1.10.
    """
    version = parse_torch_version(torch_version)
    if version < _split(OLDEST_MODELLED_TORCH):
        raise ConfigError(
            f"torch {torch_version} is older than any PyTorch oomkit models: its allocator rules "
            f"are modelled from {OLDEST_MODELLED_TORCH} on (the first release with "
            "max_split_size_mb, where the reference's version history starts); give "
            f"{OLDEST_MODELLED_TORCH} or later, e.g. --torch-version {NEWEST_RELEASED_TORCH}"
        )
    if version > _MAIN_VERSION:
        raise ConfigError(
            f"torch {torch_version} is newer than any PyTorch oomkit models (releases up to "
            f"{NEWEST_RELEASED_TORCH}, and main / nightly, {_MAIN_VERSION[0]}.{_MAIN_VERSION[1]}); "
            f"give one of them, e.g. --torch-version {NEWEST_RELEASED_TORCH}"
        )


def config_key_since(key: str) -> tuple[int, int] | None:
    """The first ``(major, minor)`` that accepts a config key (§9.3), or None if none does."""
    return _KEYS_SINCE.get(key)


def _split(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


def behaviour_for(torch_version: str | None) -> TorchBehaviour:
    """The allocator behaviour of a PyTorch release.

    Args:
        torch_version: any string ``parse_torch_version`` accepts; None = NEWEST_RELEASED_TORCH.

    Returns:
        The behaviour of that release's ``major.minor``.

    Raises:
        ConfigError: the version string cannot be read.
    """
    return _behaviour(parse_torch_version(torch_version))


@functools.lru_cache(maxsize=64)
def _behaviour(version: tuple[int, int]) -> TorchBehaviour:
    main26 = version >= _MAIN26
    tokenizer = version >= (2, 9)  # §9.2: ConfigTokenizer from CFG-2.9
    if main26:
        # §9.1 CFG-main: legacy names first again, no deprecation warning.
        env_vars: tuple[str, ...] = (
            "PYTORCH_CUDA_ALLOC_CONF",
            "PYTORCH_HIP_ALLOC_CONF",
            "PYTORCH_ALLOC_CONF",
        )
        deprecated: tuple[str, ...] = ()
    elif tokenizer:
        # §9.1 CFG-2.9 (PR #167659): the unified name first; the device names warn.
        env_vars = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
        deprecated = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
    else:
        # §9.1 <= 2.8: only PYTORCH_CUDA_ALLOC_CONF on CUDA builds (HIP name only on ROCm).
        env_vars = ("PYTORCH_CUDA_ALLOC_CONF",)
        deprecated = ()
    if main26:
        # §9.2 CFG-main: the Accelerator pass rejects unknown keys first.
        unknown = "Unrecognized key '{key}' in Accelerator allocator config."
    elif tokenizer:
        # §9.2 CFG-2.9: the Accelerator pass skips them; the CUDA pass rejects them.
        unknown = "Unrecognized key '{key}' in CUDA allocator config."
    else:
        unknown = "Unrecognized CachingAllocator option: {key}"
    if version <= (2, 0):
        variant: OomMessageVariant = "classic"
    elif version == (2, 1):
        variant = "v2_1"
    else:
        variant = "v2_2"
    return TorchBehaviour(
        version=version,
        tie_break_by_creation_order=main26,
        configurable_non_split_rounding=version >= _KEYS_SINCE["max_non_split_rounding_mb"],
        configurable_large_segment_size=main26,
        # CFG-2.8 parseMaxSplitSize: "must be >= 20"; older CUDAAllocatorConfig: "must be > 20".
        max_split_size_min_inclusive=version >= (2, 8),
        env_vars=env_vars,
        deprecated_env_vars=deprecated,
        alloc_conf_ignores_expandable_segments=version == (2, 9),
        config_parser="tokenizer" if tokenizer else "legacy",
        unknown_key_message=unknown,
        config_keys=frozenset(k for k, since in _KEYS_SINCE.items() if version >= since),
        # Appendix A: bracket form with backend:cudaMallocAsync (≈1.13 / 2.0; 2.0 assumed).
        roundup_bracket_form=version >= (2, 0),
        # §9.3: "≤ 2.8: from the last listed slot inclusive" (CFG-2.8 vs CFG-2.9).
        roundup_fill_after_last=tokenizer,
        runtime_resets_non_split_rounding=main26,
        fraction_limit_only_below_one=main26,
        gc_skips_expandable=version >= (2, 5),
        oom_message_variant=variant,
        oom_docs_url=_NEW_DOCS_URL if version >= (2, 8) else _OLD_DOCS_URL,
        pool_scopes_newest_first=main26,
        release_skips_only_real_capture=main26,
        mempool_use_on_oom=version >= (2, 8),
        mempool_no_split=main26,
        oom_rejection=main26,
        empty_cache_per_pool=main26,
    )

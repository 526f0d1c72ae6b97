"""The version-dependent allocator rules, read off a :class:`TorchBehaviour`.

``oomkit.core.allocator.versions`` describes a PyTorch release; this module picks the fields the
simulator's decisions depend on, so the hot path reads plain booleans. Fields that a
``TorchBehaviour`` may not carry are derived from its ``version`` as ref §12 / Appendix A say.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from oomkit.core.allocator.versions import TorchBehaviour, behaviour_for

__all__ = ["AllocatorRules", "OomMessageVariant", "rules_for"]

OomMessageVariant = Literal["classic", "v2_1", "v2_2"]

# §12.3: the documentation link at the end of the >= 2.2 OOM message.
_OLD_DOCS_URL = "https://pytorch.org/docs/stable/notes/cuda.html#environment-variables"
_NEW_DOCS_URL = (
    "https://docs.pytorch.org/docs/stable/notes/cuda.html"
    "#optimizing-memory-usage-with-pytorch-cuda-alloc-conf"
)


@dataclass(frozen=True, slots=True)
class AllocatorRules:
    """What differs between PyTorch versions in the decisions the simulator makes."""

    version: tuple[int, int]
    # §3.6: equal-size free blocks are ordered by segment creation counter (2026+) or address.
    tie_break_by_creation_order: bool
    # §6 / PR #136174: max_non_split_rounding_mb exists; else rule 2 uses kLargeBuffer.
    configurable_non_split_rounding: bool
    # PR #172056: large_segment_size_mb exists; else kLargeBuffer is the 1-10 MiB segment size.
    configurable_large_segment_size: bool
    # §7 / §9.5: MAIN26 sets a limit only for fraction < 1 (round); V24 always (truncate).
    fraction_limit_only_below_one: bool
    # §12.3: the OOM message wording.
    oom_message_variant: OomMessageVariant
    oom_docs_url: str
    # §3.5: MAIN26 get_pool searches open allocation scopes newest first (allocation_scopes_,
    # reversed); V24 get_pool walks captures_underway oldest first.
    pool_scopes_newest_first: bool = False
    # §4 step 9 / §5.3: MAIN26 skips release_cached_blocks only in a real capture
    # (is_capture_context); V24 skips Step 9 whenever any scope is open, and its emptyCache
    # fails an internal assert ("captures_underway.empty()").
    release_skips_only_real_capture: bool = False
    # §3.5 / Appendix A (≈2.8-2.9): MemPool(use_on_oom=True) and try_mempool_fallback (Step 7).
    mempool_use_on_oom: bool = False
    # §3.5 / §4 step 11 (MAIN26): MemPool(no_split=True), should_split's no_split_pools.
    mempool_no_split: bool = False
    # §4 step 6.3 / §12.4 (MAIN26): throw_on_cudamalloc_oom's preemptive rejection.
    oom_rejection: bool = False
    # MAIN26 emptyCache(mempool_id): release one freeable private pool.
    empty_cache_per_pool: bool = False


def _field(behaviour: TorchBehaviour, name: str, default: object) -> object:
    # Optional TorchBehaviour fields (CONTRACTS.md "... more fields as the ref requires").
    return getattr(behaviour, name, default)


def rules_for(torch_version: str | None) -> AllocatorRules:
    """The allocator rules of a PyTorch version (``None`` = newest released).

    Raises:
        ConfigError: from ``behaviour_for`` when the version is not understood.
    """
    b = behaviour_for(torch_version)
    version = tuple(b.version)[:2]
    main26 = bool(b.tie_break_by_creation_order)
    if version <= (2, 0):
        default_variant: OomMessageVariant = "classic"
    elif version == (2, 1):
        default_variant = "v2_1"
    else:
        default_variant = "v2_2"
    variant = _field(b, "oom_message_variant", default_variant)
    if variant not in ("classic", "v2_1", "v2_2"):
        variant = default_variant
    # The docs.pytorch.org link is what MAIN26 prints (§12.3); real 2.8+ OOM logs show it too.
    new_url = main26 or version >= (2, 8)
    url = _field(b, "oom_docs_url", _NEW_DOCS_URL if new_url else _OLD_DOCS_URL)
    return AllocatorRules(
        version=(int(version[0]), int(version[1])),
        tie_break_by_creation_order=main26,
        configurable_non_split_rounding=bool(b.configurable_non_split_rounding),
        configurable_large_segment_size=bool(b.configurable_large_segment_size),
        fraction_limit_only_below_one=bool(_field(b, "fraction_limit_only_below_one", main26)),
        oom_message_variant=variant,
        oom_docs_url=str(url),
        pool_scopes_newest_first=bool(_field(b, "pool_scopes_newest_first", main26)),
        release_skips_only_real_capture=bool(_field(b, "release_skips_only_real_capture", main26)),
        mempool_use_on_oom=bool(_field(b, "mempool_use_on_oom", version >= (2, 8))),
        mempool_no_split=bool(_field(b, "mempool_no_split", main26)),
        oom_rejection=bool(_field(b, "oom_rejection", main26)),
        empty_cache_per_pool=bool(_field(b, "empty_cache_per_pool", main26)),
    )

"""Runtime settings of the simulated allocator (ref §6, §7, §9.1 "Runtime changes", §9.5).

Turns an :class:`~oomkit.core.allocator.config.AllocatorConfig` and the torch version's rules into
the plain values malloc and free read, and models ``set_per_process_memory_fraction`` and
``_set_allocator_settings``. A mixin of
:class:`~oomkit.core.allocator.caching_allocator.CachingAllocator`.
"""

from __future__ import annotations

import math

from oomkit.core.allocator.config import AllocatorConfig
from oomkit.core.allocator.constants import LARGE_BUFFER, SIZE_MAX
from oomkit.core.allocator.rules import AllocatorRules
from oomkit.errors import AllocatorUsageError

__all__ = ["SettingsMixin"]


class SettingsMixin:
    """The configuration half of the simulated allocator."""

    # Provided by CachingAllocator.
    config: AllocatorConfig
    rules: AllocatorRules
    torch_version: str | None
    capacity_bytes: int
    _limit: int | None

    def _apply_config(self) -> None:
        """Cache the settings the hot path reads (they change only through the settings API)."""
        cfg = self.config
        rules = self.rules
        self._max_split = (
            SIZE_MAX if cfg.max_split_size_bytes is None else int(cfg.max_split_size_bytes)
        )
        self._large_segment_size = (
            int(cfg.large_segment_size_bytes)
            if rules.configurable_large_segment_size
            else LARGE_BUFFER
        )
        if rules.configurable_non_split_rounding:
            # PR #136174: max_non_split_rounding_mb, default large_segment_size (§6).
            self._non_split_rounding = (
                int(cfg.max_non_split_rounding_bytes)
                if cfg.max_non_split_rounding_bytes is not None
                else self._large_segment_size
            )
        else:
            # V24 get_free_block: fixed kLargeBuffer slack for oversize reuse.
            self._non_split_rounding = LARGE_BUFFER
        divisions = tuple(int(d) for d in cfg.roundup_power2_divisions)
        self._divisions = divisions if any(d > 1 for d in divisions) else None
        self._gc_threshold = float(cfg.garbage_collection_threshold)
        self._expandable = bool(cfg.expandable_segments)
        self._reject_limit: int | None = None
        if cfg.throw_on_cudamalloc_oom and rules.oom_rejection:
            # MAIN26 alloc_block: trunc(per_process_memory_fraction config (1.0 when unset) *
            # totalGlobalMem), read from the config, not from set_per_process_memory_fraction.
            fraction = cfg.per_process_memory_fraction
            fraction = 1.0 if fraction is None else float(fraction)
            self._reject_limit = int(fraction * float(self.capacity_bytes))

    def _apply_fraction(self, fraction: float) -> None:
        total = self.capacity_bytes
        if self.rules.fraction_limit_only_below_one:
            # MAIN26 setMemoryFraction: a limit only below 1.0, round(f * totalGlobalMem) (§9.5).
            self._limit = None if fraction >= 1.0 else math.floor(fraction * total + 0.5)
        else:
            # V24 setMemoryFraction: trunc(f * total) and set_fraction = true, even for 1.0.
            self._limit = int(fraction * float(total))

    def set_per_process_memory_fraction(self, fraction: float) -> None:
        """Like ``torch.cuda.set_per_process_memory_fraction`` (§9.5, §4 step 6.2).

        Args:
            fraction: the share of ``capacity_bytes`` this allocator may reserve, in [0, 1].

        Raises:
            AllocatorUsageError: not a number in [0, 1].
        """
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
            raise AllocatorUsageError(
                f"fraction must be a float in [0, 1]; got {fraction!r}. Example: 0.5."
            )
        if not 0.0 <= fraction <= 1.0:
            raise AllocatorUsageError(
                f"fraction must be in [0, 1]; got {fraction}. Example: 0.5 for half the device."
            )
        self._apply_fraction(float(fraction))

    def set_allocator_settings(self, text: str) -> None:
        """Like ``torch.cuda.memory._set_allocator_settings`` (§9.1 "Runtime changes").

        Unmentioned ``max_split_size``, roundup divisions and GC threshold go back to their
        defaults (AllocatorConfig.runtime_update); ``memory_stats()["max_split_size"]`` keeps
        the value from creation.

        Raises:
            ConfigError: the settings string is invalid.
        """
        self.config = self.config.runtime_update(text, self.torch_version)
        self._apply_config()

    @property
    def allowed_memory_maximum(self) -> int | None:
        """The per-process limit in bytes, or None when no fraction limit is set."""
        return self._limit

    @property
    def gc_enabled(self) -> bool:
        """GC runs only with a fraction limit and a threshold > 0 (§7)."""
        return self._limit is not None and self._gc_threshold > 0.0

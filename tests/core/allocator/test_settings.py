"""AllocatorSettings: the values malloc reads, from the config and the fraction (ref §6, §9.5)."""

from __future__ import annotations

import pytest

from oomkit.core.allocator import AllocatorConfig
from oomkit.core.allocator.constants import LARGE_BUFFER, SIZE_MAX
from oomkit.core.allocator.settings import AllocatorSettings, check_fraction
from oomkit.core.allocator.versions import behaviour_for
from oomkit.errors import AllocatorUsageError

MiB = 2**20


def _settings(text: str, version: str | None = None, capacity: int = 1000 * MiB):
    return AllocatorSettings(AllocatorConfig.parse(text), behaviour_for(version), capacity)


def test_defaults():
    """PyTorch's defaults: no max_split, 20 MiB slack, no divisions, no limit, no GC."""
    s = _settings("")
    assert (s.max_split, s.non_split_rounding, s.divisions) == (SIZE_MAX, LARGE_BUFFER, None)
    assert (s.limit, s.reject_limit, s.expandable, s.gc_enabled) == (None, None, False, False)
    assert s.split_limited is False


def test_config_values_and_in_place_update():
    """apply_config replaces the config's values but keeps the fraction limit."""
    s = _settings(
        "max_split_size_mb:100,roundup_power2_divisions:4,garbage_collection_threshold:0.5,"
        "per_process_memory_fraction:0.5"
    )
    assert (s.max_split, s.divisions, s.gc_threshold, s.limit) == (
        100 * MiB,
        (4,) * 16,
        0.5,
        500 * MiB,
    )
    assert s.gc_enabled and s.split_limited
    s.apply_config(AllocatorConfig.parse("expandable_segments:True"))
    assert (s.max_split, s.divisions, s.expandable, s.limit) == (SIZE_MAX, None, True, 500 * MiB)
    assert s.split_limited is False


def test_fraction_rounding_differs_by_version():
    """MAIN26 rounds and drops the limit at 1.0; V24 truncates and keeps it (§9.5)."""
    new, old = _settings("", None, 1001), _settings("", "2.4", 1001)
    new.apply_fraction(0.5)
    old.apply_fraction(0.5)
    assert (new.limit, old.limit) == (501, 500)
    new.apply_fraction(1.0)
    old.apply_fraction(1.0)
    assert (new.limit, old.limit) == (None, 1001)


def test_throw_on_cudamalloc_oom_limit_uses_the_config_fraction():
    """MAIN26 reject limit: trunc(config fraction (1.0 unset) * capacity); V24 has none."""
    assert _settings("throw_on_cudamalloc_oom:True").reject_limit == 1000 * MiB
    assert _settings("throw_on_cudamalloc_oom:True", "2.4").reject_limit is None


@pytest.mark.parametrize(
    ("value", "match"), [(True, "float in"), ("0.5", "float in"), (1.5, "in \\[0, 1\\]")]
)
def test_check_fraction_rejects_bad_values(value, match):
    """Booleans, strings and values outside [0, 1] are usage errors with an example."""
    with pytest.raises(AllocatorUsageError, match=match):
        check_fraction(value)

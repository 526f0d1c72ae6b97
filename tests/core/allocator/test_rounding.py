"""Size rounding, pool choice and segment size (ref §2)."""

from __future__ import annotations

import pytest

from oomkit.core.allocator.rounding import (
    allocation_size,
    divisions_slot,
    is_small_size,
    round_size,
    roundup_power2_next_division,
)

MiB = 2**20
D4 = (4,) * 16


@pytest.mark.parametrize(
    ("n", "divisions", "expected"),
    [
        (1, None, 512),
        (511, None, 512),
        (512, None, 512),
        (513, None, 1024),
        (1000, None, 1024),
        (1200, D4, 1536),  # not > 512 * 4: plain 512 rounding (§2.1 example)
        (9000, D4, 10240),
        (1100 * MiB, D4, 1280 * MiB),
        (8192, D4, 8192),  # exact power of two stays
        (5_000_000, None, 5_000_192),
    ],
)
def test_round_size_examples(n, divisions, expected):
    """§2.1 examples."""
    assert round_size(n, divisions) == expected


def test_roundup_power2_next_division_steps():
    """§2.1: step = floor_pow2 / d; values already on a step stay."""
    assert roundup_power2_next_division(1200, 4) == 1280
    assert roundup_power2_next_division(1280, 4) == 1280
    assert roundup_power2_next_division(3 * MiB + 1, 2) == 4 * MiB


@pytest.mark.parametrize(
    ("n", "slot"), [(1, 0), (2 * MiB - 1, 0), (2 * MiB, 1), (4 * MiB, 2), (2**45, 15)]
)
def test_divisions_slot(n, slot):
    """§2.2: slot k covers [2^k MiB, 2^(k+1) MiB), clamped to 0..15."""
    assert divisions_slot(n) == slot


def test_slot_value_selects_divisions():
    """§2.2: only the slot of the size applies."""
    divisions = (0, 8) + (0,) * 14
    assert round_size(MiB + 1, divisions) == MiB + 512
    assert round_size(2 * MiB + 1, divisions) == 2 * MiB + 256 * 1024


def test_pool_choice_is_inclusive_at_1mib():
    """§2.3: a rounded size <= 1 MiB is small."""
    assert is_small_size(MiB)
    assert not is_small_size(MiB + 512)


@pytest.mark.parametrize(
    ("s", "expected"),
    [
        (512, 2 * MiB),
        (MiB, 2 * MiB),
        (MiB + 512, 20 * MiB),
        (10 * MiB - 512, 20 * MiB),
        (10 * MiB, 10 * MiB),
        (10 * MiB + 512, 12 * MiB),
    ],
)
def test_allocation_size(s, expected):
    """§2.4 table."""
    assert allocation_size(s) == expected


def test_allocation_size_large_segment_setting():
    """large_segment_size_mb changes the 1-10 MiB segment size."""
    assert allocation_size(2 * MiB, 40 * MiB) == 40 * MiB

"""Lengths files: one a line, length,count rows, JSON lists; padding and run order."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from oomkit.errors import ConfigError
from oomkit.prediction.lengths import padded, parse_lengths, read_lengths, run_order


def test_three_formats_read_the_same_lengths():
    """A length a line (with comments), a histogram, and a JSON list."""
    assert parse_lengths("512\n# note\n\n1024 # long\n512\n") == (512, 1024, 512)
    assert parse_lengths("512,2\n1024,1\n") == (512, 512, 1024)
    assert parse_lengths("[512, 1024]") == (512, 1024)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "no lengths"),
        ("# only a comment\n", "no lengths"),
        ("512\nabc\n", r"<lengths>:2: 'abc' is not a whole number"),
        ("0\n", "at least 1"),
        ("512,-1\n", "count must be 0 or more"),
        ("[512, true]", "entry 1 is True"),
        ('{"a": 1}', "not a whole number"),
        ("[1,", "not a JSON list"),
        ("512,2000001\n", "more than 1,000,000 steps"),
    ],
)
def test_bad_lengths_files_name_the_problem(text, match):
    """Empty, non-numeric, non-positive, too many: ConfigError with where and what."""
    with pytest.raises(ConfigError, match=match):
        parse_lengths(text)


def test_unreadable_file_is_a_config_error(tmp_path):
    """A directory or a missing path is a ConfigError, not an OSError."""
    with pytest.raises(ConfigError, match="cannot be read: it is a directory"):
        read_lengths(tmp_path)
    with pytest.raises(ConfigError, match="cannot read"):
        read_lengths(tmp_path / "missing.txt")


def test_run_order_pads_cycles_shuffles_and_puts_largest_first():
    """pad_to 64, 5 steps over 3 lengths, a seeded shuffle, and largest first."""
    assert run_order([100, 130, 64], steps=5, pad_to=64) == (128, 192, 64, 128, 192)
    assert run_order([1, 2, 3], seed=7) == run_order([1, 2, 3], seed=7)
    assert sorted(run_order([1, 2, 3], seed=7)) == [1, 2, 3]
    assert run_order([3, 9, 5, 9], largest_first=True) == (9, 3, 5, 9)
    with pytest.raises(ConfigError, match="--steps must be at least 1"):
        run_order([1], steps=0)
    with pytest.raises(ConfigError, match="--pad-to must be at least 1"):
        run_order([1], pad_to=0)


@given(st.integers(1, 10**6), st.integers(1, 4096))
def test_padding_is_the_next_multiple(length, pad_to):
    """padded(n, m) is the least multiple of m that is >= n."""
    out = padded(length, pad_to)
    assert out % pad_to == 0 and length <= out < length + pad_to

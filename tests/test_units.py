"""Tests for oomkit.units."""

import pytest

from oomkit.units import GiB, MiB, SizeError, format_bytes, parse_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("24GiB", 24 * GiB),
        ("500MB", 500_000_000),
        ("1.5 GiB", 3 * GiB // 2),
        ("1048576", MiB),
        ("20mib", 20 * MiB),
        ("2TiB", 2 << 40),
        (123, 123),
    ],
)
def test_parse_bytes_reads_units(text, expected):
    """parse_bytes reads decimal and binary units, case-insensitively."""
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "12 parsecs", "-3GiB", "1.2.3"])
def test_parse_bytes_rejects_garbage(text):
    """parse_bytes names the bad text and shows an example."""
    with pytest.raises(SizeError, match="e.g. 24GiB"):
        parse_bytes(text)


def test_parse_bytes_rejects_negative_int():
    """A negative int is refused."""
    with pytest.raises(SizeError, match="must not be negative"):
        parse_bytes(-1)


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [(0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (3 * GiB, "3.00 GiB"), (-MiB, "-1.00 MiB")],
)
def test_format_bytes(nbytes, text):
    """format_bytes uses binary units with two decimals."""
    assert format_bytes(nbytes) == text


@pytest.mark.parametrize(
    ("nbytes", "text"), [(float("nan"), "nan B"), (float("inf"), "inf B"), (-float("inf"), "-inf B")]
)
def test_format_bytes_shows_a_non_finite_number_as_it_is(nbytes, text):
    """NaN had fallen through every unit to an AssertionError (a NaN context overhead did)."""
    assert format_bytes(nbytes) == text


@pytest.mark.parametrize("text", ["9" * 400, "9" * 400 + "GiB", "17179869184GiB"])
def test_a_size_past_64_bits_is_refused_in_one_short_line(text):
    """A size no device has (2**64 bytes and up, or a 400-digit number): SizeTooLargeError,
    the number cut to its first digits and its length."""
    from oomkit.units import SizeTooLargeError

    with pytest.raises(SizeTooLargeError, match="is larger than any device") as raised:
        parse_bytes(text)
    assert len(str(raised.value)) < 200

"""std::stoi / std::stoull / std::stod as PyTorch's config parsers call them (ref §9.2)."""

from __future__ import annotations

import math

import pytest

from oomkit.core.allocator._c_numbers import NumberError, stod, stoi, stoull

SIZE_MAX = 2**64 - 1


@pytest.mark.parametrize(
    ("token", "expected"),
    [
        ("128", 128),
        ("+7", 7),
        ("\t 42abc", 42),  # leading isspace skipped, trailing text ignored
        ("512.7", 512),  # the longest integer prefix
        ("0x10", 0),  # base 10: reads the "0"
        ("-0", 0),
        ("-1", SIZE_MAX),  # the cast to size_t wraps
        ("2147483647", 2**31 - 1),  # INT_MAX
        ("-2147483648", 2**64 - 2**31),  # INT_MIN, wrapped
    ],
)
def test_stoi(token, expected):
    """stoi reads the integer prefix, then PyTorch casts it to size_t."""
    assert stoi(token) == expected


@pytest.mark.parametrize(
    ("token", "message"),
    [
        ("2147483648", r"out of the range of a C int \(stoi\)"),
        ("-2147483649", r"out of the range of a C int \(stoi\)"),
        ("", "is not an integer"),
        ("+", "is not an integer"),
        ("abc", "is not an integer"),
        ("- 1", "is not an integer"),  # no space allowed after the sign
    ],
)
def test_stoi_rejects(token, message):
    """std::out_of_range beyond a C int; std::invalid_argument without digits."""
    with pytest.raises(NumberError, match=message):
        stoi(token)


@pytest.mark.parametrize(
    ("token", "expected"),
    [
        ("3000000000", 3_000_000_000),  # above INT_MAX: fine for stoull
        ("18446744073709551615", SIZE_MAX),
        ("-1", SIZE_MAX),  # strtoull negates modulo 2^64
        ("-18446744073709551615", 1),
        (" 64MB", 64),
    ],
)
def test_stoull(token, expected):
    """stoull reads the integer prefix; a '-' negates modulo 2^64."""
    assert stoull(token) == expected


@pytest.mark.parametrize(
    ("token", "message"),
    [
        ("18446744073709551616", r"out of the range of a 64-bit unsigned integer \(stoull\)"),
        ("-18446744073709551616", r"out of the range of a 64-bit unsigned integer \(stoull\)"),
        ("x1", "is not an integer"),
    ],
)
def test_stoull_rejects(token, message):
    """Magnitudes above 2^64 - 1 are out of range; no digits is invalid."""
    with pytest.raises(NumberError, match=message):
        stoull(token)


@pytest.mark.parametrize(
    ("token", "expected"),
    [
        ("0.6", 0.6),
        ("1.", 1.0),
        (".5", 0.5),
        ("5e-1", 0.5),
        ("1e", 1.0),  # an exponent without digits is not part of the number
        (" \t0.25x", 0.25),
        ("0x1p-1", 0.5),
        ("0x.8", 0.5),
        ("0X1", 1.0),
        ("0x1p", 1.0),  # "p" without digits is left over
        ("0x", 0.0),  # no hex digits: strtod reads the "0"
        ("0e-400", 0.0),  # zero is not an underflow
        ("2.2250738585072014e-308", 2.2250738585072014e-308),  # smallest normal double
        ("-Infinity", -math.inf),
        ("inf", math.inf),
    ],
)
def test_stod(token, expected):
    """stod reads the longest decimal, hex or special floating-point prefix."""
    assert stod(token) == expected


@pytest.mark.parametrize("token", ["nan", "NAN(123)", "-nan"])
def test_stod_nan(token):
    """NAN and NAN(chars) read as NaN (the parsers' range checks then reject it)."""
    assert math.isnan(stod(token))


@pytest.mark.parametrize(
    ("token", "message"),
    [
        ("1e309", r"out of the range of a double \(stod\)"),
        ("0x1p1024", r"out of the range of a double \(stod\)"),
        ("1e-310", r"too small for a double \(stod underflow\)"),  # subnormal: ERANGE
        ("0x1p-1030", r"too small for a double \(stod underflow\)"),
        ("e5", "is not a number"),
        ("", "is not a number"),
        (".", "is not a number"),
    ],
)
def test_stod_rejects(token, message):
    """Overflow and underflow are std::out_of_range; no number is std::invalid_argument."""
    with pytest.raises(NumberError, match=message):
        stod(token)

"""``std::stoi`` / ``std::stoull`` / ``std::stod`` as PyTorch's allocator-config parsers call them.

The parsers hand a whole token to the C++ conversion, which reads the longest numeric prefix after
leading ``std::isspace`` characters and ignores the rest (``512.7`` reads as 512), so a token
PyTorch accepts is accepted here with the same value, and one it rejects raises
:class:`NumberError` (``std::invalid_argument`` / ``std::out_of_range``).
"""

from __future__ import annotations

import math
import re
import sys

from oomkit.core.allocator.constants import SIZE_MAX

__all__ = ["NumberError", "stod", "stoi", "stoull"]

# strtol / strtoull: optional C-locale whitespace, an optional sign, then decimal digits. ASCII
# digits only (re.ASCII): in the C locale isdigit is 0-9, so strtoull stops at a full-width
# "１２８" and stoull throws; Python's \d would read it as 128.
_INT_RE = re.compile(r"[ \t\n\v\f\r]*([+-]?)(\d+)", re.ASCII)
# strtod: a hexadecimal float ("0x1p-1", "0x.8"), the binary exponent optional.
_HEX_FLOAT_RE = re.compile(
    r"[ \t\n\v\f\r]*([+-]?0[xX](?:[0-9a-fA-F]+\.?[0-9a-fA-F]*|\.[0-9a-fA-F]+)(?:[pP][+-]?\d+)?)",
    re.ASCII,
)
# strtod: a decimal float ("1.", ".5", "5e-1").
_DEC_FLOAT_RE = re.compile(r"[ \t\n\v\f\r]*([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)", re.ASCII)
# strtod: INF / INFINITY / NAN / NAN(chars), any case.
_SPECIAL_FLOAT_RE = re.compile(
    r"[ \t\n\v\f\r]*([+-]?)(inf(?:inity)?|nan(?:\([0-9A-Za-z_]*\))?)", re.IGNORECASE
)
# C int is 32 bits on every platform PyTorch builds for.
_INT_MIN = -(2**31)
_INT_MAX = 2**31 - 1
_SIZE_T_MODULUS = SIZE_MAX + 1


class NumberError(Exception):
    """std::invalid_argument / std::out_of_range from stoi, stoull or stod; says which."""


def stoi(token: str) -> int:
    """std::stoi then the cast to size_t PyTorch applies (negative values wrap).

    Args:
        token: the value token, e.g. ``"128"``, ``"-1"``, ``"512.7"``.

    Returns:
        The value as the ``size_t`` PyTorch stores: ``-1`` reads as ``SIZE_MAX``.

    Raises:
        NumberError: no digits after optional whitespace and sign, or outside a C int.
    """
    match = _INT_RE.match(token)
    if match is None:
        raise NumberError("is not an integer")
    value = int(match[2]) * (-1 if match[1] == "-" else 1)
    if not _INT_MIN <= value <= _INT_MAX:
        raise NumberError("is out of the range of a C int (stoi)")
    return value % _SIZE_T_MODULUS


def stoull(token: str) -> int:
    """std::stoull / stoul: a leading '-' negates modulo 2^64, like strtoull.

    Args:
        token: the value token.

    Returns:
        The unsigned 64-bit value.

    Raises:
        NumberError: no digits after optional whitespace and sign, or the magnitude is above
            2^64 - 1.
    """
    match = _INT_RE.match(token)
    if match is None:
        raise NumberError("is not an integer")
    magnitude = int(match[2])
    if magnitude > SIZE_MAX:
        raise NumberError("is out of the range of a 64-bit unsigned integer (stoull)")
    return (-magnitude if match[1] == "-" else magnitude) % _SIZE_T_MODULUS


def stod(token: str) -> float:
    """std::stod: the longest floating-point prefix; overflow and underflow are errors.

    Args:
        token: the value token, e.g. ``"0.6"``, ``"0x1p-1"``, ``"inf"``.

    Returns:
        The double (``inf`` and ``nan`` are returned as read; callers range-check them).

    Raises:
        NumberError: no number prefix, a finite text that overflows to infinity, or a nonzero
            text below the smallest normal double (strtod sets ERANGE; stod throws).
    """
    special = _SPECIAL_FLOAT_RE.match(token)
    if special is not None:
        sign = -1.0 if special[1] == "-" else 1.0
        return sign * (math.inf if special[2].lower().startswith("inf") else math.nan)
    hex_match = _HEX_FLOAT_RE.match(token)
    if hex_match is not None:
        text = hex_match[1]
        if not re.search(r"[pP]", text):
            text += "p0"
        try:
            value = float.fromhex(text)
        except OverflowError:
            # float.fromhex raises where strtod returns HUGE_VAL with ERANGE.
            raise NumberError("is out of the range of a double (stod)") from None
        mantissa = text.split("x", 1)[-1].split("X", 1)[-1].split("p")[0].split("P")[0]
    else:
        dec_match = _DEC_FLOAT_RE.match(token)
        if dec_match is None:
            raise NumberError("is not a number")
        value = float(dec_match[1])
        mantissa = re.split(r"[eE]", dec_match[1])[0]
    if math.isinf(value):
        raise NumberError("is out of the range of a double (stod)")
    if abs(value) < sys.float_info.min and any(c not in "0.+-" for c in mantissa):
        raise NumberError("is too small for a double (stod underflow)")
    return value

"""Byte sizes at the edges: ``format_bytes`` for output, ``parse_bytes`` for input.

Inside oomkit every size is an ``int`` number of bytes; these two functions are the only place
that converts to and from human text.
"""

from __future__ import annotations

import re

from oomkit.errors import OomkitError

__all__ = ["format_bytes", "parse_bytes", "KiB", "MiB", "GiB", "TiB", "SizeTooLargeError"]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": KiB,
    "kib": KiB,
    "mi": MiB,
    "mib": MiB,
    "gi": GiB,
    "gib": GiB,
    "ti": TiB,
    "tib": TiB,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*$")


class SizeError(OomkitError, ValueError):
    """A size string that ``parse_bytes`` cannot read."""


class SizeTooLargeError(SizeError):
    """A size past 2**64 bytes: read as a size, and no device's (never a GPU name either)."""


def parse_bytes(text: str | int) -> int:
    """Parse a size such as ``8GiB``, ``500MB``, ``1.5 GiB`` or ``1048576`` into bytes.

    Decimal units (kB, MB, GB, TB) are powers of 1000; binary units (KiB, MiB, GiB, TiB) are
    powers of 1024, as in ``nvidia-smi`` and PyTorch's OOM message respectively.

    Args:
        text: the size, or an int that is returned unchanged.

    Returns:
        The size in bytes, rounded down to a whole byte.

    Raises:
        SizeError: the text is not a non-negative size with a known unit.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise SizeError(f"a size must not be negative; got {text}. Example: 24GiB")
        return text
    match = _SIZE_RE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise SizeError(
            f"cannot read {text!r} as a size. Use a number with an optional unit, "
            "e.g. 24GiB, 500MB, 1.5TiB or 1048576 (bytes)."
        )
    number = float(match.group(1)) * _UNITS[unit]
    # A size is a size_t in the caching allocator (c10/cuda/CUDACachingAllocator.cpp): anything
    # past 2**64 bytes (or a number too long to read) is no device's memory.
    if not number < _MAX_SIZE_BYTES:
        raise SizeTooLargeError(
            f"{_shortened(str(text))} is larger than any device (at most 2**64 bytes); give a "
            "size such as 24GiB."
        )
    return int(number)


_MAX_SIZE_BYTES = float(2**64)


def _shortened(text: str) -> str:
    """``text`` as given, cut to 40 characters (a 400-digit number is not repeated whole)."""
    return repr(text) if len(text) <= 40 else f"{text[:20]!r}... ({len(text)} characters)"


def format_bytes(nbytes: int, precision: int = 2) -> str:
    """Format bytes with binary units, e.g. ``format_bytes(3 * 2**30) == '3.00 GiB'``.

    Negative values keep their sign (used for savings and deltas).
    """
    sign = "-" if nbytes < 0 else ""
    value = abs(nbytes)
    if value < KiB or value != value or value == float("inf"):  # NaN and inf: as they are
        return f"{sign}{value} B"
    for unit, scale in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if value >= scale:
            return f"{sign}{value / scale:.{precision}f} {unit}"
    raise AssertionError("unreachable")

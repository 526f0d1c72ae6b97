"""Request sequences compared as the allocator sees them (the H200 comparisons' one rule).

A sequence is signed sizes: an allocation's requested bytes, a completed free's negated. Frees
that follow one another with no request between them are compared as a set: their order changes
nothing the allocator decides next (freed blocks merge the same way in any order), and some of it
is a hash map's (autocast's cache, cleared when a region exits).
"""

from __future__ import annotations


def frees_as_sets(sequence: list[int]) -> list[int]:
    """``sequence`` with each run of consecutive frees (negative sizes) in one order."""
    out: list[int] = []
    frees: list[int] = []
    for size in sequence:
        if size < 0:
            frees.append(size)
            continue
        out.extend(sorted(frees))
        frees.clear()
        out.append(size)
    return out + sorted(frees)

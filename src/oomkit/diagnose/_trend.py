"""Robust trend statistics for per-step memory series: Theil–Sen slope and Mann–Kendall test.

Both are rank/median based, so one noisy step (a larger batch, a transient cache) moves them
little: the Theil–Sen slope is the median of all pairwise slopes (Sen 1968), and the Mann–Kendall
statistic counts rising minus falling pairs, with the variance corrected for ties (Kendall 1975).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import median

__all__ = [
    "LEAK_Z",
    "MAX_TREND_POINTS",
    "MIN_WARMUP_STEPS",
    "Trend",
    "bin_minima",
    "detect_warmup_steps",
    "trend",
]

# Both statistics cost O(n^2) pairs; longer series are reduced to this many bins (each bin's
# minimum, the level memory returns to) before they are computed.
MAX_TREND_POINTS = 256
# One-sided Mann–Kendall test at p < 0.005 (the normal quantile 2.576).
LEAK_Z = 2.576
# Warm-up: at least this many steps (the first optimizer step allocates its state at step 0,
# and step 1 is the first one that reuses it); a step whose change is more than WARMUP_JUMP times
# the typical later change extends it, within the first third of the run.
MIN_WARMUP_STEPS = 2
WARMUP_JUMP = 4.0


@dataclass(frozen=True)
class Trend:
    """The trend of a series ``values`` at positions ``xs``.

    Attributes:
        slope_per_x: Theil–Sen slope (median pairwise slope), in value units per x unit.
        mann_kendall_s: rising pairs minus falling pairs.
        mann_kendall_z: the normal score of ``mann_kendall_s`` (continuity corrected; 0 when
            the series is constant).
        kendall_tau: ``mann_kendall_s`` over the number of pairs, in [-1, 1].
        points: how many points the statistics were computed on.
    """

    slope_per_x: float
    mann_kendall_s: int
    mann_kendall_z: float
    kendall_tau: float
    points: int


def bin_minima(
    xs: Sequence[float], values: Sequence[float], bins: int
) -> tuple[list[float], list[float]]:
    """Reduce a series to ``bins`` consecutive bins: each bin's first x and its minimum value."""
    n = len(values)
    if n <= bins:
        return list(xs), list(values)
    out_x: list[float] = []
    out_v: list[float] = []
    for b in range(bins):
        lo, hi = b * n // bins, (b + 1) * n // bins
        out_x.append(xs[lo])
        out_v.append(min(values[lo:hi]))
    return out_x, out_v


def trend(xs: Sequence[float], values: Sequence[float]) -> Trend:
    """Theil–Sen slope and Mann–Kendall statistic of ``values`` over strictly increasing ``xs``.

    Args:
        xs: positions (step numbers), strictly increasing.
        values: the series, same length, at least 2 points.

    Returns:
        The trend; series longer than ``MAX_TREND_POINTS`` are first reduced by ``bin_minima``.
    """
    xs, values = bin_minima(xs, values, MAX_TREND_POINTS)
    n = len(values)
    assert n >= 2 and len(xs) == n
    slopes: list[float] = []
    s = 0
    for i in range(n - 1):
        xi, vi = xs[i], values[i]
        for j in range(i + 1, n):
            d = values[j] - vi
            slopes.append(d / (xs[j] - xi))
            s += (d > 0) - (d < 0)
    # Tie correction of the variance: sum over groups of equal values t(t-1)(2t+5).
    counts: dict[float, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    ties = sum(t * (t - 1) * (2 * t + 5) for t in counts.values())
    variance = (n * (n - 1) * (2 * n + 5) - ties) / 18
    if variance <= 0 or s == 0:
        z = 0.0
    else:
        z = (s - math.copysign(1, s)) / math.sqrt(variance)
    return Trend(
        slope_per_x=float(median(slopes)),
        mann_kendall_s=s,
        mann_kendall_z=z,
        kendall_tau=s / (n * (n - 1) / 2),
        points=n,
    )


def detect_warmup_steps(values: Sequence[int]) -> int:
    """How many leading samples belong to the warm-up of a per-step series.

    At least ``MIN_WARMUP_STEPS``; more while a step's change is over ``WARMUP_JUMP`` times the
    median absolute change of the last two thirds (the first optimizer step allocating its
    state, caches filling), within the first third.

    Args:
        values: the per-step series (allocated bytes).

    Returns:
        The number of samples to skip.
    """
    n = len(values)
    diffs = [b - a for a, b in zip(values, values[1:], strict=False)]
    limit = n // 3
    later = [abs(d) for d in diffs[limit:]]
    scale = median(later) if later else 0
    k = min(MIN_WARMUP_STEPS, n)
    # diffs[k - 1] is the change into sample k: while it jumps, sample k is still warming up.
    while k < limit and abs(diffs[k - 1]) > WARMUP_JUMP * scale:
        k += 1
    return k

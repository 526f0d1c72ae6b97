"""thin_timeline: the one rule every timeline (diagnosis HTML, diff) is bounded by."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from oomkit.diagnose.attribution import thin_timeline

levels = st.lists(st.tuples(st.integers(0, 2**40), st.integers(0, 2**40)), max_size=300)


@given(levels, st.integers(1, 50))
def test_thinning_is_bounded_ordered_and_keeps_every_peak(pairs, max_points):
    """At most max_points points, x increasing, the highest levels kept, the last x kept."""
    points = [(float(i), a, r) for i, (a, r) in enumerate(pairs)]
    thinned = thin_timeline(points, max_points)
    assert len(thinned) <= max_points
    xs = [x for x, _, _ in thinned]
    assert xs == sorted(xs) and len(set(xs)) == len(xs)
    if points:
        assert max(a for _, a, _ in thinned) == max(a for _, a, _ in points)
        assert max(r for _, _, r in thinned) == max(r for _, _, r in points)
        assert thinned[-1][0] == points[-1][0]
    else:
        assert thinned == ()


def test_runs_merge_into_their_last_x_with_their_highest_levels():
    """Five points into two: runs of three and two, each at its last x with its maxima."""
    points = [(0.0, 1, 5), (1.0, 7, 2), (2.0, 3, 3), (3.0, 4, 9), (4.0, 2, 1)]
    assert thin_timeline(points, 2) == ((2.0, 7, 5), (4.0, 4, 9))
    assert thin_timeline(points, 5) == tuple(points)

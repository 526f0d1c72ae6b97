"""oomkit diff: B minus A in parts that add up exactly, by category and site, and divergence."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from oomkit.core.snapshot import load_snapshot, snapshot_from_data
from oomkit.core.snapshot.writer import snapshot_to_data
from oomkit.core.trace import Frame, TraceEvent
from oomkit.diagnose.run_diff import (
    RunMemory,
    diff_runs,
    run_memory_from_prediction,
    run_memory_from_snapshot,
)
from oomkit.errors import DiffInputError, PredictionFormatError

MiB = 2**20
S1, S2 = 0x7F00_0000_0000, 0x7F00_1000_0000
SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "snapshots"


def _frames(line: int) -> tuple[Frame, ...]:
    return (Frame("/home/u/train.py", line, "step"),)


def _segment(address: int, blocks: list[tuple[int, str]]) -> dict:
    out, at = [], address
    for size, state in blocks:
        out.append({"address": at, "size": size, "requested_size": size, "state": state})
        at += size
    allocated = sum(size for size, state in blocks if state == "active_allocated")
    return {
        "device": 0,
        "address": address,
        "total_size": at - address,
        "stream": 0,
        "segment_type": "large",
        "allocated_size": allocated,
        "active_size": allocated,
        "requested_size": allocated,
        "is_expandable": False,
        "blocks": out,
    }


def _snapshot(events, segments):
    return snapshot_from_data(snapshot_to_data(segments, {0: events}, None), name="x")


def snapshot_a():
    """One 20 MiB segment: 8 MiB at line 10, 8 MiB at line 11, the first freed."""
    events = (
        TraceEvent("segment_alloc", S1, 20 * MiB),
        TraceEvent("alloc", S1, 8 * MiB, frames=_frames(10)),
        TraceEvent("alloc", S1 + 8 * MiB, 8 * MiB, frames=_frames(11)),
        TraceEvent("free_requested", S1, 8 * MiB),
        TraceEvent("free_completed", S1, 8 * MiB),
    )
    seg = _segment(S1, [(8 * MiB, "inactive"), (8 * MiB, "active_allocated"), (4 * MiB, "inactive")])
    return _snapshot(events, [seg])


def snapshot_b():
    """Two 20 MiB segments: 12 MiB at line 10, then 16 MiB at line 12 in a second segment."""
    events = (
        TraceEvent("segment_alloc", S1, 20 * MiB),
        TraceEvent("alloc", S1, 12 * MiB, frames=_frames(10)),
        TraceEvent("segment_alloc", S2, 20 * MiB),
        TraceEvent("alloc", S2, 16 * MiB, frames=_frames(12)),
    )
    segs = [
        _segment(S1, [(12 * MiB, "active_allocated"), (8 * MiB, "inactive")]),
        _segment(S2, [(16 * MiB, "active_allocated"), (4 * MiB, "inactive")]),
    ]
    return _snapshot(events, segs)


def test_snapshot_peak_is_the_first_allocation_at_peak_reserved():
    """A: reserved peaks at 20 MiB; the first alloc there holds 8 MiB, so placement is 12 MiB."""
    a = run_memory_from_snapshot(snapshot_a())
    assert (a.peak_reserved_bytes, a.allocated_at_peak_bytes, a.placement_bytes) == (
        20 * MiB,
        8 * MiB,
        12 * MiB,
    )
    assert a.peak_at == 1
    assert a.by_site_bytes == {"train.py:10 in step": 8 * MiB}
    assert a.site_kind == "frame"
    assert a.segments_at_peak == {20 * MiB: 1}


def test_snapshot_diff_parts_add_up_with_sites_and_divergence():
    """B - A: +20 MiB reserved = +20 MiB allocated + 0 placement; sites +16 and +4 MiB."""
    diff = diff_runs(run_memory_from_snapshot(snapshot_a()), run_memory_from_snapshot(snapshot_b()))
    assert diff.peak_reserved_delta_bytes == 20 * MiB
    assert (diff.allocated_delta_bytes, diff.placement_delta_bytes, diff.outside_delta_bytes) == (
        20 * MiB,
        0,
        0,
    )
    assert diff.peak_delta_bytes == 20 * MiB
    assert [(s.name, s.delta_bytes) for s in diff.top_sites] == [
        ("train.py:12 in step", 16 * MiB),
        ("train.py:10 in step", 4 * MiB),
    ]
    d = diff.divergence
    assert d is not None and (d.index, d.matched, d.unit) == (0, 0, "allocation")
    assert d.a == f"alloc {8 * MiB} B at train.py:10 in step"
    # Segment decisions at each peak: A holds one 20 MiB segment, B two.
    assert (run_memory_from_snapshot(snapshot_b()).segments_at_peak) == {20 * MiB: 2}
    assert [(s.name, s.a_bytes, s.b_bytes) for s in diff.segment_deltas] == [
        ("20.00 MiB segments", 20 * MiB, 40 * MiB)
    ]


def test_same_program_diverges_where_an_allocation_changes():
    """A against itself: no divergence and all parts 0."""
    a = run_memory_from_snapshot(snapshot_a())
    diff = diff_runs(a, run_memory_from_snapshot(snapshot_a()))
    assert diff.peak_reserved_delta_bytes == diff.allocated_delta_bytes == 0
    assert diff.divergence is not None and diff.divergence.index is None
    assert diff.divergence.matched == 3  # two allocs and one free


def _prediction(reserved, allocated, context, gpu="H100 SXM", cats=None, steps=((1, 2),)):
    return {
        "gpu": {"name": gpu},
        "context_overhead_bytes": context,
        "peak_reserved_at": {
            "event_index": 7,
            "reserved_bytes": reserved,
            "allocated_bytes": allocated,
            "by_category_bytes": cats or {},
            "top_modules": [{"module": "h.0", "bytes": allocated // 2}],
        },
        "timeline": [{"event_index": 7, "allocated_bytes": allocated, "reserved_bytes": reserved}],
        "step_peaks": [{"peak_allocated_bytes": a, "peak_reserved_bytes": r} for a, r in steps],
    }


def test_prediction_diff_counts_the_context_as_outside():
    """Predictions: outside = context change; peak = reserved + outside change."""
    a = run_memory_from_prediction(_prediction(100 * MiB, 60 * MiB, 500 * MiB, cats={"activation": 60 * MiB}), name="a.json")
    b = run_memory_from_prediction(
        _prediction(130 * MiB, 70 * MiB, 600 * MiB, cats={"activation": 50 * MiB, "gradient": 20 * MiB}, steps=((1, 3),)),
        name="b.json",
    )
    diff = diff_runs(a, b)
    assert (diff.allocated_delta_bytes, diff.placement_delta_bytes, diff.outside_delta_bytes) == (
        10 * MiB,
        20 * MiB,
        100 * MiB,
    )
    assert (diff.peak_reserved_delta_bytes, diff.peak_delta_bytes) == (30 * MiB, 130 * MiB)
    assert [(c.name, c.delta_bytes) for c in diff.by_category] == [
        ("gradient", 20 * MiB),
        ("activation", -10 * MiB),
    ]
    assert diff.divergence is not None and (diff.divergence.index, diff.divergence.unit) == (0, "step")


def test_different_kinds_or_gpus_need_force():
    """A snapshot against a prediction, or H100 against A100, is refused unless forced."""
    snap = run_memory_from_snapshot(snapshot_a())
    pred = run_memory_from_prediction(_prediction(10 * MiB, 5 * MiB, 0), name="p.json")
    with pytest.raises(DiffInputError, match="--force"):
        diff_runs(snap, pred)
    other = run_memory_from_prediction(_prediction(10 * MiB, 5 * MiB, 0, gpu="A100 80GB"), name="q.json")
    with pytest.raises(DiffInputError, match="H100 SXM and q.json for A100"):
        diff_runs(pred, other)
    assert diff_runs(pred, other, force=True).peak_reserved_delta_bytes == 0


def test_malformed_prediction_is_a_format_error():
    """Not a prediction: PredictionFormatError naming the key; allocated above reserved too."""
    with pytest.raises(PredictionFormatError, match="peak_reserved_at"):
        run_memory_from_prediction({"gpu": {}}, name="p.json")
    with pytest.raises(PredictionFormatError, match="above reserved"):
        run_memory_from_prediction(_prediction(1 * MiB, 2 * MiB, 0), name="p.json")


def _run(reserved: int, allocated: int, outside: int | None) -> RunMemory:
    return RunMemory("monitor", "m", None, reserved, allocated, outside, {}, {}, None, 0, (), "step", ())


@given(
    st.integers(0, 2**40), st.integers(0, 2**40), st.integers(0, 2**40), st.integers(0, 2**40),
    st.none() | st.integers(0, 2**34), st.none() | st.integers(0, 2**34),
)
def test_parts_always_add_up(r1, r2, f1, f2, o1, o2):
    """allocated + placement == peak reserved delta; + outside == peak delta, for any runs."""
    a = _run(r1 + f1, r1, o1)
    b = _run(r2 + f2, r2, o2)
    diff = diff_runs(a, b)
    assert diff.allocated_delta_bytes + diff.placement_delta_bytes == diff.peak_reserved_delta_bytes
    assert diff.peak_reserved_delta_bytes + diff.outside_delta_bytes == diff.peak_delta_bytes
    if o1 is None or o2 is None:
        assert diff.outside_delta_bytes == 0


@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/snapshots is absent")
def test_real_snapshots_parts_add_up():
    """Every pair of consecutive shared snapshots with a trace: the parts sum exactly."""
    runs = []
    for path in sorted(SHARED.glob("*/*.pickle")):
        snap = load_snapshot(path)
        if any(ev.action == "alloc" for t in snap.device_traces.values() for ev in t):
            runs.append(run_memory_from_snapshot(snap))
    assert len(runs) >= 8
    for a, b in zip(runs, runs[1:], strict=False):
        diff = diff_runs(a, b)
        assert diff.allocated_delta_bytes + diff.placement_delta_bytes == (
            b.peak_reserved_bytes - a.peak_reserved_bytes
        )
        assert 0 <= a.allocated_at_peak_bytes <= a.peak_reserved_bytes

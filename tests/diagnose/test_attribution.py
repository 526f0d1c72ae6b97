"""attribution: trace lifetimes and levels, user frames, and what was live at a moment."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from oomkit.core.allocator import round_size
from oomkit.core.snapshot import SnapshotBlock, SnapshotSegment
from oomkit.core.trace import Frame, TraceEvent
from oomkit.diagnose.attribution import attribute, site_of, trace_history

MiB = 2**20

USER = Frame("/home/user/train.py", 42, "step")
LIB = Frame("/venv/lib/python3.12/site-packages/transformers/modeling.py", 7, "forward")
TORCH_PY = Frame("/venv/lib/python3.12/site-packages/torch/nn/functional.py", 2100, "linear")
CPP = Frame("CUDACachingAllocator.cpp", 0, "malloc")
UNKNOWN = Frame("??", 0, "torch::unwind::unwind()")


def _segment(address: int, total: int, blocks: list[tuple[int, int, str]]) -> SnapshotSegment:
    return SnapshotSegment(
        device=0,
        address=address,
        total_size=total,
        stream=0,
        segment_type="large",
        allocated_size=sum(s for _, s, st_ in blocks if st_ == "active_allocated"),
        active_size=sum(s for _, s, st_ in blocks if st_ != "inactive"),
        requested_size=0,
        is_expandable=False,
        blocks=tuple(SnapshotBlock(a, s, s, st_) for a, s, st_ in blocks),
    )


def test_site_skips_cpp_and_torch_frames():
    """The user's frame is found under C++ and torch's own Python frames."""
    assert site_of((UNKNOWN, CPP, TORCH_PY, USER, LIB)) == USER


def test_site_prefers_user_files_over_packages():
    """A library frame is the site only when no frame of the user's own files is recorded."""
    assert site_of((CPP, LIB, USER)) == USER
    assert site_of((CPP, TORCH_PY, LIB)) == LIB
    assert site_of((CPP, TORCH_PY)) is None


def test_levels_end_at_the_final_state():
    """Allocated and reserved after each event, walked so that they end at the final segments."""
    events = [
        TraceEvent("segment_alloc", 0x100000, 20 * MiB),
        TraceEvent("alloc", 0x100000, 4 * MiB, frames=(USER,)),
        TraceEvent("alloc", 0x500000, 6 * MiB - 100),
        TraceEvent("free_requested", 0x500000, 6 * MiB - 100),
        TraceEvent("free_completed", 0x500000, 6 * MiB - 100),
    ]
    final = [
        _segment(
            0x100000,
            20 * MiB,
            [(0x100000, 4 * MiB, "active_allocated"), (0x500000, 16 * MiB, "inactive")],
        )
    ]
    h = trace_history(events, final, round_size)
    assert h.start_allocated_bytes == 0 and h.start_reserved_bytes == 0
    assert h.allocated_bytes == (0, 4 * MiB, 10 * MiB, 4 * MiB, 4 * MiB)
    assert h.reserved_bytes == (20 * MiB,) * 5
    assert [(r.alloc_index, r.freed_index) for r in h.records] == [(1, None), (2, 3)]


def test_blocks_live_before_the_trace():
    """A final block never seen in the trace and a free of an unseen alloc were live at start."""
    events = [TraceEvent("free_requested", 0x900000, 2 * MiB)]
    final = [
        _segment(
            0x100000,
            20 * MiB,
            [(0x100000, 8 * MiB, "active_allocated"), (0x900000, 12 * MiB, "inactive")],
        )
    ]
    h = trace_history(events, final, round_size)
    assert h.start_allocated_bytes == 10 * MiB
    assert h.allocated_bytes == (8 * MiB,)
    assert sorted(r.alloc_index for r in h.records) == [-1, -1]


def test_attribute_by_site_category_and_size():
    """At a moment: bytes by category tag, top sites by live bytes, largest tensors first."""
    other = Frame("/home/user/model.py", 9, "forward")
    events = [
        TraceEvent("alloc", 0x0, 8 * MiB, frames=(CPP, USER), tags=(("category", "activation"),)),
        TraceEvent(
            "alloc", 0x800000, 2 * MiB, frames=(CPP, USER), tags=(("category", "activation"),)
        ),
        TraceEvent(
            "alloc",
            0xA00000,
            4 * MiB,
            frames=(other,),
            tags=(("category", "parameter"), ("module", "fc")),
        ),
        TraceEvent("free_requested", 0x800000, 2 * MiB),
    ]
    final = [
        _segment(
            0x0,
            20 * MiB,
            [
                (0x0, 8 * MiB, "active_allocated"),
                (0x800000, 2 * MiB, "inactive"),
                (0xA00000, 4 * MiB, "active_allocated"),
                (0xE00000, 6 * MiB, "inactive"),
            ],
        )
    ]
    h = trace_history(events, final, round_size)
    at = attribute(h, 2, "peak")
    assert at.allocated_bytes == 14 * MiB
    assert dict(at.by_category_bytes) == {"activation": 10 * MiB, "parameter": 4 * MiB}
    assert [(s.label, s.live_bytes, s.count) for s in at.top_sites] == [
        ("/home/user/train.py:42 in step", 10 * MiB, 2),
        ("/home/user/model.py:9 in forward [fc]", 4 * MiB, 1),
    ]
    assert [t.size_bytes for t in at.largest_tensors] == [8 * MiB, 4 * MiB, 2 * MiB]
    end = attribute(h, None, "final")
    assert end.allocated_bytes == 12 * MiB


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 64)), min_size=1, max_size=40))
def test_levels_equal_the_live_records(ops):
    """Invariant: after every event, allocated equals the sum of records live then."""
    events, live, next_address = [], [], 0
    for do_alloc, mib in ops:
        if do_alloc or not live:
            events.append(TraceEvent("alloc", next_address, mib * MiB))
            live.append((next_address, mib * MiB))
            next_address += 64 * MiB
        else:
            address, size = live.pop(0)
            events.append(TraceEvent("free_requested", address, size))
    h = trace_history(events, [], round_size)
    for i in range(len(events)):
        assert h.allocated_bytes[i] - h.start_allocated_bytes == sum(
            r.size_bytes for r in h.records if r.live_at(i) and r.alloc_index >= 0
        )


def test_terminal_site_labels_keep_file_and_line():
    """A long path is shortened from the left, so the line number survives a narrow terminal."""
    from oomkit.interfaces.reports.diagnosis import _short_site

    label = "/gris/gris-f/home/user/NCA/src/models/Model_BasicNCA3D.py:60 in update"
    assert _short_site(label) == "…/models/Model_BasicNCA3D.py:60 in update"
    assert _short_site("train.py:12 in step") == "train.py:12 in step"
    assert _short_site("(no user frame recorded)") == "(no user frame recorded)"

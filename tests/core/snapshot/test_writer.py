"""Tests for writing snapshots and reading them back."""

import pickle

from oomkit.core.allocator import CachingAllocator
from oomkit.core.snapshot import load_snapshot, snapshot_to_data, write_snapshot
from oomkit.core.snapshot.unpickler import load_plain_pickle
from oomkit.core.trace import Frame, TraceEvent

MiB = 2**20
STACK = (Frame("train.py", 5, "step"),)

SEGMENTS = [
    {
        "device": 0,
        "address": 0x7F00_0000_0000,
        "total_size": 20 * MiB,
        "stream": 0,
        "segment_type": "large",
        "allocated_size": 4 * MiB,
        "active_size": 6 * MiB,
        "requested_size": 6 * MiB - 100,
        "is_expandable": False,
        "blocks": [
            {
                "address": 0x7F00_0000_0000,
                "size": 4 * MiB,
                "requested_size": 4 * MiB - 100,
                "state": "active_allocated",
            },
            {
                "address": 0x7F00_0040_0000,
                "size": 2 * MiB,
                "requested_size": 2 * MiB,
                "state": "active_pending_free",
            },
            {
                "address": 0x7F00_0060_0000,
                "size": 14 * MiB,
                "requested_size": 1,
                "state": "inactive",
            },
        ],
    },
    {
        "device": 2,
        "address": 0x10_0000,
        "total_size": 2 * MiB,
        "stream": 9,
        "segment_type": "small",
        "allocated_size": 0,
        "active_size": 0,
        "requested_size": 0,
        "is_expandable": False,
        "blocks": [
            {"address": 0x10_0000, "size": 2 * MiB, "requested_size": 0, "state": "inactive"}
        ],
    },
]
TRACES = {
    0: (
        TraceEvent("segment_alloc", 0x7F00_0000_0000, 20 * MiB, 0, 10, STACK),
        TraceEvent("alloc", 0x7F00_0000_0000, 4 * MiB - 100, 0, 11, STACK),
        TraceEvent("oom", 5 * MiB, 30 * MiB, 0, 12),
        TraceEvent("alloc", 0x7F00_0040_0000, 2 * MiB, 0, None, (), (("user_metadata", "x"),)),
    ),
    2: (TraceEvent("segment_alloc", 0x10_0000, 2 * MiB, 9, 13),),
}
SETTINGS = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128", "max_split_size": 128 * MiB}


def test_round_trip(tmp_path):
    """load_snapshot(write_snapshot(...)) gives back the segments, traces and settings."""
    path = write_snapshot(tmp_path / "s.pickle", SEGMENTS, TRACES, SETTINGS, {"run": 1})
    snap = load_snapshot(path)
    assert snap.format_generation == "device-traces+settings+annotations"
    assert snap.source == str(path)
    assert snap.devices() == [0, 2]
    assert snap.device_traces == {0: TRACES[0], 1: (), 2: TRACES[2]}
    assert snap.allocator_settings == SETTINGS
    assert snap.user_metadata == {"run": 1}
    for raw, seg in zip(SEGMENTS, snap.segments, strict=True):
        assert (seg.device, seg.address, seg.total_size, seg.stream) == (
            raw["device"],
            raw["address"],
            raw["total_size"],
            raw["stream"],
        )
        assert (seg.allocated_size, seg.active_size, seg.requested_size) == (
            raw["allocated_size"],
            raw["active_size"],
            raw["requested_size"],
        )
        assert [(b.address, b.size, b.requested_size, b.state) for b in seg.blocks] == [
            (b["address"], b["size"], b["requested_size"], b["state"]) for b in raw["blocks"]
        ]


def test_written_file_is_plain_torch_shaped_data(tmp_path):
    """The pickle is a plain dict with PyTorch's keys; the oom entry carries device_free."""
    path = write_snapshot(tmp_path / "s.pickle", SEGMENTS, TRACES, SETTINGS)
    data = load_plain_pickle(path.read_bytes(), "s")
    assert set(data) == {"segments", "device_traces", "allocator_settings", "external_annotations"}
    assert len(data["device_traces"]) == 3
    oom = data["device_traces"][0][2]
    assert oom["device_free"] == 5 * MiB and "addr" not in oom
    assert set(data["segments"][0]) >= {
        "device",
        "address",
        "total_size",
        "stream",
        "segment_type",
        "segment_pool_id",
        "allocated_size",
        "active_size",
        "requested_size",
        "is_expandable",
        "frames",
        "blocks",
    }


def test_snapshot_segments_write_back_unchanged(tmp_path):
    """SnapshotSegment records (from a loaded file) can be written and read back equal."""
    first = load_snapshot(write_snapshot(tmp_path / "a.pickle", SEGMENTS, TRACES))
    second = load_snapshot(
        write_snapshot(tmp_path / "b.pickle", first.segments, first.device_traces)
    )
    assert second.segments == first.segments
    assert second.device_traces == first.device_traces


def test_sums_are_computed_when_absent():
    """Missing allocated/active/requested sizes are summed from the blocks."""
    seg = {
        "address": 0,
        "total_size": 6,
        "blocks": [
            {"address": 0, "size": 2, "requested_size": 1, "state": "active_allocated"},
            {"address": 2, "size": 4, "requested_size": 3, "state": "active_pending_free"},
        ],
    }
    (out,) = snapshot_to_data([seg], [])["segments"]
    assert (out["allocated_size"], out["active_size"], out["requested_size"]) == (2, 6, 4)


def test_allocator_snapshot_shape_round_trips(tmp_path):
    """CachingAllocator.snapshot() output writes and loads with the same blocks."""
    alloc = CachingAllocator()
    ptr = alloc.malloc(1000)
    alloc.malloc(5 * MiB)
    alloc.free(ptr)
    segments = alloc.snapshot()
    snap = load_snapshot(write_snapshot(tmp_path / "a.pickle", segments, {0: []}))
    assert [(s.address, s.total_size, s.segment_type) for s in snap.segments] == [
        (s["address"], s["total_size"], s["segment_type"]) for s in segments
    ]
    assert [[(b.address, b.size, b.state) for b in s.blocks] for s in snap.segments] == [
        [(b["address"], b["size"], b["state"]) for b in s["blocks"]] for s in segments
    ]


def test_plain_pickle_dump_is_used(tmp_path):
    """The file is readable with the standard pickle module too (it is the writer's own file)."""
    path = write_snapshot(tmp_path / "s.pickle", [], {0: []})
    with open(path, "rb") as f:
        assert pickle.load(f) == {"segments": [], "device_traces": [[]], "external_annotations": []}

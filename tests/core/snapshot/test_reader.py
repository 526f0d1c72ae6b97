"""Tests for reading every snapshot generation into normalised records."""

import pickle

import pytest

import oomkit.core.snapshot as snapshot_pkg
from oomkit.core.snapshot import Snapshot, SnapshotBlock, infer_torch_version, load_snapshot
from oomkit.core.trace import Frame, TraceEvent
from oomkit.errors import SnapshotFormatError

MiB = 2**20
FRAMES = [{"filename": "model.py", "line": 12, "name": "forward"}]


def _load(data, protocol=4):
    return load_snapshot(pickle.dumps(data, protocol=protocol))


def test_every_public_name_imports():
    """Every name in oomkit.core.snapshot.__all__ exists."""
    for name in snapshot_pkg.__all__:
        assert hasattr(snapshot_pkg, name), name


def test_bare_list_of_old_segments():
    """A bare list (<= 1.13) loads: addresses inferred, requested = size, stream 0, type from size."""
    data = [
        {
            "device": 0,
            "address": 0x1000_0000,
            "total_size": 2 * MiB,
            "allocated_size": 512,
            "active_size": 512,
            "blocks": [
                {"size": 512, "state": "active_allocated"},
                {"size": 2 * MiB - 512, "state": "inactive"},
            ],
        },
        {
            "device": 0,
            "address": 0x2000_0000,
            "total_size": 20 * MiB,
            "allocated_size": 0,
            "active_size": 0,
            "blocks": [{"size": 20 * MiB, "state": "inactive"}],
        },
    ]
    snap = _load(data, protocol=2)
    assert snap.format_generation == "list-of-segments"
    small, large = snap.segments
    assert [b.address for b in small.blocks] == [0x1000_0000, 0x1000_0000 + 512]
    assert small.blocks[0] == SnapshotBlock(0x1000_0000, 512, 512, "active_allocated", ())
    assert (small.segment_type, large.segment_type) == ("small", "large")
    assert (small.stream, small.is_expandable, small.requested_size) == (0, False, 512)
    assert snap.device_traces == {}
    assert snap.allocator_settings is None
    assert infer_torch_version(snap) == "1.13"
    assert snap.warnings and "inferred" in snap.warnings[0]


def test_blocks_with_history_2_0():
    """2.0-era blocks with history and no address: frames and requested size come from history."""
    data = {
        "segments": [
            {
                "device": 0,
                "address": 4096 * 1000,
                "total_size": 4 * MiB,
                "allocated_size": 3 * MiB,
                "active_size": 3 * MiB,
                "requested_size": 3 * MiB - 5,
                "stream": 0,
                "segment_type": "large",
                "blocks": [
                    {
                        "size": 3 * MiB,
                        "requested_size": 3 * MiB - 5,
                        "state": "active_allocated",
                        "history": [
                            {"addr": 4096 * 1000, "real_size": 3 * MiB - 5, "frames": FRAMES}
                        ],
                    },
                    {"size": MiB, "requested_size": MiB, "state": "inactive"},
                ],
            },
        ],
        # A free whose request fell before the window, of a block inside the segment.
        "device_traces": [
            [{"action": "free_completed", "addr": 4096 * 1000 + 3 * MiB, "size": 8, "stream": 0}]
        ],
    }
    snap = _load(data)
    assert snap.format_generation == "segments-with-history"
    (seg,) = snap.segments
    assert seg.blocks[0].frames == (Frame("model.py", 12, "forward"),)
    assert seg.blocks[1].address == 4096 * 1000 + 3 * MiB
    assert snap.device_traces == {
        0: (TraceEvent("free_completed", 4096 * 1000 + 3 * MiB, 8, 0, None),)
    }
    assert infer_torch_version(snap) == "2.0"


def _modern(**extra):
    data = {
        "segments": [
            {
                "device": 1,
                "address": 300,
                "total_size": 20 * MiB,
                "allocated_size": 0,
                "active_size": 0,
                "requested_size": 0,
                "stream": 77,
                "segment_type": "large",
                "segment_pool_id": (1, 2),
                "is_expandable": True,
                "frames": FRAMES,
                "blocks": [
                    {
                        "address": 300,
                        "size": 20 * MiB,
                        "requested_size": 4,
                        "state": "active_awaiting_free",
                        "frames": FRAMES,
                    }
                ],
            },
            {
                "device": 0,
                "address": 100,
                "total_size": 2 * MiB,
                "allocated_size": 0,
                "active_size": 0,
                "requested_size": 0,
                "stream": 0,
                "segment_type": "small",
                "segment_pool_id": (0, 0),
                "is_expandable": False,
                "frames": [],
                "blocks": [
                    {
                        "address": 100,
                        "size": 2 * MiB,
                        "requested_size": 0,
                        "state": "inactive",
                        "frames": [],
                    }
                ],
            },
        ],
        "device_traces": [
            [{"action": "snapshot", "addr": 0, "size": 0, "stream": 0, "time_us": 1}],
            [
                {
                    "action": "segment_map",
                    "addr": 300,
                    "size": 20 * MiB,
                    "stream": 77,
                    "time_us": 5,
                    "frames": FRAMES,
                },
                {
                    "action": "oom",
                    "device_free": 1234,
                    "size": 40 * MiB,
                    "stream": 77,
                    "time_us": 6,
                    "frames": [],
                },
                {
                    "action": "segment_unmap",
                    "addr": 300,
                    "size": 2 * MiB,
                    "stream": 77,
                    "time_us": 7,
                },
            ],
        ],
    }
    data.update(extra)
    return data


def test_device_traces_several_devices_and_streams():
    """A newer dict: per-device traces, oom device_free, map/unmap, pool ids and streams."""
    snap = _load(_modern())
    assert snap.format_generation == "device-traces"
    assert snap.devices() == [0, 1]
    assert [s.address for s in snap.segments_for(1)] == [300]
    seg = snap.segments_for(1)[0]
    assert (seg.stream, seg.pool_id, seg.is_expandable) == (77, (1, 2), True)
    assert seg.blocks[0].state == "active_pending_free"
    trace = snap.trace_for(1)
    assert [e.action for e in trace] == ["segment_map", "oom", "segment_unmap"]
    assert trace[1].address == 1234 and trace[1].size == 40 * MiB
    assert trace[0].frames is seg.frames  # interned: one tuple per distinct stack
    assert snap.trace_for(5) == ()
    assert infer_torch_version(snap) == "2.1"


def test_settings_annotations_and_metadata():
    """allocator_settings, external_annotations and user_metadata are kept; generation says so."""
    settings = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "expandable_segments": True}
    annotations = [{"stage": "START", "name": "step", "device": 0, "time_us": 3}]
    snap = _load(
        _modern(
            allocator_settings=settings,
            external_annotations=annotations,
            user_metadata={"run": "a"},
        )
    )
    assert snap.format_generation == "device-traces+settings+annotations"
    assert snap.allocator_settings == settings
    assert snap.external_annotations == tuple(annotations)
    assert snap.user_metadata == {"run": "a"}
    assert infer_torch_version(snap) == "2.5"
    only_settings = _load(_modern(allocator_settings=settings))
    assert only_settings.format_generation == "device-traces+settings"
    assert infer_torch_version(only_settings) == "2.3"


def test_entry_extras_become_tags_and_annotate_passes_through():
    """compile_context/user_metadata become tags ("N/A" and "" dropped); annotate is kept."""
    data = _modern()
    data["device_traces"][0] = [
        {
            "action": "alloc",
            "addr": 100,  # inside device 0's segment
            "size": 2,
            "stream": 0,
            "time_us": 1,
            "compile_context": "N/A",
            "user_metadata": "",
        },
        {
            "action": "annotate",
            "addr": 1,
            "size": 2,
            "stream": 0,
            "time_us": 2,
            "compile_context": "graph 3",
            "user_metadata": "phase=fwd",
        },
    ]
    snap = _load(data)
    first, second = snap.trace_for(0)
    assert first.tags == ()
    assert second.tags == (("compile_context", "graph 3"), ("user_metadata", "phase=fwd"))
    assert infer_torch_version(snap) is None  # annotate: newest release


# PyTorch's trace entry actions (ref §11.2 table; CUDACachingAllocator.h TraceEntry::Action).
PYTORCH_ACTIONS = (
    "alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
    "segment_map", "segment_unmap", "oom", "snapshot", "annotate",
)


def test_every_pytorch_trace_action_is_known():
    """A trace holding each of PyTorch's actions loads with them all, in order, and no warning
    that oomkit does not know one (an unknown action is warned of and skipped by the replay)."""
    data = _modern()
    data["device_traces"][0] = [
        {"action": action, "addr": 1, "size": 2, "stream": 0, "time_us": i}
        for i, action in enumerate(PYTORCH_ACTIONS)
    ]
    snap = _load(data)
    assert [e.action for e in snap.trace_for(0)] == list(PYTORCH_ACTIONS)
    assert not [w for w in snap.warnings if "does not know" in w]


def test_devices_ignores_snapshot_only_traces():
    """A device whose trace has only 'snapshot' markers and no segments is not listed."""
    data = _modern()
    data["segments"] = [s for s in data["segments"] if s["device"] == 1]
    assert _load(data).devices() == [1]


def test_snapshot_is_frozen():
    """Snapshot records cannot be modified."""
    snap = _load(_modern())
    with pytest.raises(AttributeError):
        snap.segments = ()  # type: ignore[misc]
    assert isinstance(snap, Snapshot)


@pytest.mark.parametrize(
    "data, message",
    [
        ({"segments": "x"}, r"without a 'segments' list"),
        ({"segments": [1]}, r"segment 0 is a int, not a dict"),
        ({"segments": [{"address": 1}]}, r"segment 0 has no 'total_size'"),
        (
            {
                "segments": [
                    {"address": 1, "total_size": 2, "blocks": [{"size": 2, "state": "odd"}]}
                ]
            },
            r"segment 0 block 0: unknown block state 'odd'",
        ),
        ({"segments": [], "device_traces": {"0": []}}, r"'device_traces' is not a list"),
        (
            {"segments": [], "device_traces": [[{"addr": 1}]]},
            r"device_traces\[0\]\[0\] has no 'action'",
        ),
        ({"segments": [], "allocator_settings": "x"}, r"'allocator_settings' is not a dict"),
        ("hello", r"the pickle holds a str"),
    ],
)
def test_malformed_structures_are_refused(data, message):
    """Structures that are not snapshots are refused with a message naming the bad part."""
    with pytest.raises(SnapshotFormatError, match=message + r".*not a valid memory snapshot"):
        _load(data)

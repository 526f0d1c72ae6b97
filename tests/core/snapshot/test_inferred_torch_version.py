"""infer_torch_version reads the actions the reader noted (Snapshot.other_actions) as it would
read them from the traces (issue 41: a replay no longer scans every event for them)."""

import dataclasses
import pickle

from hypothesis import given, settings
from hypothesis import strategies as st

from oomkit.core.snapshot import Snapshot, infer_torch_version, load_snapshot
from oomkit.core.snapshot._validate import KNOWN_ACTIONS
from oomkit.core.trace import TraceEvent

MiB = 2**20
REQUESTS = ("alloc", "free_requested", "free_completed")


def _segment(device: int) -> dict:
    return {
        "device": device,
        "address": 100 * MiB * (device + 1),
        "total_size": 20 * MiB,
        "allocated_size": 0,
        "active_size": 0,
        "requested_size": 0,
        "stream": 0,
        "segment_type": "large",
        "segment_pool_id": (0, 0),
        "is_expandable": False,
        "frames": [],
        "blocks": [{"address": 100 * MiB * (device + 1), "size": 20 * MiB, "requested_size": 0,
                    "state": "inactive"}],
    }


def _entries(device: int, actions: list[str], time_us: bool) -> list[dict]:
    """The actions in order; each request action is a whole block life (alloc, free_requested,
    free_completed) at its own address inside the device's segment, so the trace is
    consistent."""
    out = []
    for k, action in enumerate(actions):
        base = 100 * MiB * (device + 1) + 4096 * k
        names = REQUESTS if action in REQUESTS else (action,)
        for name in names:
            entry = {"action": name, "addr": base, "size": 512, "stream": 0}
            if time_us:
                entry["time_us"] = k
            out.append(entry)
    return out


@settings(max_examples=150, deadline=None)
@given(
    traces=st.lists(st.lists(st.sampled_from(sorted(KNOWN_ACTIONS)), max_size=12), max_size=3),
    with_settings=st.booleans(),
    time_us=st.booleans(),
)
def test_noted_actions_give_the_version_the_traces_give(traces, with_settings, time_us):
    """Every device's non-request actions are noted, and the version inferred from them is the
    version inferred from the traces themselves (the snapshot with nothing noted)."""
    data: dict = {
        "segments": [_segment(device) for device in range(len(traces))],
        "device_traces": [_entries(d, actions, time_us) for d, actions in enumerate(traces)],
    }
    if with_settings:
        data["allocator_settings"] = {"PYTORCH_CUDA_ALLOC_CONF": ""}
    snap = load_snapshot(pickle.dumps(data, protocol=4))
    every = {ev.action for events in snap.device_traces.values() for ev in events}
    assert snap.other_actions == every - set(REQUESTS)
    unnoted = dataclasses.replace(snap, other_actions=None)
    assert infer_torch_version(snap) == infer_torch_version(unnoted)


def test_an_action_on_another_device_decides_as_the_scan_does():
    """segment_map on device 1 only, no key pointing later: 2.1, noted or scanned; annotate on
    device 1 overrides allocator_settings: the newest release (None)."""
    data = {
        "segments": [_segment(0), _segment(1)],
        "device_traces": [_entries(0, ["alloc"], False), _entries(1, ["segment_map"], False)],
    }
    snap = load_snapshot(pickle.dumps(data, protocol=4))
    assert snap.other_actions == frozenset({"segment_map"})
    assert infer_torch_version(snap) == "2.1"
    data["device_traces"][1] = _entries(1, ["annotate"], False)
    data["allocator_settings"] = {"PYTORCH_CUDA_ALLOC_CONF": ""}
    snap = load_snapshot(pickle.dumps(data, protocol=4))
    assert snap.other_actions == frozenset({"annotate"})
    assert infer_torch_version(snap) is None
    assert infer_torch_version(dataclasses.replace(snap, other_actions=None)) is None


def test_a_snapshot_built_otherwise_is_read_from_its_traces():
    """A Snapshot made directly notes nothing (None): its traces are read."""
    events = (TraceEvent("segment_unmap", 0, 2 * MiB), TraceEvent("alloc", 0, 512))
    built = Snapshot(segments=(), device_traces={0: events})
    assert built.other_actions is None
    assert infer_torch_version(built) == "2.1"
    annotated = Snapshot(segments=(), device_traces={3: (TraceEvent("annotate", 0, 0),)})
    assert infer_torch_version(annotated) is None

"""oomkit.watch(): history recording, the snapshot at the OOM and its diagnosis, on CPU."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oomkit.core.snapshot import load_snapshot, write_snapshot
from oomkit.core.trace import TraceEvent
from oomkit.errors import OomkitError
from oomkit.runtime.simulated import SimulatedCudaDevice
from oomkit.runtime.watch import (
    MemoryRecorder,
    ObservedOom,
    SimulatedDeviceRecorder,
    TorchCudaRecorder,
    Watch,
    default_recorder,
    diagnose_dump,
    verdict_line,
    watch,
)

MiB = 2**20
OOM_TEXT = (
    "CUDA out of memory. Tried to allocate 300.00 MiB. GPU 0 has a total capacity of 1.00 GiB "
    "of which 124.00 MiB is free. Of the allocated memory 900.00 MiB is allocated by PyTorch, "
    "and 0 bytes is reserved by PyTorch but unallocated."
)


def _segment(address):
    block = {
        "address": address,
        "size": 300 * MiB,
        "requested_size": 300 * MiB,
        "state": "active_allocated",
    }
    return {"device": 0, "address": address, "total_size": 300 * MiB, "blocks": [block]}


# What OOM_TEXT describes: three 300 MiB tensors live, a fourth refused with 124 MiB free.
SEGMENTS = [_segment(k * 2**30) for k in (1, 2, 3)]
TRACE = [
    *(
        ev
        for k in (1, 2, 3)
        for ev in (
            TraceEvent("segment_alloc", k * 2**30, 300 * MiB),
            TraceEvent("alloc", k * 2**30, 300 * MiB),
        )
    ),
    TraceEvent("oom", 124 * MiB, 300 * MiB),
]


class FakeRecorder:
    """Stands in for torch.cuda: logs calls; ``oom()`` calls the observers, then raises."""

    def __init__(self, *, fail_dump: bool = False, garbage: bool = False) -> None:
        self.calls: list[tuple] = []
        self.observers: list = []
        self.fail_dump = fail_dump
        self.garbage = garbage

    def gpu_spec(self, device):
        return None

    def record_history(self, max_entries, context):
        self.calls.append(("record", max_entries, context))

    def stop(self):
        self.calls.append(("stop",))

    def attach_oom_observer(self, observer):
        self.observers.append(observer)
        return lambda: self.observers.remove(observer)

    def dump_snapshot(self, path):
        self.calls.append(("dump", Path(path).name))
        if self.fail_dump:
            raise OSError("disk full")
        if self.garbage:
            Path(path).write_bytes(b"\x80\x04not a pickle")
        else:
            write_snapshot(path, SEGMENTS, {0: TRACE})

    def oom(self, requested=300 * MiB):
        for observer in list(self.observers):
            observer(0, requested, 1024 * MiB, 124 * MiB)
        raise torch.OutOfMemoryError(OOM_TEXT)


def test_fake_is_a_recorder():
    """The test fake, the real recorder class and the simulated one satisfy the seam."""
    assert isinstance(FakeRecorder(), MemoryRecorder)
    assert isinstance(SimulatedDeviceRecorder(object()), MemoryRecorder)
    assert issubclass(TorchCudaRecorder, object) and hasattr(TorchCudaRecorder, "dump_snapshot")


def test_records_while_active_and_stops_on_exit(tmp_path):
    """Entering starts history with max_entries and context; leaving stops it and detaches."""
    fake = FakeRecorder()
    with watch(snapshot_dir=tmp_path, max_entries=500, recorder=fake) as w:
        assert fake.calls == [("record", 500, "alloc")]
        assert len(fake.observers) == 1
    assert fake.calls == [("record", 500, "alloc"), ("stop",)]
    assert fake.observers == []
    assert w.snapshot_path is None and w.diagnosis is None and w.ooms == []
    assert list(tmp_path.iterdir()) == []


def test_oom_writes_snapshot_and_diagnoses(tmp_path):
    """An OOM leaving the block: one snapshot, the observer's figures, a diagnosis and a note."""
    fake = FakeRecorder()
    w = watch(snapshot_dir=tmp_path / "snaps", recorder=fake)
    with pytest.raises(torch.OutOfMemoryError) as info, w:
        fake.oom()
    expected = tmp_path / "snaps" / w.snapshot_path.name
    assert w.snapshot_path == expected and expected.is_file()
    assert expected.name.startswith(f"oom_{os.getpid()}_")
    assert len(load_snapshot(expected).segments) == 3
    assert [p.name for p in (tmp_path / "snaps").iterdir()] == [expected.name]
    assert w.ooms == [ObservedOom(0, 300 * MiB, 1024 * MiB, 124 * MiB, expected)]
    assert w.diagnosis.cause == "shortage" and w.diagnosis.source == "snapshot"
    assert w.diagnosis.figures_bytes["allocated_bytes"] == 900 * MiB
    assert w.diagnosis.figures_bytes["requested_bytes"] == 300 * MiB
    assert fake.calls == [
        ("record", 100_000, "alloc"),
        ("dump", expected.name + ".partial"),
        ("stop",),
    ]
    (note,) = info.value.__notes__
    assert note.startswith("oomkit: cause shortage: tensors held 900.00 MiB")
    assert f"snapshot at the OOM: {expected}" in note


def test_oom_is_logged(tmp_path, caplog):
    """The verdict goes to the oomkit.runtime.watch logger at WARNING, never to stdout."""
    fake = FakeRecorder()
    with caplog.at_level(logging.WARNING, "oomkit.runtime.watch"):
        with pytest.raises(torch.OutOfMemoryError), watch(snapshot_dir=tmp_path, recorder=fake):
            fake.oom()
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert record.getMessage().startswith("oomkit: cause shortage")


def test_caught_oom_keeps_snapshot_without_diagnosis(tmp_path):
    """A caught OOM is dumped and counted, but nothing is diagnosed when none escapes."""
    fake = FakeRecorder()
    with watch(snapshot_dir=tmp_path, recorder=fake) as w:
        for _ in range(3):
            try:
                fake.oom(requested=64 * MiB)
            except torch.OutOfMemoryError:
                pass
    assert [o.requested_bytes for o in w.ooms] == [64 * MiB] * 3
    assert len(list(tmp_path.iterdir())) == 1  # each OOM overwrote the same file
    assert w.snapshot_path is not None and w.diagnosis is None


def test_other_exceptions_pass_through_undiagnosed(tmp_path):
    """A non-OOM error propagates untouched; recording still stops."""
    fake = FakeRecorder()
    with pytest.raises(KeyError, match="x"), watch(snapshot_dir=tmp_path, recorder=fake) as w:
        raise KeyError("x")
    assert fake.calls[-1] == ("stop",)
    assert w.diagnosis is None and w.snapshot_path is None


def test_failed_dump_never_replaces_the_oom(tmp_path):
    """A snapshot that cannot be written leaves the OOM intact, diagnosed from its message."""
    fake = FakeRecorder(fail_dump=True)
    with pytest.raises(torch.OutOfMemoryError), watch(snapshot_dir=tmp_path, recorder=fake) as w:
        fake.oom()
    assert w.error == f"could not write the OOM snapshot to {tmp_path}: disk full"
    assert w.ooms[0].snapshot_path is None
    assert w.diagnosis is not None and w.diagnosis.cause == "shortage"


def test_unreadable_snapshot_falls_back_to_the_message(tmp_path):
    """A snapshot that cannot be read is diagnosed from the error text, with a warning."""
    fake = FakeRecorder(garbage=True)
    with pytest.raises(torch.OutOfMemoryError), watch(snapshot_dir=tmp_path, recorder=fake) as w:
        fake.oom()
    assert w.diagnosis.cause == "shortage" and w.diagnosis.source == "text"
    assert w.diagnosis.warnings[-1].startswith(f"the snapshot {w.snapshot_path} could not be")
    assert w.diagnosis.warnings[-1].endswith("; diagnosed from the message")


def test_decorator_forms(tmp_path):
    """@watch(...) wraps every call; the Watch is reachable as fn.watch; results refresh per call."""
    fake = FakeRecorder()

    @watch(snapshot_dir=tmp_path, max_entries=10, recorder=fake)
    def step(fail):
        if fail:
            fake.oom()
        return "ok"

    assert step(False) == "ok"
    assert isinstance(step.watch, Watch) and step.watch.snapshot_path is None
    with pytest.raises(torch.OutOfMemoryError):
        step(True)
    assert step.watch.diagnosis.cause == "shortage"
    assert step(False) == "ok"
    assert step.watch.diagnosis is None  # a new call starts clean
    assert fake.calls.count(("record", 10, "alloc")) == 3


def test_bare_decorator_without_gpu_records_nothing(caplog):
    """@oomkit.watch with no CUDA and no simulated device runs the function and warns once."""

    @watch
    def f():
        return 7

    with caplog.at_level(logging.WARNING, "oomkit.runtime.watch"):
        assert f() == 7
    assert [r.getMessage() for r in caplog.records] == [
        "oomkit.watch: no CUDA device; nothing is recorded"
    ]


def test_recursive_call_is_one_watch(tmp_path):
    """A decorated function that calls itself records once and stops once."""
    fake = FakeRecorder()

    @watch(snapshot_dir=tmp_path, recorder=fake)
    def depth(n):
        return 0 if n == 0 else 1 + depth(n - 1)

    assert depth(3) == 3
    assert fake.calls == [("record", 100_000, "alloc"), ("stop",)]


def test_nested_watches_share_one_recording(tmp_path):
    """Only the outermost watch starts/stops history; the inner one dumps; the outer adopts it."""
    fake = FakeRecorder()
    with pytest.raises(torch.OutOfMemoryError) as info:
        with watch(snapshot_dir=tmp_path / "outer", recorder=fake) as outer:
            with watch(snapshot_dir=tmp_path / "inner", recorder=fake) as inner:
                fake.oom()
    assert fake.calls == [
        ("record", 100_000, "alloc"),
        ("dump", inner.snapshot_path.name + ".partial"),
        ("stop",),
    ]
    assert inner.snapshot_path.parent == tmp_path / "inner"
    assert outer.snapshot_path == inner.snapshot_path
    assert outer.diagnosis is inner.diagnosis
    assert outer.ooms[0].snapshot_path is None and len(outer.ooms) == 1
    assert len(info.value.__notes__) == 1


def test_bad_arguments():
    """max_entries below 1 and an unknown context are refused with an example."""
    with pytest.raises(OomkitError, match=r"max_entries must be a positive.*got 0"):
        watch(max_entries=0)
    with pytest.raises(OomkitError, match="context must be 'alloc'"):
        watch(context="state")


@settings(max_examples=25, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=6))
def test_one_snapshot_per_watch(tmp_path_factory, caught):
    """Whatever the OOMs caught inside, one watch leaves at most one snapshot, all counted."""
    directory = tmp_path_factory.mktemp("snaps")
    fake = FakeRecorder()
    with watch(snapshot_dir=directory, recorder=fake) as w:
        for oom in caught:
            if oom:
                with pytest.raises(torch.OutOfMemoryError):
                    fake.oom()
    assert len(w.ooms) == sum(caught)
    assert len(list(directory.iterdir())) == (1 if any(caught) else 0)
    assert fake.observers == []


def test_simulated_device_end_to_end(tmp_path):
    """Under SimulatedCudaDevice the real allocator's OOM is dumped, loadable and diagnosed."""
    with pytest.raises(torch.OutOfMemoryError):
        with SimulatedCudaDevice(
            "1GiB", context_overhead_bytes=0, record_history=True, max_entries=1000
        ):
            with watch(snapshot_dir=tmp_path) as w:
                keep = [torch.empty(300 * MiB, dtype=torch.uint8) for _ in range(4)]
                del keep
    # Three 300 MiB tensors fit in 1 GiB; the fourth needs 300 MiB with 124 MiB free.
    assert w.ooms == [ObservedOom(0, 300 * MiB, 1024 * MiB, 124 * MiB, w.snapshot_path)]
    snap = load_snapshot(w.snapshot_path)
    assert sum(s.allocated_size for s in snap.segments) == 900 * MiB
    actions = [e.action for e in snap.trace_for(0)]
    assert actions.count("alloc") == 3 and actions[-1] == "oom"
    assert w.diagnosis.cause == "shortage" and w.diagnosis.source == "snapshot"
    assert w.gpu.total_memory_bytes == 2**30  # the simulated device's GpuSpec
    (site,) = w.diagnosis.attribution.top_sites
    assert (Path(site.filename).name, site.live_bytes) == ("test_watch.py", 900 * MiB)


def test_default_recorder_follows_the_device():
    """No GPU: None; a simulated device installed: its recorder."""
    assert default_recorder() is None
    with SimulatedCudaDevice("1GiB", context_overhead_bytes=0) as device:
        recorder = default_recorder()
    assert isinstance(recorder, SimulatedDeviceRecorder) and recorder.device is device


def test_torch_recorder_calls(monkeypatch):
    """The real recorder: string API (python stacks), enabled=None to stop, one dispatcher."""
    calls = []
    attached = []
    monkeypatch.setattr(
        torch.cuda.memory, "_record_memory_history", lambda *a, **k: calls.append((a, k))
    )
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda p: calls.append(("dump", p)))
    monkeypatch.setattr(
        torch._C, "_cuda_attach_out_of_memory_observer", attached.append, raising=False
    )
    monkeypatch.setattr(TorchCudaRecorder, "_observers", [])
    monkeypatch.setattr(TorchCudaRecorder, "_dispatcher_attached", False)
    rec = TorchCudaRecorder()
    rec.record_history(1234, "all")
    rec.stop()
    rec.dump_snapshot(Path("/x/s.pickle"))
    assert calls == [
        ((), {"enabled": "all", "context": "all", "stacks": "python", "max_entries": 1234}),
        ((), {"enabled": None}),
        ("dump", "/x/s.pickle"),
    ]
    seen = []
    detach_a = rec.attach_oom_observer(lambda *a: seen.append(("a", a)))
    TorchCudaRecorder().attach_oom_observer(lambda *a: seen.append(("b", a)))
    assert len(attached) == 1  # PyTorch cannot detach observers: one dispatcher per process
    detach_a()
    attached[0](0, 2, 3, 4)
    assert seen == [("b", (0, 2, 3, 4))]


def test_torch_recorder_legacy_signature(monkeypatch):
    """torch 2.0's boolean signature is used when the string one is refused."""
    calls = []

    def legacy(
        enabled,
        record_context=True,
        trace_alloc_max_entries=1,
        trace_alloc_record_context=False,
        device=None,
        record_context_cpp=False,
    ):
        calls.append((enabled, trace_alloc_max_entries, trace_alloc_record_context))

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", legacy)
    rec = TorchCudaRecorder()
    rec.record_history(99, "alloc")
    rec.stop()
    assert calls == [(True, 99, True), (False, 1, False)]


def test_diagnose_dump_needs_something():
    """No snapshot and no message is a clear error; a message alone is diagnosed."""
    with pytest.raises(OomkitError, match="no snapshot and no error message"):
        diagnose_dump(None, None)
    assert diagnose_dump(None, OOM_TEXT).cause == "shortage"


def test_verdict_line_without_diagnosis(tmp_path):
    """With only a snapshot the line still says where it is and how to explain it."""
    path = tmp_path / "s.pickle"
    assert verdict_line(None, path) == (
        f"oomkit: snapshot at the OOM: {path} (oomkit explain {path})"
    )
    assert verdict_line(None, None) is None

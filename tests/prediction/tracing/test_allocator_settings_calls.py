"""``torch.cuda.memory._set_allocator_settings(text)`` in a recorded step: replayed at its point.

PyTorch updates its live allocator's settings from the call on (c10/core/AllocatorConfig.cpp
``setAllocatorSettings`` -> ``parseArgs``): the step's own reads of the counters and the
report's replay both apply it where the step made it (an ``allocator_settings`` trace event).
It had been noted and not replayed, though oomkit's own remedies advise the call
(``diagnose/diagnosis.py``: ``_set_allocator_settings("expandable_segments:True")`` before the
first CUDA allocation).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oomkit.core.allocator import CachingAllocator
from oomkit.core.gpus import GpuSpec
from oomkit.core.replay.engine import ReplayEngine
from oomkit.core.replay.hooks import ReplayHooks
from oomkit.core.snapshot.reader import load_snapshot
from oomkit.core.target import Target
from oomkit.core.trace import TraceEvent
from oomkit.errors import SnapshotFormatError, TraceFormatError
from oomkit.prediction.predictor import predict, predict_recording
from oomkit.prediction.tracing.step_runner import trace_step

MiB = 2**20
TARGET = Target.resolve(GpuSpec("test GPU", 1024 * MiB, 0))


def _step(first: str | None, read: list[int]) -> None:
    """15 MiB freed, then 25 MiB, then (expandable segments turned off) 25 MiB more."""
    if first is not None:
        torch.cuda.memory._set_allocator_settings(first)
    x = torch.empty(15 * MiB, dtype=torch.uint8, device="cuda")
    del x
    y = torch.empty(25 * MiB, dtype=torch.uint8, device="cuda")
    read.append(torch.cuda.memory_reserved())
    torch.cuda.memory._set_allocator_settings("expandable_segments:False")
    z = torch.empty(25 * MiB, dtype=torch.uint8, device="cuda")
    read.append(torch.cuda.memory_reserved())
    del y, z


def test_a_call_before_the_first_allocation_changes_the_reads_and_the_replay():
    """Default settings: 15 MiB rounds to a 16 MiB segment (sizes over 10 MiB round up to
    2 MiB); its block is too small for 25 MiB, so a 26 MiB segment (42 MiB), then another
    26 MiB (68 MiB). With expandable segments turned on first: one segment mapped in 20 MiB
    pages (kLargeBuffer) holds 15 MiB, then grows to 40 MiB for 25 MiB; turned off, the
    last 25 MiB gets a 26 MiB segment of its own (66 MiB). The replay had kept the default
    (68 MiB) and said so."""
    default: list[int] = []
    plain = predict_recording(trace_step(lambda: _step(None, default), steps=1, target=TARGET), target=TARGET)
    expandable: list[int] = []
    recording = trace_step(lambda: _step("expandable_segments:True", expandable), steps=1, target=TARGET)
    turned_on = predict_recording(recording, target=TARGET)
    assert default == [42 * MiB, 68 * MiB]
    assert plain.peak_reserved_bytes == 68 * MiB
    assert expandable == [40 * MiB, 66 * MiB]
    assert turned_on.peak_reserved_bytes == 66 * MiB
    settings_events = [e for e in recording.events if e.action == "allocator_settings"]
    assert [e.tag("setting") for e in settings_events] == [
        "expandable_segments:True",
        "expandable_segments:False",
    ]


def test_a_call_the_target_s_pytorch_refuses_raises_in_the_step_and_changes_nothing():
    """An unknown key: PyTorch's TORCH_CHECK raises RuntimeError at the call; a step that
    catches it goes on with the settings it had (a 12 MiB request: a 12 MiB segment)."""
    raised: list[str] = []
    read: list[int] = []

    def step() -> None:
        try:
            torch.cuda.memory._set_allocator_settings("expandable_segment:True")
        except RuntimeError as exc:
            raised.append(str(exc))
        x = torch.empty(12 * MiB, dtype=torch.uint8, device="cuda")
        read.append(torch.cuda.memory_reserved())
        del x

    recording = trace_step(step, steps=1, target=TARGET)
    assert len(raised) == 1 and "expandable_segment" in raised[0]
    assert read == [12 * MiB]
    assert not [e for e in recording.events if e.action == "allocator_settings"]
    assert "torch.cuda allocator settings" not in recording.assumptions


def test_a_memory_fraction_in_the_target_s_setting_limits_the_usable_memory():
    """per_process_memory_fraction:0.5 in --alloc-conf is applied when the device allocator is
    created (ref §14): 512 MiB of the 1 GiB test GPU are usable, so 600 MiB do not fit. The
    verdict had said the whole GPU was usable."""

    def step() -> None:
        x = torch.empty(600 * MiB, dtype=torch.uint8, device="cuda")
        del x

    limited = Target.resolve(GpuSpec("test GPU", 1024 * MiB, 0), alloc_conf="per_process_memory_fraction:0.5")
    result = predict(step, steps=1, target=limited)
    assert (result.usable_bytes, result.fits) == (512 * MiB, False)
    assert predict(step, steps=1, target=TARGET).usable_bytes == 1024 * MiB


class _Strict(ReplayHooks):
    pass


def test_a_trace_s_settings_event_without_its_text_is_refused_as_damage():
    events = [TraceEvent("allocator_settings", 0, 0), TraceEvent("alloc", 1, 4096)]
    engine = ReplayEngine(CachingAllocator(None, capacity_bytes=1 << 30), _Strict())
    with pytest.raises(TraceFormatError, match="has no 'setting' tag"):
        engine.run(events)


def test_a_snapshot_entry_with_the_settings_action_is_refused(tmp_path):
    """A snapshot records its settings once, at its dump: an ``allocator_settings`` trace
    entry is not PyTorch's, so the snapshot reader refuses it as it refuses any unknown
    action."""
    import pickle

    data = {
        "segments": [],
        "device_traces": [[{"action": "allocator_settings", "addr": 0, "size": 0, "stream": 0, "frames": []}]],
    }
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(data))
    with pytest.raises(SnapshotFormatError, match="allocator_settings"):
        load_snapshot(path)


SETTINGS = st.sampled_from(
    [
        "expandable_segments:True",
        "expandable_segments:False",
        "max_split_size_mb:40",
        "roundup_power2_divisions:4",
        "garbage_collection_threshold:0.5",
    ]
)
# Each run starts with expandable segments turned on and a request of 1-48 MiB (from then on
# its reserved bytes differ from the default's for most sizes), then any mix.
REQUESTS = st.tuples(
    st.just(("set", "expandable_segments:True")),
    st.integers(min_value=MiB, max_value=48 * MiB).map(lambda n: ("alloc", n)),
).flatmap(
    lambda start: st.lists(
        st.one_of(
            st.integers(min_value=1, max_value=48 * MiB).map(lambda n: ("alloc", n)),
            st.integers(min_value=0, max_value=20).map(lambda k: ("free", k)),
            SETTINGS.map(lambda text: ("set", text)),
        ),
        max_size=25,
    ).map(lambda rest: [*start, *rest])
)


@settings(max_examples=25, deadline=None)
@given(REQUESTS)
def test_the_replay_is_the_allocator_updated_at_each_call(requests):
    """Any mix of requests, frees and settings calls: the prediction's peak reserved, and the
    step's last read of it, are those of a simulated allocator whose settings are updated
    (``set_allocator_settings``) at the same points."""
    allocator = CachingAllocator(None, capacity_bytes=1 << 40)
    addresses: list[int] = []
    for kind, value in requests:
        if kind == "alloc":
            addresses.append(allocator.malloc(value, 0))
        elif kind == "free" and addresses:
            allocator.free(addresses.pop(value % len(addresses)))
        elif kind == "set":
            allocator.set_allocator_settings(value)
    read: list[int] = []

    def step() -> None:
        live: list[torch.Tensor] = []
        for kind, value in requests:
            if kind == "alloc":
                live.append(torch.empty(value, dtype=torch.uint8, device="cuda"))
            elif kind == "free" and live:
                live.pop(value % len(live))
            elif kind == "set":
                torch.cuda.memory._set_allocator_settings(value)
        read.append(torch.cuda.max_memory_reserved())

    big = Target.resolve(GpuSpec("test GPU", 1 << 40, 0))
    result = predict_recording(trace_step(step, steps=1, target=big), target=big)
    assert read == [allocator.max_memory_reserved()]
    assert result.peak_reserved_bytes == allocator.max_memory_reserved()


def test_an_oom_raised_as_on_the_gpu_follows_the_settings_the_step_made():
    """On a 40 MiB GPU, with OOMs raised as on the GPU (``ooms_raised``), 2 MiB then 25 MiB:
    with the default settings the 2 MiB takes a 20 MiB segment (kLargeBuffer) and the 25 MiB
    a 26 MiB one (46 MiB; the first segment holds a live block, so freeing the cache cannot
    help): torch.OutOfMemoryError. With expandable segments turned on first, one segment
    grows to two 20 MiB pages (40 MiB): no error."""
    from oomkit.prediction.tracing.step_memory import ooms_raised

    def step(first: str | None, read: list[int]) -> None:
        if first is not None:
            torch.cuda.memory._set_allocator_settings(first)
        a = torch.empty(2 * MiB, dtype=torch.uint8, device="cuda")
        b = torch.empty(25 * MiB, dtype=torch.uint8, device="cuda")
        read.append(torch.cuda.memory_reserved())
        del a, b

    small = Target.resolve(GpuSpec("test GPU", 40 * MiB, 0))
    with ooms_raised() as raised, pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 26.00 MiB"):
        trace_step(lambda: step(None, []), steps=1, target=small)
    assert raised.count == 1
    read: list[int] = []
    with ooms_raised() as raised:
        trace_step(lambda: step("expandable_segments:True", read), steps=1, target=small)
    assert (raised.count, read) == (0, [40 * MiB])

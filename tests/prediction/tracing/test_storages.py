"""Storage lifetimes follow Python and autograd reference counting, as on a real GPU."""

from __future__ import annotations

import sys
import weakref

import torch

from oomkit.prediction.tracing import Tracer, TraceRecording


def _summary(recording: TraceRecording) -> list[tuple[str, int]]:
    return [(e.action, e.size) for e in recording.events if e.action != "free_completed"]


def test_meta_storage_finalizer_fires_when_the_last_reference_dies():
    """The installed torch preserves the storage PyObject, so finalize tracks the StorageImpl."""
    fired: list[int] = []
    t = torch.empty(10, device="meta")
    weakref.finalize(t.untyped_storage(), fired.append, 1)
    view = t[2:]
    del t
    assert fired == []
    del view
    assert fired == [1]


def test_a_view_allocates_nothing():
    """Views share their base's storage: one alloc, freed when the last alias dies."""
    with Tracer() as tracer:
        base = torch.empty(4, 256, device="meta")
        view = base.view(256, 4).t()[1:]
        del base
        del view
    assert _summary(tracer.recording) == [("alloc", 4096), ("free_requested", 4096)]


def test_zero_byte_tensors_allocate_nothing():
    """A tensor with no elements records no event at all."""
    with Tracer() as tracer:
        empty = torch.empty(0, 128, device="meta")
        del empty
    assert tracer.recording.events == ()


def test_list_keeps_a_tensor_alive_until_cleared():
    """The free comes when the list is cleared, after allocations made in between."""
    with Tracer() as tracer:
        keep = [torch.empty(256, device="meta")]
        other = torch.empty(8, device="meta")
        line = sys._getframe().f_lineno + 1
        keep.clear()
        last = torch.empty(16, device="meta")
    recording = tracer.recording
    assert _summary(recording) == [
        ("alloc", 1024),
        ("alloc", 32),
        ("free_requested", 1024),
        ("alloc", 64),
    ]
    free = recording.events[2]
    assert free.frames[0].line == line
    assert free.address == recording.events[0].address
    del other, last


def test_saved_output_is_freed_without_backward():
    """A saved output (sigmoid) dies with its graph; the pack hook adds no reference cycle."""
    x = torch.randn(64, device="meta", requires_grad=True)
    with Tracer() as tracer:
        tracer.track(x)
        y = x.sigmoid()
        z = y * 2
        del y
        mid = len(tracer._log)
        del z
        end = len(tracer._log)
    assert end - mid == 2  # y (saved by sigmoid's node) and z freed by `del z`
    saved = [e for e in tracer.recording.events if ("saved_for_backward", "true") in e.tags]
    assert [e.size for e in saved] == [256]


def test_saved_activation_lives_until_backward():
    """An intermediate saved by autograd is freed during backward, not when Python drops it."""
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    x = torch.randn(2, 8, device="meta")
    with Tracer() as tracer:
        tracer.track(model, x)
        loss = model(x).sum()
        before_backward = len(tracer._log)
        loss.backward()
    events = tracer.recording.events
    tanh_out = next(e for e in events if ("op", "aten.tanh.default") in e.tags)
    assert dict(tanh_out.tags)["category"] == "activation"
    frees = [
        i
        for i, e in enumerate(events)
        if e.action == "free_requested" and e.address == tanh_out.address
    ]
    assert len(frees) == 1
    # Event index of the free is after backward started (allocs/frees map 1:1 to log entries
    # except frees, which add one extra event each).
    backward_allocs = [i for i, e in enumerate(events) if ("phase", "backward") in e.tags]
    assert frees[0] > backward_allocs[0]
    assert before_backward < len(tracer._log)


def test_temporary_freed_inside_a_module():
    """An unsaved intermediate freed within the module call is a temporary."""

    class Block(torch.nn.Module):
        def forward(self, x):
            scratch = x + 1
            return scratch.sum(dim=0)

    x = torch.randn(4, 4, device="meta")
    with Tracer() as tracer:
        tracer.track(x)
        out = Block()(x)
    categories = [dict(e.tags)["category"] for e in tracer.recording.events if e.action == "alloc"]
    assert categories == ["input", "temporary", "activation"]
    del out


def test_resize_reallocates():
    """resize_ to a larger size allocates the new size and frees the old block."""
    with Tracer() as tracer:
        t = torch.empty(4, device="meta")
        t.resize_(64)
    assert _summary(tracer.recording) == [("alloc", 16), ("alloc", 256), ("free_requested", 16)]
    del t


def test_buffers_are_categorised():
    """A registered buffer is category buffer."""
    with Tracer() as tracer:
        with torch.device("meta"):
            norm = torch.nn.BatchNorm1d(32)
    assert tracer.recording.bytes_by_category == {"parameter": 2 * 128, "buffer": 2 * 128 + 8}
    del norm

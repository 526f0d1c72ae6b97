"""TraceRecording queries: filters, step slices and the peak."""

from __future__ import annotations

from oomkit.core.trace import TraceEvent
from oomkit.prediction.tracing import TraceRecording


def _alloc(address, size, category, phase="user"):
    return TraceEvent("alloc", address, size, tags=(("category", category), ("phase", phase)))


def _free(address, size):
    return (
        TraceEvent("free_requested", address, size),
        TraceEvent("free_completed", address, size),
    )


RECORDING = TraceRecording(
    events=(
        _alloc(1, 100, "parameter"),
        _alloc(2, 10, "activation", "forward"),
        *_free(2, 10),
        _alloc(3, 20, "activation", "forward"),
        _alloc(4, 5, "temporary", "backward"),
        *_free(4, 5),
    ),
    step_starts=(1, 4),
    bytes_by_category={"parameter": 100, "activation": 30, "temporary": 5},
)


def test_allocated_bytes_filters():
    """Bytes by category, phase and step."""
    assert RECORDING.allocated_bytes() == 135
    assert RECORDING.allocated_bytes("activation") == 30
    assert RECORDING.allocated_bytes(phase="backward") == 5
    assert RECORDING.allocated_bytes("activation", step=1) == 20


def test_step_events():
    """A step runs from its start to the next step's start."""
    assert RECORDING.steps == 2
    assert len(RECORDING.step_events(0)) == 3
    assert RECORDING.step_events(1)[0].address == 3


def test_peak_allocated_bytes():
    """The largest live total, counting a block as gone at free_requested."""
    assert RECORDING.peak_allocated_bytes() == 125

"""The trace event model: one record per allocator event, as PyTorch's trace entries (ref §11.2)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args, overload

__all__ = [
    "ACTIONS",
    "Action",
    "Frame",
    "TRACE_FORMAT_VERSION",
    "TraceEvent",
    "TraceHeader",
    "TraceSource",
    "new_trace_event",
]

# The version of the on-disk trace format written by ``write_trace``; bump it on any change that
# an older reader would misread, and keep reading every older version.
TRACE_FORMAT_VERSION = 1

Action = Literal[
    "alloc",
    "free_requested",
    "free_completed",
    "segment_alloc",
    "segment_free",
    "segment_map",
    "segment_unmap",
    "oom",
    "snapshot",
    "empty_cache",
    "allocator_settings",
    "annotate",
]

# Trace entry actions (ref §11.2 table; `annotate` is MAIN26 only). `empty_cache` is oomkit's own:
# PyTorch does not record it (§15.3), but synthetic traces and the tracer can state it.
# `allocator_settings` is oomkit's own too: a ``torch.cuda.memory._set_allocator_settings(text)``
# call at that point of the trace, its text in the ``setting`` tag (the tracer writes it; a
# snapshot holds only the settings at its dump, ``allocator_settings``, so its reader refuses it).
# The trace-file reader passes unknown actions through unchanged; the snapshot reader refuses
# them (a snapshot is PyTorch's own record, and an action it never writes means damage).
ACTIONS: tuple[str, ...] = get_args(Action)

TraceSource = Literal["snapshot", "synthetic", "tracer"]


@dataclass(frozen=True, slots=True)
class Frame:
    """One stack frame of the code that made an allocator call (a Python or C++ frame)."""

    filename: str
    line: int
    name: str


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """One allocator event, oldest first within a trace.

    ``address`` is a device address (recorded traces), an opaque allocation id (synthetic
    traces), or for ``oom`` the free device memory PyTorch recorded (``device_free``).
    ``size`` is in bytes: for ``alloc`` the requested (unrounded) size, for segment events the
    segment or mapping size (ref §11.2 table). ``tags`` carry extra string facts such as
    ``("category", "activation")`` or a recorded ``("user_metadata", ...)``.
    """

    action: str
    address: int
    size: int
    stream: int = 0
    time_us: int | None = None
    frames: tuple[Frame, ...] = ()
    tags: tuple[tuple[str, str], ...] = ()

    @overload
    def tag(self, key: str) -> str | None: ...

    @overload
    def tag(self, key: str, default: str) -> str: ...

    def tag(self, key: str, default: str | None = None) -> str | None:
        """The value of tag ``key`` (the last, as ``dict(tags)`` keeps), else ``default``;
        without building that dict, for loops over every event."""
        value = default
        for name, text in self.tags:
            if name == key:
                value = text
        return value


# TraceEvent's slots, set directly: the frozen dataclass's __init__ goes through
# object.__setattr__ per field (about twice the time). Loading a snapshot, recording a step and
# synthesizing a recording make one event per trace entry (issue 19).
_SET_EVENT_SLOTS = tuple(
    TraceEvent.__dict__[name].__set__
    for name in ("action", "address", "size", "stream", "time_us", "frames", "tags")
)


def new_trace_event(
    action: str,
    address: int,
    size: int,
    stream: int,
    time_us: int | None,
    frames: tuple[Frame, ...],
    tags: tuple[tuple[str, str], ...],
) -> TraceEvent:
    """``TraceEvent(action, address, size, stream, time_us, frames, tags)``, made faster: the
    same frozen record (equal, same hash), every field given."""
    event: TraceEvent = object.__new__(TraceEvent)
    set_action, set_address, set_size, set_stream, set_time, set_frames, set_tags = _SET_EVENT_SLOTS
    set_action(event, action)
    set_address(event, address)
    set_size(event, size)
    set_stream(event, stream)
    set_time(event, time_us)
    set_frames(event, frames)
    set_tags(event, tags)
    return event


@dataclass(frozen=True)
class TraceHeader:
    """What a trace file says about itself: where it came from and what it was recorded under.

    Attributes:
        format_version: the on-disk format version (``TRACE_FORMAT_VERSION`` when written).
        source: ``"snapshot"`` (converted from a PyTorch snapshot), ``"synthetic"`` or
            ``"tracer"`` (oomkit's GPU-free recorder); other strings are kept as given.
        device: the CUDA device index the events belong to.
        torch_version: the PyTorch version that produced the events, when known.
        allocator_settings: the ``PYTORCH_CUDA_ALLOC_CONF`` string in effect, when known.
        capacity_bytes: the device memory the events ran against, when known.
        metadata: free-form JSON-serialisable facts (model name, batch size, ...).
    """

    format_version: int = TRACE_FORMAT_VERSION
    source: str = "synthetic"
    device: int = 0
    torch_version: str | None = None
    allocator_settings: str | None = None
    capacity_bytes: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

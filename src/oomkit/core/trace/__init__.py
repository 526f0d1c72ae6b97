"""The trace event model and the streaming oomkit trace file format.

A trace is a sequence of :class:`TraceEvent` (PyTorch's trace entries, ref §11.2), oldest first,
stored on disk as JSON Lines behind a :class:`TraceHeader` (see ``oomkit.core.trace.io``).
"""

from __future__ import annotations

from oomkit.core.trace.events import (
    ACTIONS,
    TRACE_FORMAT_VERSION,
    Action,
    Frame,
    TraceEvent,
    TraceHeader,
    TraceSource,
    new_trace_event,
)
from oomkit.core.trace.io import TRACE_FORMAT_NAME, read_trace, write_trace

__all__ = [
    "ACTIONS",
    "Action",
    "Frame",
    "TRACE_FORMAT_NAME",
    "TRACE_FORMAT_VERSION",
    "TraceEvent",
    "TraceHeader",
    "TraceSource",
    "new_trace_event",
    "read_trace",
    "write_trace",
]

"""The trace event model and the streaming oomkit trace file format.

A trace is a sequence of :class:`TraceEvent` (PyTorch's trace entries, ref §11.2), oldest first,
stored on disk as JSON Lines behind a :class:`TraceHeader` (see ``oomkit.core.trace.io``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from oomkit._lazy import lazy_exports

if TYPE_CHECKING:
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

# Imported on first use (PEP 562): replaying a snapshot needs the event records, not the trace
# file format (gzip, JSON Lines) (issue 41 item 4: start-up).
_LAZY: dict[str, str] = {
    "ACTIONS": "oomkit.core.trace.events",
    "TRACE_FORMAT_VERSION": "oomkit.core.trace.events",
    "Action": "oomkit.core.trace.events",
    "Frame": "oomkit.core.trace.events",
    "TraceEvent": "oomkit.core.trace.events",
    "TraceHeader": "oomkit.core.trace.events",
    "TraceSource": "oomkit.core.trace.events",
    "new_trace_event": "oomkit.core.trace.events",
    "TRACE_FORMAT_NAME": "oomkit.core.trace.io",
    "read_trace": "oomkit.core.trace.io",
    "write_trace": "oomkit.core.trace.io",
}

__getattr__, __dir__ = lazy_exports(globals(), _LAZY)

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

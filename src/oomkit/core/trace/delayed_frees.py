"""Frees moved later in a trace: a block whose reuse waits for the GPU to pass an event.

A request-only trace (oomkit's recorder) frees a block where the program drops it. Where that
block's reuse waits on a CUDA event the GPU has not reached yet (``record_stream``:
CUDACachingAllocator.cpp ``free`` -> ``insert_events``, completed by ``process_events``), a GPU
that trails the CPU gives it back later; :func:`delayed_frees` moves those frees to that point
(``prediction/tracing/stream_timeline.py`` says which blocks and why).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Sequence

from oomkit.core.trace.events import TraceEvent
from oomkit.errors import ConfigError

__all__ = ["GPU_LAG_ALLOCATIONS", "delayed_frees"]

# How far a CPU that runs ahead can be: the CUDA launch queue holds about 1024 pending kernel
# launches before cudaLaunchKernel blocks the CPU (not documented by CUDA; the figure NVIDIA's
# engineers give on its developer forums). A recorded allocation stands for one kernel (most
# allocating ops launch one), so the upper end lets a freed block come back 1024 allocations
# after its free: at least as late as a full launch queue allows.
GPU_LAG_ALLOCATIONS = 1024


def delayed_frees(
    events: Sequence[TraceEvent],
    step_starts: Sequence[int],
    ids: Collection[int],
    lag_allocations: int = GPU_LAG_ALLOCATIONS,
) -> tuple[TraceEvent, ...]:
    """``events`` with each free of an id in ``ids`` moved ``lag_allocations`` allocations later.

    A moved free (its ``free_requested`` and ``free_completed``) goes right after the
    ``lag_allocations``-th ``alloc`` that follows it, or at the end of its step where the step
    has fewer: no event leaves its step, so ``step_starts`` stay valid. ``lag_allocations=0``
    gives ``events`` unchanged.

    Args:
        events: a recording's events (request-only: each free is a ``free_requested`` directly
            followed by its ``free_completed``).
        step_starts: index of each step's first event.
        ids: allocation ids whose frees wait on the GPU.
        lag_allocations: how many allocations the GPU trails the CPU by.

    Returns:
        The events in their new order (the same event objects).

    Raises:
        ValueError: ``lag_allocations`` is negative.
    """
    if lag_allocations < 0:
        raise ConfigError(f"lag_allocations must be at least 0; got {lag_allocations}")
    if not ids or lag_allocations == 0:
        return tuple(events)
    bounds = sorted({0, *step_starts, len(events)})
    out: list[TraceEvent] = []
    for start, stop in zip(bounds, bounds[1:], strict=False):
        waiting: deque[tuple[int, TraceEvent]] = deque()  # (alloc count due, event)
        allocs = 0
        for event in events[start:stop]:
            action = event.action
            if action in ("free_requested", "free_completed") and event.address in ids:
                waiting.append((allocs + lag_allocations, event))
                continue
            out.append(event)
            if action == "alloc":
                allocs += 1
                while waiting and waiting[0][0] <= allocs:
                    out.append(waiting.popleft()[1])
        out.extend(event for _, event in waiting)
    return tuple(out)

"""Shared by the hostile-input tests: bounds on time and memory, and a valid base snapshot."""

from __future__ import annotations

import contextlib
import signal
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from oomkit.core.snapshot import snapshot_to_data
from oomkit.core.trace import Frame, TraceEvent

MiB = 2**20
# Where the base snapshot's segment lies (a real-looking device address; 0 is never one).
BASE_ADDRESS = 0x7F00_0000_0000

# Every hostile input must be answered within these (the largest, a gzip bomb, takes < 2 s).
TIME_LIMIT_S = 20.0
MEMORY_LIMIT_BYTES = 96 * MiB


class TimeLimitExceeded(Exception):
    """Raised in the code under test when it runs past the time limit (it would hang)."""


@dataclass
class Bounded:
    """What one bounded call did: its return value or exception, seconds and peak bytes."""

    value: Any = None
    error: BaseException | None = None
    seconds: float = 0.0
    peak_bytes: int = 0


@contextlib.contextmanager
def _alarm(seconds: float) -> Iterator[None]:
    def fire(signum: int, frame: Any) -> None:
        raise TimeLimitExceeded(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_bounded(fn: Callable[[], Any], *, seconds: float = TIME_LIMIT_S) -> Bounded:
    """Call ``fn`` under a wall-clock alarm and tracemalloc; never raises what ``fn`` raises."""
    out = Bounded()
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with _alarm(seconds):
            out.value = fn()
    except BaseException as exc:  # noqa: BLE001 - the caller asserts on it
        out.error = exc
    finally:
        out.seconds = time.perf_counter() - start
        out.peak_bytes = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return out


def assert_within_bounds(result: Bounded, memory_bytes: int = MEMORY_LIMIT_BYTES) -> None:
    """Neither a hang (the alarm) nor more than ``memory_bytes`` of Python allocations."""
    assert not isinstance(result.error, TimeLimitExceeded), result.error
    assert result.seconds < TIME_LIMIT_S
    assert result.peak_bytes < memory_bytes, f"peak {result.peak_bytes / MiB:.1f} MiB"


def base_snapshot() -> dict[str, Any]:
    """A valid snapshot: one 20 MiB segment, a live 5 MiB block; the trace made it (5 events,
    a 4 MiB block allocated and freed): peak 9 MiB allocated, 20 MiB reserved."""
    frames = (Frame("/home/user/train.py", 7, "step"),)
    a = BASE_ADDRESS
    segments = [
        {
            "address": a,
            "total_size": 20 * MiB,
            "blocks": [
                {"address": a, "size": 5 * MiB, "state": "active_allocated", "frames": frames},
                {"address": a + 5 * MiB, "size": 15 * MiB, "state": "inactive"},
            ],
        }
    ]
    events = [
        TraceEvent("segment_alloc", a, 20 * MiB, frames=frames),
        TraceEvent("alloc", a, 5 * MiB, frames=frames),
        TraceEvent("alloc", a + 5 * MiB, 4 * MiB, frames=frames),
        TraceEvent("free_requested", a + 5 * MiB, 4 * MiB, frames=frames),
        TraceEvent("free_completed", a + 5 * MiB, 4 * MiB, frames=frames),
    ]
    return snapshot_to_data(segments, {0: events})

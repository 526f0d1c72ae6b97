"""A live status line for :class:`~oomkit.runtime.monitor.Monitor`, and ``oomkit.live_monitor``.

The monitor itself never prints; :func:`live_line_sink` is the ``sink`` that does, on stderr,
at most once per ``min_interval_s`` (and at once when a retry or an OOM happened), so it does
not flood a training log. :func:`live_monitor` is the one-call facade: a Monitor with that
sink (named apart from ``oomkit.Monitor``, the class it returns, not just by case).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

from rich.console import Console

from oomkit.runtime.device import DeviceMemory
from oomkit.runtime.monitor import Monitor, StepRecord
from oomkit.units import format_bytes

__all__ = ["format_live_line", "live_line_sink", "live_monitor"]


def format_live_line(record: StepRecord) -> str:
    """One line: step, allocated (peak), reserved, inactive split, retries, OOMs, step time."""
    parts = [
        f"step {record.step}",
        f"alloc {format_bytes(record.allocated_bytes)} (peak "
        f"{format_bytes(record.peak_allocated_bytes)})",
        f"reserved {format_bytes(record.reserved_bytes)}",
        f"split {format_bytes(record.inactive_split_bytes)}",
    ]
    if record.device_used_bytes is not None:
        parts.append(f"gpu used {format_bytes(record.device_used_bytes)}")
    parts.append(f"retries {record.num_alloc_retries}")
    parts.append(f"OOMs {record.num_ooms}")
    if record.step_time_s is not None:
        parts.append(f"{record.step_time_s * 1000:.1f} ms/step")
    rank = "" if record.rank is None else f"[rank {record.rank}] "
    return "oomkit " + rank + " | ".join(parts)


def live_line_sink(
    console: Console | None = None,
    *,
    min_interval_s: float = 1.0,
    get_time: Callable[[], float] = time.monotonic,
) -> Callable[[StepRecord], None]:
    """A Monitor ``sink`` printing :func:`format_live_line` to ``console`` (default: stderr).

    Args:
        console: where to print; None makes a stderr console.
        min_interval_s: print at most this often; a record whose retry or OOM counter went up
            is printed anyway (in red).
        get_time: clock in seconds.
    """
    out = console if console is not None else Console(file=sys.stderr, highlight=False)
    state: dict[str, Any] = {"last": None, "trouble": (0, 0)}

    def sink(record: StepRecord) -> None:
        now = get_time()
        trouble = (record.num_alloc_retries, record.num_ooms)
        worse = trouble > state["trouble"]
        state["trouble"] = trouble
        last = state["last"]
        if not worse and last is not None and now - last < min_interval_s:
            return
        state["last"] = now
        line = format_live_line(record)
        out.print(f"[red]{line}[/]" if worse else line, markup=worse, soft_wrap=True)

    return sink


def live_monitor(
    *,
    log_path: str | os.PathLike[str] | None = None,
    every: int = 1,
    auto_step: bool = False,
    live: bool = True,
    device: DeviceMemory | None = None,
    console: Console | None = None,
    min_interval_s: float = 1.0,
    **kwargs: Any,
) -> Monitor:
    """A :class:`~oomkit.runtime.monitor.Monitor` with a live status line on stderr.

    Example::

        with oomkit.live_monitor(log_path="memory.jsonl") as mon:
            for batch in loader:
                train_step(batch)
                mon.step()

    Args:
        log_path: JSONL log (``{rank}`` is replaced); None: no log.
        every: record every N-th step.
        auto_step: record after every ``optimizer.step()`` without calling ``step()``.
        live: print the status line (``False``: records and log only).
        device: the device to watch (default: the current CUDA or simulated device).
        console: where the line goes (default: stderr).
        min_interval_s: print at most this often.
        **kwargs: more :class:`Monitor` arguments (``get_time``, ``device_used``, ...).
    """
    sink = live_line_sink(console, min_interval_s=min_interval_s) if live else None
    return Monitor(
        log_path=log_path, device=device, every=every, auto_step=auto_step, sink=sink, **kwargs
    )

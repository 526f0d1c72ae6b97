"""Whether a snapshot's trace can have happened: the first entry that contradicts the others.

PyTorch records each block's life in one order (``CUDACachingAllocator.cpp``): ``malloc``
records ``alloc``; ``free`` records ``free_requested``, and ``free_block`` (at once, or after
the block's stream events complete, ``process_events``) records ``free_completed``. Every block
lies inside a segment that ``cudaMalloc`` (``segment_alloc``) or a mapping (``segment_map``)
made. A trace that breaks this order is hand-made or damaged, and any figure drawn from it (an
OOM diagnosis, a replay that "diverges") would be about memory that never existed, so the file
is refused before analysis.

The trace is a window: recording may start mid-run and the ring buffer drops the oldest entries
(``record_memory_history(max_entries=...)``), so a block may be freed in the window without its
``alloc`` in it, or completed without its request. Those are not contradictions; only facts the
window itself shows are compared. A free or an allocation is outside every segment only when no
segment known at any time covers it: the segments at dump time and every segment the trace
creates, releases, maps or unmaps. A trace stored without any segment (oomkit's own synthetic
traces written as snapshots) has nothing to lie inside, and only the order of entries is checked.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

from oomkit.core.snapshot._validate import KNOWN_ACTIONS, show
from oomkit.core.snapshot.model import SnapshotSegment
from oomkit.core.trace import TraceEvent

__all__ = ["trace_contradiction"]

# Block states within the window (absent: not seen yet, so whatever the start state held).
_ALLOCATED, _PENDING, _FREED = 1, 2, 3
_SEGMENT_ACTIONS = frozenset({"segment_alloc", "segment_free", "segment_map", "segment_unmap"})

_WHAT_TO_DO = (
    "A trace PyTorch records never does this; the file was edited or damaged. Record it again "
    "with torch.cuda.memory._record_memory_history() and _dump_snapshot()."
)


class _Ranges:
    """Address ranges known to be device memory at some time, for containment queries."""

    def __init__(self, ranges: Iterable[tuple[int, int]]) -> None:
        merged: list[list[int]] = []
        for start, end in sorted(r for r in ranges if r[1] > r[0]):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        self.starts = [r[0] for r in merged]
        self.ends = [r[1] for r in merged]

    def outside(self, address: int) -> bool:
        """Whether ``address`` lies outside every range (never, when no range is known)."""
        if not self.starts:
            return False
        i = bisect.bisect_right(self.starts, address) - 1
        return i < 0 or address >= self.ends[i]


def trace_contradiction(
    device: int,
    events: Sequence[TraceEvent],
    segments: Sequence[SnapshotSegment],
    other_actions: set[str] | None = None,
) -> str | None:
    """The first entry of one device's trace that contradicts the trace or the segments.

    Args:
        device: the device index (for the message).
        events: that device's trace, oldest first.
        segments: every segment of the snapshot (those of other devices are ignored).
        other_actions: when given, every action of the trace other than ``alloc``,
            ``free_requested`` and ``free_completed`` is added to it (``Snapshot.other_actions``:
            the check reads each entry's action anyway, and those entries are few).

    Returns:
        ``"inconsistent at entry K: ..."`` naming the contradiction and what to do, or None
        when the trace can have happened.
    """
    ranges = _Ranges(
        [(s.address, s.address + s.total_size) for s in segments if s.device == device]
        + [(e.address, e.address + e.size) for e in events if e.action in _SEGMENT_ACTIONS]
    )
    state: dict[int, int] = {}
    seen_at: dict[int, int] = {}
    for index, event in enumerate(events):
        action = event.action
        address = event.address
        problem = None
        if action not in KNOWN_ACTIONS:
            problem = (
                f"action {show(action)} is not one PyTorch records "
                f"(known: {', '.join(sorted(KNOWN_ACTIONS))})"
            )
        elif action == "alloc":
            if state.get(address) in (_ALLOCATED, _PENDING):
                problem = (
                    f"two live allocations at {address:#x}: entry {seen_at[address]} allocated "
                    "it and it was not freed before this alloc"
                )
            elif ranges.outside(address):
                problem = f"the allocation at {address:#x} lies outside every segment"
            state[address] = _ALLOCATED
        elif action == "free_requested":
            prior = state.get(address)
            if prior in (_PENDING, _FREED):
                problem = (
                    f"double free of {address:#x}: entry {seen_at[address]} already freed it "
                    "and nothing allocated it again"
                )
            elif prior is None and ranges.outside(address):
                problem = (
                    f"free of {address:#x}, an address never allocated: no alloc in the trace "
                    "and no segment holds it"
                )
            state[address] = _PENDING
        elif action == "free_completed":
            prior = state.get(address)
            if prior == _ALLOCATED:
                problem = (
                    f"free_completed of {address:#x} before its free_requested (entry "
                    f"{seen_at[address]} allocated it and no free was requested since)"
                )
            elif prior == _FREED:
                problem = (
                    f"double free of {address:#x}: entry {seen_at[address]} already completed "
                    "its free and nothing allocated it again"
                )
            elif prior is None and ranges.outside(address):
                problem = (
                    f"free of {address:#x}, an address never allocated: no alloc in the trace "
                    "and no segment holds it"
                )
            state[address] = _FREED
        else:
            if other_actions is not None:
                other_actions.add(action)
            continue
        if problem is not None:
            where = f"entry {index} of device_traces[{device}]"
            return f"inconsistent at {where}: {problem}. {_WHAT_TO_DO}"
        seen_at[address] = index
    return None

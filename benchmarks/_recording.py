"""Synthetic PyTorch-style recordings for the benchmarks: a trace that starts mid-run.

``make_recording`` drives oomkit's own allocator like a training loop and writes down what
PyTorch's ``_record_memory_history`` would: ``segment_alloc`` before the ``alloc`` that caused it,
``free_requested`` followed by its ``free_completed``, and at the end the snapshot's
``segments``. Memory allocated before recording began (``seeded_segments`` segments) is not in
the trace, so a replay has to reconstruct and seed it, as it does for real files.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from oomkit.core.allocator import AllocatorConfig, CachingAllocator
from oomkit.core.trace import Frame, TraceEvent

MiB = 2**20
# A device large enough that the synthetic run never runs out: the benchmark measures replay.
_CAPACITY_BYTES = 2**44


@dataclass(frozen=True)
class Recording:
    """What a snapshot file holds for one device: final segments and the trace."""

    segments: list[dict]
    events: list[TraceEvent]
    settings: dict


def _sizes(rng: random.Random) -> Iterator[int]:
    """Request sizes like a training step's: many small tensors, some MiB-scale ones."""
    while True:
        r = rng.random()
        if r < 0.55:
            yield rng.randrange(512, 256 * 1024)
        elif r < 0.9:
            yield rng.randrange(256 * 1024, 8 * MiB)
        else:
            yield rng.randrange(8 * MiB, 64 * MiB)


def make_recording(
    events: int,
    seeded_segments: int,
    *,
    seed: int = 1,
    expandable: bool = False,
    frames: int = 0,
) -> Recording:
    """A recording of ``events`` trace events that starts with ``seeded_segments`` segments.

    Args:
        events: trace entries to record (at least; a free pair or an alloc with its
            ``segment_alloc`` is never cut, so up to two more).
        seeded_segments: segments that exist, partly in use, before recording starts.
        seed: the random seed (the same arguments give the same recording).
        expandable: record under ``expandable_segments:True`` (mapped runs, ``segment_map``).
        frames: stack frames stored per alloc (real files store a few dozen per block).
    """
    rng = random.Random(seed)
    conf = "expandable_segments:True" if expandable else ""
    allocator = CachingAllocator(AllocatorConfig.parse(conf), capacity_bytes=_CAPACITY_BYTES)
    log = allocator.segment_log
    # Before recording: small-pool segments (two 1 MiB blocks per 2 MiB segment) and large ones;
    # every other block is freed, so the start state has both live and cached memory.
    before: list[int] = []
    while len(log) < seeded_segments:
        size = MiB if rng.random() < 0.5 else rng.randrange(10, 24) * MiB
        before.append(allocator.malloc(size))
    for ptr in before[::2]:
        allocator.free(ptr)
    live = before[1::2]
    rng.shuffle(live)
    mark = len(log)
    stack = tuple(Frame("train.py", 100 + k, f"layer_{k}") for k in range(frames))
    trace: list[TraceEvent] = []
    sizes = _sizes(rng)
    while len(trace) < events:
        # Grow the live set to ~600 blocks, then churn around it (a step's activations).
        if len(live) < 300 or (rng.random() < 0.5 and len(live) < 900):
            size = next(sizes)
            ptr = allocator.malloc(size)
            for action, address, seg_size in log[mark:]:
                trace.append(TraceEvent(action, address, seg_size))
            mark = len(log)
            trace.append(TraceEvent("alloc", ptr, size, frames=stack))
            live.append(ptr)
        else:
            ptr = live.pop(rng.randrange(len(live)))
            block = allocator.active_block(ptr)
            assert block is not None
            trace.append(TraceEvent("free_requested", ptr, block.requested_size))
            trace.append(TraceEvent("free_completed", ptr, block.requested_size))
            allocator.free(ptr)
    # The snapshot is taken right after the last recorded event (a free pair is never cut).
    return Recording(allocator.snapshot(), trace, {"expandable_segments": expandable})

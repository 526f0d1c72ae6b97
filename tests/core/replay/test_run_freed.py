"""A replay's run goes by reference counting once it is closed, and seeding's flags (issue 41).

``Run.close`` ends the cycles through a run (its engine's hooks, its allocator's device
callbacks), so the run and what it holds (start state, trace columns, final keys) are freed as
``replay_snapshot`` returns, not at the next garbage collection, which walked them all.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
from _shared_snapshots import SHARED_FILES, needs_shared

from oomkit.core.allocator import AllocatorConfig, CachingAllocator
from oomkit.core.replay import snapshot_replay
from oomkit.core.replay._run import Run
from oomkit.core.replay.snapshot_replay import replay_snapshot
from oomkit.core.snapshot import load_snapshot

MiB = 2**20
BASE = 0x7000_0000_0000

def _largest_trace() -> tuple[object, int]:
    best = None
    for path in SHARED_FILES:
        snapshot = load_snapshot(path)
        devices = snapshot.devices()
        if devices and (best is None or len(snapshot.trace_for(devices[0])) > best[0]):
            best = (len(snapshot.trace_for(devices[0])), snapshot, devices[0])
    assert best is not None and best[0] > 0
    return best[1], best[2]


@needs_shared
@pytest.mark.parametrize(
    "kwargs", [{"verify": True}, {"config": AllocatorConfig.parse("expandable_segments:True")}]
)
def test_a_finished_replay_leaves_its_runs_to_reference_counting(monkeypatch, kwargs):
    """With the collector off, every run replay_snapshot made is gone once it returns (before
    the change, each stayed in a cycle with its engine until a collection)."""
    snapshot, device = _largest_trace()
    refs: list[weakref.ref[Run]] = []

    def factory(*args, **kw):
        run = Run(*args, **kw)
        refs.append(weakref.ref(run))
        return run

    monkeypatch.setattr(snapshot_replay, "Run", factory)
    gc.collect()
    gc.disable()
    try:
        result = replay_snapshot(copy.copy(snapshot), device, **kwargs)
        assert refs
        assert [ref() for ref in refs] == [None] * len(refs)
    finally:
        gc.enable()
    if kwargs.get("verify"):
        assert result.first_divergence is None


@pytest.mark.parametrize("small, expandable", [(1, 0), (0, 0)])
def test_seeding_reads_int_flags_as_bools(small, expandable):
    """seed_segment's is_small and expandable are read for their truth, ints as bools: the same
    state and stats as True/False (the typed seeding gets bools, pure and compiled alike)."""
    size = 2 * MiB if small else 20 * MiB
    blocks = [(BASE, MiB, 1000, True), (BASE + MiB, size - MiB, 0, False)]
    made = []
    for flags in ((small, expandable), (bool(small), bool(expandable))):
        a = CachingAllocator()
        a.seed_segment(BASE, size, 0, is_small=flags[0], blocks=blocks, expandable=flags[1])
        made.append((a.snapshot(), a.memory_stats()))
    assert made[0] == made[1]
    snap, stats = made[0]
    assert snap[0]["segment_type"] == ("small" if small else "large")
    pool = "small_pool" if small else "large_pool"
    assert stats[f"reserved_bytes.{pool}.current"] == size
    assert stats[f"allocated_bytes.{pool}.current"] == MiB

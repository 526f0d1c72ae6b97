"""fit --lengths: the largest batch whose whole run fits, probe by probe (synthetic runs)."""

from __future__ import annotations

import pytest

from oomkit.core.gpus import GpuSpec
from oomkit.core.target import Target
from oomkit.core.trace import TraceEvent
from oomkit.errors import NoFeasibleBatchSizeError
from oomkit.plan.envelope_fit import max_batch_for_run
from oomkit.prediction.tracing.recording import TraceRecording

MiB = 2**20


def synthetic(batch: int, length_mib: int) -> TraceRecording:
    """An activation of batch x length MiB per step (a 512 KiB parameter persists)."""
    act = batch * length_mib * MiB
    cat = (("category", "activation"),)
    events = (
        TraceEvent("alloc", 1, MiB // 2, tags=(("category", "parameter"),)),
        TraceEvent("alloc", 2, act, tags=cat),
        TraceEvent("free_requested", 2, act, tags=cat),
        TraceEvent("free_completed", 2, act, tags=cat),
        TraceEvent("alloc", 3, act, tags=cat),
        TraceEvent("free_requested", 3, act, tags=cat),
        TraceEvent("free_completed", 3, act, tags=cat),
    )
    return TraceRecording(events=events, step_starts=(1, 4))


def _target(usable_mib: int) -> Target:
    return Target.resolve(GpuSpec("test GPU", usable_mib * MiB, 0))


def test_release_and_retry_keeps_fully_free_segments_from_causing_an_oom():
    """Lengths 12, 14 MiB per sample on 100 MiB: at batch b step 2 asks 14b MiB with the 12b
    MiB segment of step 1 cached. Batch 7: 2 + 84 + 98 > 100, so the allocator releases the
    free 84 MiB segment and retries (ref §4 step 9): 100 MiB, fits. Batch 8 needs 112 MiB."""
    found = max_batch_for_run(synthetic, [12, 14], _target(100), margin_bytes=0)
    assert found.batch_size == 7
    assert found.envelope.per_step_peak_reserved_bytes == (86 * MiB, 100 * MiB)
    assert [(p.batch_size, p.fits) for p in found.probes] == [
        (1, True), (2, True), (4, True), (8, False), (6, True), (7, True)
    ]


def test_margin_counts_the_cache_the_run_keeps():
    """30 MiB margin (worst step <= 70 MiB): batch 2 keeps both segments (2 + 24 + 28 = 54:
    fits); batch 4 releases step 1's (worst 2 + 56 = 58: fits); 8 runs out of memory at its
    second step (its first peaked at 2 + 96 = 98 MiB); 6 and 5
    need 86 and 72 MiB after the release: over the margin. So 4, although batch 3 (2 + 36 +
    42 = 80 MiB, nothing released) would not fit: the search follows the doubling."""
    found = max_batch_for_run(
        synthetic, [12, 14], _target(100), margin_bytes=30 * MiB, start_batch=2
    )
    assert found.batch_size == 4
    assert [(p.batch_size, p.fits, p.worst_peak_reserved_bytes // MiB) for p in found.probes] == [
        (2, True, 54), (4, True, 58), (8, False, 98), (6, False, 86), (5, False, 72)
    ]


def test_nothing_fits_raises():
    """A 20 MiB device: batch 1's third step asks 40 MiB: NoFeasibleBatchSizeError."""
    with pytest.raises(NoFeasibleBatchSizeError, match="not even batch 1"):
        max_batch_for_run(synthetic, [12, 14, 40], _target(20), margin_bytes=0)

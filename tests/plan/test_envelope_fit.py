"""fit --lengths: the largest batch whose whole run fits, probe by probe (synthetic runs)."""

from __future__ import annotations

import pytest

from oomkit.core.gpus import GpuSpec
from oomkit.core.target import Target
from oomkit.core.trace import TraceEvent
from oomkit.errors import ConfigError, NoFeasibleBatchSizeError
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
    with pytest.raises(NoFeasibleBatchSizeError, match="not even batch 1") as raised:
        max_batch_for_run(synthetic, [12, 14, 40], _target(20), margin_bytes=0)
    # The replay stops at the OOM: the message says where, not a peak that is not the need.
    error = raised.value
    assert "its step 3 runs out of memory (16.00 MiB reserved before it did), and of the " \
        "20.00 MiB usable" in str(error)
    assert "--checkpointing" in str(error)
    assert (error.needed_reserved_bytes, error.usable_bytes, error.margin_bytes) == (None, 20 * MiB, 0)


def test_a_run_that_fits_only_without_the_margin_says_what_its_worst_step_needs():
    """No OOM at batch 1, but its worst step (16 MiB) leaves less than the 10 MiB margin of 20."""
    with pytest.raises(NoFeasibleBatchSizeError) as raised:
        max_batch_for_run(synthetic, [12, 14], _target(20), margin_bytes=10 * MiB)
    error = raised.value
    assert "its worst step needs 16.00 MiB reserved, and of the 20.00 MiB usable a margin of " \
        "10.00 MiB must stay free" in str(error)
    assert (error.needed_reserved_bytes, error.usable_bytes, error.margin_bytes) == (
        16 * MiB, 20 * MiB, 10 * MiB
    )


def _counted(calls, extra_above=None):
    """``synthetic``, noting each (batch, length) traced; from batch ``extra_above`` on, a 3 MiB
    workspace more per step (another code path above some size)."""

    def record(batch: int, length_mib: int) -> TraceRecording:
        calls.append((batch, length_mib))
        recording = synthetic(batch, length_mib)
        if extra_above is not None and batch >= extra_above:
            cat = (("category", "workspace"),)
            extra = (
                TraceEvent("alloc", 9, 3 * MiB, tags=cat),
                TraceEvent("free_requested", 9, 3 * MiB, tags=cat),
                TraceEvent("free_completed", 9, 3 * MiB, tags=cat),
            )
            recording = TraceRecording(events=recording.events + extra, step_starts=(1, 4))
        return recording

    return record


def test_interpolated_search_traces_two_batches_a_length_and_the_answers():
    """Lengths 12, 14 MiB per sample on 400 MiB: batch 28 fits (worst step 394 MiB), 29 and 30
    run out of memory. Traced at both lengths: 1 and 2 to learn, 29 (the last size bisection
    tries) and 28 (the answer, synthesized first, then confirmed); 4, 8, 16, 32, 24 and 30 are
    synthesized. Every probe and the answer's envelope equal those of tracing every batch."""
    calls = []
    found = max_batch_for_run(_counted(calls), [12, 14], _target(400), margin_bytes=0)
    plain_calls = []
    plain = max_batch_for_run(
        _counted(plain_calls), [12, 14], _target(400), margin_bytes=0, interpolate=False
    )
    assert found.batch_size == plain.batch_size == 28
    strip = [(p.batch_size, p.fits, p.worst_peak_reserved_bytes) for p in found.probes]
    assert strip == [(p.batch_size, p.fits, p.worst_peak_reserved_bytes) for p in plain.probes]
    assert [p.batch_size for p in found.probes] == [1, 2, 4, 8, 16, 32, 24, 28, 30, 29]
    assert found.probes[7].worst_peak_reserved_bytes == 394 * MiB
    assert calls == [(1, 12), (1, 14), (2, 12), (2, 14), (29, 12), (29, 14), (28, 12), (28, 14)]
    assert (found.traces, found.synthesized) == (8, 14)
    assert (plain.traces, plain.synthesized) == (20, 0) == (len(plain_calls), 0)
    assert [p.batch_size for p in found.probes if p.synthesized] == [4, 8, 16, 32, 24, 30]
    assert found.envelope.per_step_peak_reserved_bytes == plain.envelope.per_step_peak_reserved_bytes


def test_a_path_that_changes_above_the_learned_batches_is_caught():
    """A 3 MiB workspace per step from batch 20 on: 29 and 28, traced, differ from their
    synthesis from 1 and 2; the search runs again, tracing the sizes between the two code paths
    (4, 8, 16, 24) and synthesizing 30 and 32 from 28 and 29: the plain probes and answer."""
    kwargs = dict(margin_bytes=0)
    plain = max_batch_for_run(
        _counted([], extra_above=20), [12, 14], _target(400), interpolate=False, **kwargs
    )
    calls = []
    found = max_batch_for_run(_counted(calls, extra_above=20), [12, 14], _target(400), **kwargs)
    assert found.batch_size == plain.batch_size
    assert [(p.batch_size, p.fits, p.worst_peak_reserved_bytes) for p in found.probes] == [
        (p.batch_size, p.fits, p.worst_peak_reserved_bytes) for p in plain.probes
    ]
    assert not next(p for p in found.probes if p.batch_size == found.batch_size).synthesized
    assert sorted({batch for batch, _ in calls}) == [1, 2, 4, 8, 16, 24, 28, 29]
    assert (found.traces, plain.traces) == (16, 20)


def test_jobs_trace_a_probes_lengths_in_forked_processes_with_the_same_search(tmp_path):
    """jobs=2: the batch, every probe and the trace counts of jobs=1; the lengths a probe
    traces (three at batches 1 and 2, before anything can be synthesized) come from other
    processes, and a process that fails is traced here."""
    import os

    log = tmp_path / "log"
    parent = os.getpid()

    def record(batch: int, length_mib: int, fail_ahead: bool = False) -> TraceRecording:
        with log.open("a") as out:
            out.write(f"{os.getpid()} {batch} {length_mib}\n")
        if fail_ahead and os.getpid() != parent:
            raise RuntimeError("only in a forked process")
        return synthetic(batch, length_mib)

    def outcome(found):
        probes = [(p.batch_size, p.fits, p.worst_peak_reserved_bytes, p.synthesized) for p in found.probes]
        return found.batch_size, probes, found.traces, found.synthesized

    kwargs = dict(lengths=[12, 14, 13], target=_target(100), margin_bytes=0)
    serial = max_batch_for_run(record, **kwargs)
    assert all(int(line.split()[0]) == parent for line in log.read_text().splitlines())
    log.unlink()
    parallel = max_batch_for_run(record, jobs=2, **kwargs)
    assert outcome(parallel) == outcome(serial)
    rows = [tuple(map(int, line.split())) for line in log.read_text().splitlines()]
    ahead = sorted((b, n) for pid, b, n in rows if pid != parent)
    assert ahead[:6] == [(1, 12), (1, 13), (1, 14), (2, 12), (2, 13), (2, 14)]
    assert all(pid != parent for pid, b, _ in rows if b in (1, 2))
    log.unlink()
    failing = max_batch_for_run(lambda b, n: record(b, n, fail_ahead=True), jobs=2, **kwargs)
    assert outcome(failing) == outcome(serial)


def test_a_given_margin_not_below_usable_is_a_config_error_before_recording():
    """--lengths with a margin of the whole 100 MiB: ConfigError, no length recorded."""
    recorded: list[tuple[int, int]] = []

    def record(batch: int, length: int) -> TraceRecording:
        recorded.append((batch, length))
        return synthetic(batch, length)

    with pytest.raises(ConfigError, match="not below the 100.00 MiB usable on test GPU"):
        max_batch_for_run(record, [12, 14], _target(100), margin_bytes=100 * MiB)
    assert recorded == []

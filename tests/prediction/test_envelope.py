"""The epoch envelope: a run of different lengths spliced into one recording and replayed."""

from __future__ import annotations

import pytest

from oomkit.core.gpus import GpuSpec
from oomkit.core.target import Target
from oomkit.core.trace import TraceEvent
from oomkit.errors import ConfigError
from oomkit.prediction.envelope import predict_envelope, splice_run
from oomkit.prediction.predictor import predict_recording
from oomkit.prediction.tracing.recording import TraceRecording

MiB = 2**20


def _alloc(ident, size, category, module=""):
    tags = (("category", category),) + ((("module", module),) if module else ())
    return TraceEvent("alloc", ident, size, tags=tags)


def _free(ident, size, category):
    return [
        TraceEvent("free_requested", ident, size, tags=(("category", category),)),
        TraceEvent("free_completed", ident, size, tags=(("category", category),)),
    ]


def synthetic(length_mib: int) -> TraceRecording:
    """A 512 KiB parameter; each step makes and frees a length-sized activation; step 1 also
    makes a 512 KiB optimizer state; the input is 512 bytes per MiB of length."""
    act = length_mib * MiB
    events = [_alloc(1, MiB // 2, "parameter", "lin"), _alloc(2, 512 * length_mib, "input")]
    starts = [len(events)]
    events += [_alloc(3, act, "activation", "lin"), *_free(3, act, "activation")]
    events += [_alloc(4, MiB // 2, "optimizer_state", "lin")]
    starts.append(len(events))
    events += [_alloc(5, act, "activation", "lin"), *_free(5, act, "activation")]
    return TraceRecording(events=tuple(events), step_starts=tuple(starts))


def _target(total_mib: int = 8192, conf: str = "") -> Target:
    return Target.resolve(GpuSpec("test GPU", total_mib * MiB, 0), alloc_conf=conf or None)


def _peaks(recording, target=None):
    pred = predict_recording(recording, target=target or _target())
    return [p.peak_reserved_bytes for p in pred.step_peaks]


def test_rising_lengths_creep_by_hand():
    """12, 14, 16, 18 MiB: each request misses every cached block -> 14, 28, 44, 62 MiB.

    Hand count (ref §2.3, §5): the parameter, the inputs and the optimizer state (all <= 1 MiB)
    share one 2 MiB small segment; each activation >= 10 MiB gets a segment of its own size (a
    2 MiB multiple), and a freed one is too small for the next, longer one.
    """
    recs = {n: synthetic(n) for n in (12, 14, 16, 18)}
    run = splice_run(recs, [12, 14, 16, 18])
    assert _peaks(run) == [14 * MiB, 28 * MiB, 44 * MiB, 62 * MiB]


def test_largest_first_stays_flat_by_hand():
    """18 first: the 18 MiB block is split for every shorter step -> 20 MiB throughout."""
    recs = {n: synthetic(n) for n in (12, 14, 16, 18)}
    assert _peaks(splice_run(recs, [18, 12, 14, 16])) == [20 * MiB] * 4


def test_inputs_of_the_next_batch_are_made_before_the_last_is_freed():
    """At each step boundary the new input is allocated, then the old one freed (one each)."""
    recs = {n: synthetic(n) for n in (12, 14)}
    run = splice_run(recs, [12, 14])
    boundary = run.events[run.step_starts[1] : run.step_starts[1] + 3]
    assert [(e.action, e.size) for e in boundary] == [
        ("alloc", 512 * 14),
        ("free_requested", 512 * 12),
        ("free_completed", 512 * 12),
    ]
    assert len({e.address for e in run.events if e.action == "alloc"}) == sum(
        e.action == "alloc" for e in run.events
    )


def test_envelope_reports_worst_step_creep_and_remedies():
    """predict_envelope: worst step 4 at 62 MiB, 42 MiB above 18 MiB alone; largest first
    and expandable segments priced from the replay."""
    env = predict_envelope(synthetic, [12, 14, 16, 18], _target())
    assert env.per_step_peak_reserved_bytes == (14 * MiB, 28 * MiB, 44 * MiB, 62 * MiB)
    assert (env.worst_step, env.worst_length, env.worst_peak_reserved_bytes) == (4, 18, 62 * MiB)
    assert env.longest_alone_peak_reserved_bytes == 20 * MiB and env.creep_bytes == 42 * MiB
    assert env.first_oom_step is None
    by_name = {r.name: r for r in env.remedies}
    assert by_name["largest batch first"].saving_bytes == 42 * MiB
    # Expandable segments: one 20 MiB page holds every activation (plus the 2 MiB small page).
    assert by_name["expandable_segments:True"].peak_reserved_bytes == 22 * MiB
    assert by_name["max_split_size_mb:128"].saving_bytes == 0
    assert env.remedies[0].name == "largest batch first"
    # The 95th-percentile cap of 4 steps is sorted(lengths)[int(0.95 * 4)] = 18, the longest: none.
    assert not any(r.name.startswith("max length") for r in env.remedies)


def test_remedies_replayed_in_forked_processes_are_the_one_at_a_time_ones():
    """jobs=2: every remedy (allocator settings, largest first, --pad-to, the 95th-percentile
    cap) is the same as one at a time, in the same order; each length is recorded once, here."""
    lengths = [12, 14, 16, 18] * 5 + [40]
    recorded = []

    def record(length):
        recorded.append(length)
        return synthetic(length)

    serial = predict_envelope(record, lengths, _target(), jobs=1)
    forked = predict_envelope(record, lengths, _target(), jobs=2)
    assert sorted(r.name for r in serial.remedies) == [
        "--pad-to 256",
        "--pad-to 64",
        "expandable_segments:True",
        "garbage_collection_threshold:0.8,per_process_memory_fraction:0.99",
        "largest batch first",
        "max length 18",
        "max_split_size_mb:128",
        "max_split_size_mb:512",
    ]
    assert forked.remedies == serial.remedies
    assert forked.per_step_peak_reserved_bytes == serial.per_step_peak_reserved_bytes
    assert sorted(recorded[: len(recorded) // 2]) == sorted(recorded[len(recorded) // 2 :])
    assert len(set(recorded)) == len(recorded) // 2  # each length once per envelope


def test_lengths_recorded_in_forked_processes_give_the_one_at_a_time_envelope(tmp_path):
    """record_jobs=2: the first length is recorded here, the others in forked processes; the
    envelope is the one-at-a-time one; a failing process is redone here."""
    import os

    log = tmp_path / "log"
    parent = os.getpid()

    def record(length, fail_ahead=False):
        with log.open("a") as out:
            out.write(f"{os.getpid()} {length}\n")
        if fail_ahead and os.getpid() != parent:
            raise RuntimeError("only in a forked process")
        return synthetic(length)

    def where():
        rows = [line.split() for line in log.read_text().splitlines()]
        log.unlink()
        return [(int(pid) == parent, int(n)) for pid, n in rows]

    lengths = [14, 12, 18, 16, 12]
    serial = predict_envelope(record, lengths, _target(), remedies=False, record_jobs=1)
    assert where() == [(True, 14), (True, 12), (True, 18), (True, 16)]
    forked = predict_envelope(record, lengths, _target(), remedies=False, record_jobs=2)
    assert forked == serial
    made = where()
    assert made[0] == (True, 14) and sorted(made[1:]) == [(False, 12), (False, 16), (False, 18)]
    failing = predict_envelope(
        lambda n: record(n, fail_ahead=True), lengths, _target(), remedies=False, record_jobs=2
    )
    assert failing == serial
    assert [here for here, _ in where()][-3:] == [True, True, True]


def test_first_oom_step_is_counted_from_1():
    """Usable 50 MiB: a 100 MiB step (the third) runs out of memory; the replay stops there."""
    env = predict_envelope(synthetic, [12, 14, 100], _target(50), remedies=False)
    assert env.first_oom_step == 3
    assert len(env.per_step_peak_reserved_bytes) == 3


def test_constant_length_is_exactly_the_multi_step_prediction():
    """A constant length gives exactly the events and peaks of an ordinary 3-step recording."""
    torch = pytest.importorskip("torch")
    from oomkit.prediction.tracing import trace_step

    def record(length, steps=2):
        with torch.device("meta"):
            model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
            opt = torch.optim.AdamW(model.parameters())
            x = torch.randn(4, length, 64)

        def step(*_):
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            opt.step()

        return trace_step(step, model, opt, x, steps=steps)

    target = _target()
    three = predict_recording(record(128, 3), target=target)
    env = predict_envelope(record, [128, 128, 128], target, remedies=False)
    assert env.per_step_peak_reserved_bytes == tuple(p.peak_reserved_bytes for p in three.step_peaks)
    assert env.prediction.events == three.events
    assert env.prediction.peak_allocated_bytes == three.peak_allocated_bytes


def test_state_that_depends_on_the_length_is_refused():
    """A parameter sized by the length cannot be spliced: ConfigError naming it."""

    def growing(length_mib):
        rec = synthetic(length_mib)
        events = list(rec.events)
        events[0] = _alloc(1, length_mib * 1024, "parameter", "pos")  # a length-sized table
        return TraceRecording(events=tuple(events), step_starts=rec.step_starts)

    with pytest.raises(ConfigError, match="a 14336-byte parameter tensor of module 'pos' appears"):
        splice_run({12: growing(12), 14: growing(14)}, [12, 14])


def test_a_length_above_the_model_maximum_is_refused():
    """max_length 16 and a padded length of 18: a clear ConfigError."""
    with pytest.raises(ConfigError, match="longer than the model's maximum, 16"):
        predict_envelope(synthetic, [12, 18], _target(), max_length=16)

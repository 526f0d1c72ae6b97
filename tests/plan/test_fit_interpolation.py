"""Tests for plan/trace_interpolation.py and the interpolated `max_batch_size` search."""

from __future__ import annotations

import pytest
from _steps import linear_step
from hypothesis import given, settings
from hypothesis import strategies as st

from oomkit.core.gpus import GpuSpec
from oomkit.core.target import Target
from oomkit.core.trace import Frame, TraceEvent
from oomkit.plan.trace_interpolation import (
    TraceInterpolator,
    affine_sizes,
    recording_structure,
    same_recording,
    synthesize_sizes,
)
from oomkit.prediction.tracing.recording import TraceRecording

torch = pytest.importorskip("torch")

MiB = 2**20


def _recording(sizes, *, first_id=0, tag="activation", kernels=None):
    """An alloc, then its free, per size; ids from ``first_id``; bytes by category summed."""
    frames = (Frame("step.py", 3, "step"),)
    events = []
    for i, size in enumerate(sizes):
        tags = (("category", tag),)
        events.append(TraceEvent("alloc", first_id + i, size, 0, None, frames, tags))
    for i, size in enumerate(sizes):
        for action in ("free_requested", "free_completed"):
            events.append(TraceEvent(action, first_id + i, size, 0, None, frames, (("category", tag),)))
    return TraceRecording(
        events=tuple(events),
        step_starts=(0,),
        bytes_by_category={tag: sum(sizes)},
        kernel_choices=kernels or {},
    )


def test_structure_ignores_ids_and_sizes_but_not_tags_or_kernels():
    """Two recordings differing in ids and sizes share a structure; a tag or a kernel does not."""
    base = _recording([10, 20])
    assert recording_structure(base) == recording_structure(_recording([30, 50], first_id=900))
    assert recording_structure(base) != recording_structure(_recording([10, 20], tag="temporary"))
    kernels = {"SDPA flash_attention": 2}
    assert recording_structure(base) != recording_structure(_recording([10, 20], kernels=kernels))
    assert recording_structure(base) != recording_structure(_recording([10, 20, 30]))
    assert recording_structure(object()) is None
    assert same_recording(base, _recording([10, 20], first_id=7))
    assert not same_recording(base, _recording([10, 21]))


def test_affine_sizes_fits_whole_slopes_and_checks_the_rest():
    """Sizes 8 + 2b and 5 through batches 1, 2, 4; an off third point or a half slope is none."""
    assert affine_sizes([(1, [10, 5]), (2, [12, 5]), (4, [16, 5])]) == ((8, 5), (2, 0))
    assert affine_sizes([(1, [10, 5]), (2, [12, 5]), (4, [17, 5])]) is None
    assert affine_sizes([(1, [1]), (3, [2])]) is None  # slope 1/2 bytes per sample
    assert affine_sizes([(1, [1])]) is None
    assert affine_sizes([(2, [1]), (2, [1])]) is None
    assert synthesize_sizes(((8, 5), (2, 0)), 100) == (208, 5)
    assert synthesize_sizes(((8,), (-2,)), 5) is None  # -2 bytes: not a size


@settings(max_examples=60, deadline=None)
@given(
    lines=st.lists(
        st.tuples(st.integers(0, 10**9), st.integers(0, 10**7)), min_size=1, max_size=12
    ),
    batches=st.lists(st.integers(1, 4096), min_size=4, max_size=4, unique=True),
)
def test_synthesis_at_a_traced_batch_reproduces_it_exactly(lines, batches):
    """Learned from three traced batches, the fourth is synthesized equal to its own trace."""
    recordings = {b: _recording([a + k * b for a, k in lines]) for b in batches}
    for held_out in batches:
        interpolator = TraceInterpolator()
        for b in batches:
            if b != held_out:
                interpolator.add(b, recordings[b])
        assert interpolator.synthesize(held_out) == recordings[held_out]


def test_add_says_whether_a_trace_differs_from_its_synthesis():
    """Learned on 1, 2, 4 (size 8 + 2b): a trace at 10 of 28 bytes is what synthesis gives, one
    of 29 bytes or with another tag is not; with nothing to synthesize from, never differs."""
    def learned():
        interpolator = TraceInterpolator()
        assert interpolator.add(1, _recording([10])) is False  # nothing learned yet
        assert interpolator.add(2, _recording([12])) is False
        assert interpolator.add(4, _recording([16])) is False  # a run of 2 is not enough
        return interpolator

    interpolator = learned()
    assert interpolator.add(10, _recording([28], first_id=50)) is False
    assert interpolator.add(12, _recording([33])) is True  # 32 expected
    assert interpolator.traced_batches == (1, 2, 4, 10, 12)
    # 20 lies above the run 1, 2, 4, 10, 12, whose sizes are no longer affine: nothing to
    # compare with.
    assert interpolator.add(20, _recording([48])) is False
    assert learned().add(20, _recording([48], tag="temporary")) is True  # another structure


def test_a_change_of_structure_is_learned_again_on_its_side():
    """Above batch 8 an extra allocation: batches 2..8 and 16..64 are two runs, none across."""

    def sizes(b):
        return [100 + 3 * b] + ([7 * b] if b > 8 else [])

    interpolator = TraceInterpolator()
    for b in (2, 4, 8, 16, 32):
        interpolator.add(b, _recording(sizes(b)))
    assert interpolator.synthesize(6) == _recording(sizes(6))  # inside the run 2, 4, 8
    assert interpolator.synthesize(1) == _recording(sizes(1))  # below it
    assert interpolator.synthesize(12) is None  # between two structures
    assert interpolator.synthesize(64) is None  # the run 16, 32 has only two batches
    interpolator.add(64, _recording(sizes(64)))
    assert interpolator.basis(100) == (64, 32, 16)
    assert interpolator.synthesize(100) == _recording(sizes(100))



def _gpu(total_bytes):
    return GpuSpec(name="test GPU", total_memory_bytes=total_bytes, context_overhead_bytes=0)


def _linear(calls=None, per_batch=1, path_change_at=None):
    """Batch -> ``_steps.linear_step`` (exact MiB; 20 MiB more from ``path_change_at`` on),
    noting each batch built in ``calls``."""

    def build(batch):
        if calls is not None:
            calls.append(batch)
        return linear_step(batch, per_batch, path_change_at)

    return build


def _curve(result):
    return [
        (p.batch_size, p.peak_reserved_bytes, p.peak_allocated_bytes, p.fits) for p in result.curve
    ]


def test_interpolated_search_traces_five_and_finds_the_same_answer():
    """1 and 2 traced to learn; 41, the last size bisection tries, traced at once (the answer
    rests on it either way) and 42 traced to confirm; the 9 others synthesized, same curve."""
    from oomkit.plan.batch_search import max_batch_size

    calls = []
    result = max_batch_size(
        _linear(calls), target=Target.resolve(_gpu(100 * MiB)), margin_bytes=10 * MiB
    )
    plain = max_batch_size(
        _linear(), target=Target.resolve(_gpu(100 * MiB)), margin_bytes=10 * MiB, interpolate=False
    )
    assert result.probe_order == plain.probe_order == (1, 2, 4, 8, 16, 32, 64, 48, 40, 44, 42, 41)
    assert (result.batch_size, result.first_failing_batch) == (plain.batch_size, 42) == (41, 42)
    assert (result.traces, result.synthesized) == (4, 9)
    assert (plain.traces, plain.synthesized) == (12, 0)
    assert calls == [1, 2, 41, 42]  # the builder runs only for the traced sizes
    assert _curve(result) == _curve(plain)
    assert [p.batch_size for p in result.curve if not p.synthesized] == [1, 2, 41, 42]
    assert not result.answer.synthesized and result.answer.train.description == ""
    assert result.warnings == plain.warnings


def test_progress_counts_the_confirmations():
    """12 probes (each but the last counting 2 confirmations to come) then 1 confirmation
    (the last probe, 41, was traced): progress reaches 13 of 13, never done above total."""
    from oomkit.plan.batch_search import max_batch_size

    seen = []
    result = max_batch_size(
        _linear(), target=Target.resolve(_gpu(100 * MiB)), margin_bytes=10 * MiB, progress=lambda d, t: seen.append((d, t))
    )
    assert [d for d, _ in seen] == list(range(1, 14))
    assert all(t >= d for d, t in seen) and seen[-1] == (13, 13)
    assert result.traces + result.synthesized == 13


def test_eval_steps_are_interpolated_and_confirmed_too():
    """An eval step at 3 x the batch caps at 15: train and eval traced at 1, 2, 15, 16."""
    from oomkit.plan.batch_search import max_batch_size

    kwargs = dict(
        target=Target.resolve(_gpu(100 * MiB)), margin_bytes=0, eval_step=_linear(per_batch=3)
    )
    result = max_batch_size(_linear(), **kwargs)
    plain = max_batch_size(_linear(), interpolate=False, **kwargs)
    assert (result.batch_size, result.limiting_step) == (plain.batch_size, "eval") == (15, "eval")
    assert result.probe_order == plain.probe_order == (1, 2, 4, 8, 16, 12, 14, 15)
    assert _curve(result) == _curve(plain)
    # Traced: train and eval at 1, 2, 15 (the last size bisection tries), 16. Synthesized:
    # both at 4, 8, 12, 14 and the first 16.
    assert (result.traces, result.synthesized, plain.traces) == (8, 10, 16)
    assert [p.batch_size for p in result.curve if p.synthesized] == [4, 8, 12, 14]


def test_a_code_path_that_changes_above_the_learned_sizes_is_caught_and_searched_again():
    """20 MiB more from batch 30 on: the first search's 41, traced as its last size, does not
    fit, and its answer, 40, is not confirmed; the search then learns the new path from its
    traces and finds the plain answer, 31, confirmed."""
    from oomkit.plan.batch_search import max_batch_size

    kwargs = dict(target=Target.resolve(_gpu(100 * MiB)), margin_bytes=10 * MiB)
    plain = max_batch_size(_linear(path_change_at=30), interpolate=False, **kwargs)
    calls = []
    result = max_batch_size(_linear(calls, path_change_at=30), **kwargs)
    assert plain.batch_size == 31 and plain.first_failing_batch == 32
    assert (result.batch_size, result.first_failing_batch) == (31, 32)
    assert _curve(result) == _curve(plain)
    assert result.probe_order == plain.probe_order
    assert not result.answer.synthesized
    assert not next(p for p in result.curve if p.batch_size == 32).synthesized
    # Learned from 1, 2; 41 (the new path: it does not fit) and 40, traced to confirm the
    # answer 40, differ from their synthesis. Searched again: 4, 8, 16, 32, 24, 28, 30 each lie
    # between sizes of two paths (traced), 31 is the last size (traced). A change of path just
    # under the answer is the worst case: the two traces of the first search are extra.
    assert calls == [1, 2, 41, 40, 4, 8, 16, 32, 24, 28, 30, 31]
    assert (result.traces, result.synthesized) == (12, 9) and plain.traces == 10


def _powers_of_two_cheaper(calls):
    """A step of one structure whose size is affine in the batch only over powers of two:
    (b + 4) * 2 MiB there, 6 MiB more elsewhere."""

    def build(batch):
        calls.append(batch)
        extra = 0 if batch & (batch - 1) == 0 else 3

        def step():
            torch.empty((batch + 4 + extra) * 2 * MiB, dtype=torch.uint8)

        return step

    return build


def test_sizes_off_the_learned_line_are_caught_by_the_confirmation():
    """Learned on 1, 2, the synthesized sizes are 6 MiB short: 41, traced as the last size,
    does not fit and 40, traced to confirm the answer, differs; the search again (reusing the
    trace of 40) gives the plain answer, 38."""
    from oomkit.plan.batch_search import max_batch_size

    kwargs = dict(target=Target.resolve(_gpu(100 * MiB)), margin_bytes=10 * MiB)
    plain = max_batch_size(_powers_of_two_cheaper([]), interpolate=False, **kwargs)
    calls = []
    result = max_batch_size(_powers_of_two_cheaper(calls), **kwargs)
    assert result.batch_size == plain.batch_size == 38
    assert _curve(result) == _curve(plain) and result.probe_order == plain.probe_order
    assert calls == [1, 2, 41, 40, 4, 8, 16, 32, 64, 48, 36, 38, 39]


def test_after_the_last_search_with_interpolation_every_size_is_traced(monkeypatch):
    """With one search allowed before traces only, a difference drops every synthesized probe
    and the plain search runs, reusing the traces made: 2 + 2 + 9 traces, answer 38."""
    from oomkit.plan import batch_search

    monkeypatch.setattr(batch_search, "_SEARCHES", 2)
    calls = []
    result = batch_search.max_batch_size(
        _powers_of_two_cheaper(calls), target=Target.resolve(_gpu(100 * MiB)), margin_bytes=10 * MiB
    )
    assert result.batch_size == 38
    assert all(not p.synthesized for p in result.curve)
    assert result.synthesized == 9  # made by the first search, then forgotten
    assert calls == [1, 2, 41, 40, 4, 8, 16, 32, 64, 48, 36, 38, 39]
    # Every size of the plain search (40 among them, traced by the first) and 41.
    assert result.traces == len(calls) == len(result.probe_order) + 1


def test_gpt2_preset_search_synthesizes_the_traced_bytes():
    """GPT-2 124M at seq 128 on 4 GiB: batch 14 in 4 traces (8 without interpolation: 1, 2 to
    learn, 15 as the last size, 14 to confirm); each of the synthesized probes left in the
    curve has the bytes and verdict of the same batch traced."""
    from oomkit.plan.batch_probe import less_margin, predict_built
    from oomkit.plan.batch_search import max_batch_size
    from oomkit.prediction.models import StepOptions, build_preset_step

    def build(batch):
        options = StepOptions(batch_size=batch, seq_len=128, precision="bf16-mixed", optimizer="adamw")
        return build_preset_step("gpt2-124m", options)

    # allow_retries: the largest that fits at all (14 needs one allocator retry; the default
    # answer, without retries, is 13: test_batch_grid.py covers that search).
    result = max_batch_size(build, target=Target.resolve("4GiB"), allow_retries=True)
    assert result.batch_size == 14
    assert result.probe_order == (1, 2, 4, 8, 16, 12, 14, 15)
    assert (result.traces, result.synthesized) == (4, 5)
    assert [p.batch_size for p in result.curve if p.synthesized] == [4, 8, 12, 16]
    searched = less_margin(Target.resolve("4GiB"), result.margin_bytes)
    assert searched is not None
    for probe in result.curve:
        if probe.synthesized:
            traced = predict_built(build, "train step", probe.batch_size, target=searched, steps=2)
            assert (traced.peak_reserved_bytes, traced.peak_allocated_bytes, traced.fits) == (
                probe.train.peak_reserved_bytes,
                probe.train.peak_allocated_bytes,
                probe.fits,
            )
    assert result.description.startswith("GPT-2 124M, batch 14")

"""Emulation sites (prediction/tracing/emulation_sites.py): a kernel that picks its path by a size
is noted in the recording, and plan/trace_interpolation.py synthesizes either path from
recordings made on the other."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oomkit.core.target import Target
from oomkit.core.trace import Frame, TraceEvent
from oomkit.plan.trace_interpolation import (
    TraceInterpolator,
    _normalize,
    recording_structure,
    same_recording,
)
from oomkit.prediction.tracing.emulation_sites import (
    EMBEDDING_BACKWARD_SITE,
    GAMMA_BETA_BACKWARD_SITE,
    REDUCTION_SITE,
    SITE_PLANS,
    EmulationSite,
    GammaBetaBackward,
    embedding_backward_temporaries,
    gamma_beta_backward_program,
    two_pass_gamma_rows,
)
from oomkit.prediction.tracing.recording import TraceRecording

torch = pytest.importorskip("torch")

_OP = SITE_PLANS[EMBEDDING_BACKWARD_SITE].op
_FRAMES = (Frame("train.py", 12, "step"),)


def test_the_embedding_backward_plan_is_embedding_cu():
    """Embedding.cu: up to 3,072 indices, no temporaries; above, sorted and original indices
    (empty_like(indices) each); with scale_grad_by_freq, a count too, whatever the number."""
    assert embedding_backward_temporaries((3072, 8, 0)) == ()
    assert embedding_backward_temporaries((3073, 8, 0)) == (
        ("embedding_sorted_indices", 24584),
        ("embedding_orig_indices", 24584),
    )
    assert embedding_backward_temporaries((10, 4, 1)) == (
        ("embedding_sorted_indices", 40),
        ("embedding_orig_indices", 40),
        ("embedding_count", 40),
    )


def _step(batch, *, seq=1024, tamper=0):
    """A recording as the tracer makes one: an activation of ``batch * 4096`` bytes, then the
    embedding backward's output (``grad_weight``, 1 MiB) with the temporaries its plan gives
    for ``batch * seq`` int64 indices around it (``tamper`` bytes more on the first), then
    the activation freed; two steps."""
    events, sites, next_id = [], [], 0
    temporary = 0
    step_starts = []
    anchor_tags = (("category", "gradient"), ("phase", "backward"), ("module", "wte"), ("op", _OP))
    for _ in range(2):
        step_starts.append(len(events))
        act = next_id
        next_id += 1
        events.append(TraceEvent("alloc", act, batch * 4096, 0, None, _FRAMES, (("category", "activation"),)))
        params = (batch * seq, 8, 0)
        temporaries = embedding_backward_temporaries(params)
        ids = []
        for k, (what, nbytes) in enumerate(temporaries):
            nbytes += tamper if k == 0 else 0
            tags = (("category", "temporary"), ("phase", "backward"), ("module", "wte"), ("op", _OP),
                    ("emulated", what))
            events.append(TraceEvent("alloc", next_id, nbytes, 0, None, _FRAMES, tags))
            ids.append((next_id, nbytes))
            temporary += nbytes
            next_id += 1
        sites.append(EmulationSite(EMBEDDING_BACKWARD_SITE, len(events), params))
        events.append(TraceEvent("alloc", next_id, 2**20, 0, None, _FRAMES, anchor_tags))
        next_id += 1
        for address, nbytes in reversed(ids):
            for action in ("free_requested", "free_completed"):
                events.append(TraceEvent(action, address, nbytes, 0, None, _FRAMES, (("category", "temporary"),)))
        for action in ("free_requested", "free_completed"):
            events.append(TraceEvent(action, act, batch * 4096, 0, None, _FRAMES, (("category", "activation"),)))
    totals = {"activation": 2 * batch * 4096, "gradient": 2 * 2**20}
    if temporary:
        totals["temporary"] = temporary
    return TraceRecording(
        events=tuple(events), step_starts=tuple(step_starts), bytes_by_category=totals,
        sites=tuple(sites),
    )


def test_both_paths_are_one_structure_and_each_is_synthesized_from_the_other():
    """Batches 1-3 (up to 3,072 indices) take the direct path, 4 on the sort path: one
    structure once the temporaries are taken out; learned from 1 and 2, batch 5 comes out with
    its temporaries, and learned from 4 and 6, batch 2 without, event for event."""
    assert len(_step(4).events) == len(_step(3).events) + 12  # 2 temporaries a step, 3 events each
    assert recording_structure(_step(2)) == recording_structure(_step(4))
    small = TraceInterpolator(points=2)
    small.add(1, _step(1))
    small.add(2, _step(2))
    assert same_recording(small.synthesize(5), _step(5))
    assert same_recording(small.synthesize(3), _step(3))
    large = TraceInterpolator(points=2)
    large.add(4, _step(4))
    large.add(6, _step(6))
    assert same_recording(large.synthesize(2), _step(2))
    assert dict(large.synthesize(2).bytes_by_category) == dict(_step(2).bytes_by_category)


@settings(max_examples=40, deadline=None)
@given(
    first=st.integers(1, 20),
    gap=st.integers(1, 20),
    target=st.integers(1, 64),
    seq=st.sampled_from([256, 1024, 2048, 3072, 4096]),
)
def test_any_batch_is_synthesized_as_built_from_any_two(first, gap, target, seq):
    """Whichever two batches are learned from, on either path, the recording at any other batch
    is synthesized as the tracer builds it: events, step starts, sites and totals."""
    interpolator = TraceInterpolator(points=2)
    assert interpolator.add(first, _step(first, seq=seq)) is False
    interpolator.add(first + gap, _step(first + gap, seq=seq))
    if target in (first, first + gap):
        return
    synthesized = interpolator.synthesize(target)
    built = _step(target, seq=seq)
    assert same_recording(synthesized, built)
    assert synthesized.sites == built.sites and synthesized.step_starts == built.step_starts


def _learned(traced, first, second):
    """An interpolator learned from the recordings ``traced`` holds at two batches."""
    interpolator = TraceInterpolator(points=2)
    interpolator.add(first, traced[first])
    interpolator.add(second, traced[second])
    return interpolator


def _norms(batch, *, target=None, width=64, dtype=None, expanded=False):
    """A traced step of a layer norm then an RMSNorm, ``width`` wide (64: 64 / 32 = 2 < 66 SMs / 2
    on an H100), over ``batch * 16,384`` rows (one pass up to batch 4, two passes from 5), a
    contiguous gradient (``expanded``: ``sum()``'s, which the RMSNorm's backward copies); two
    steps."""
    from oomkit.prediction.tracing import trace_step

    dtype = dtype or torch.float32
    ln = torch.nn.LayerNorm(width, device="meta", dtype=dtype)
    rms = torch.nn.RMSNorm(width, device="meta", dtype=dtype)

    def step(model):
        x = torch.randn(batch * 16_384, width, device="cuda", dtype=dtype, requires_grad=True)
        y = rms(ln(x))
        if expanded:
            y.sum().backward()
        else:
            y.backward(torch.ones_like(y))

    target = target or Target.resolve("h100", torch_version="2.13.0")
    return trace_step(step, torch.nn.Sequential(ln, rms), steps=2, target=target)


def test_norm_gradients_past_65536_rows_are_synthesized_from_one_pass_recordings():
    """The layer norm's and RMSNorm's two-pass weight gradients are a site's program: learned
    from batches 1 and 2 (one pass), batches 5 and 9 (two passes: the first gradients, partial
    sums, each .sum(0) with its staging) come out as traced, event for event, and learned from
    6 and 8, batch 3 without them."""
    traced = {b: _norms(b) for b in (1, 2, 3, 5, 6, 8, 9)}
    kinds = [s.kind for s in traced[5].sites if s.kind == GAMMA_BETA_BACKWARD_SITE]
    assert len(kinds) == 4  # two norms, two steps
    two_pass = [e for e in traced[5].events if e.tag("emulated", "").startswith("two_pass_")]
    # a step: the layer norm's 2 first gradients, 2 partial sums and 2 x 2 staging and
    # semaphores; the RMSNorm's 1 + 1 + 2
    assert len(two_pass) == 2 * 12
    assert not [e for e in traced[3].events if e.tag("emulated", "").startswith("two_pass_")]
    assert recording_structure(traced[2]) == recording_structure(traced[5])
    small = _learned(traced, 1, 2)
    for batch in (5, 9):
        assert same_recording(small.synthesize(batch), traced[batch])
    assert same_recording(_learned(traced, 6, 8).synthesize(3), traced[3])


@settings(max_examples=200, deadline=None)
@given(
    rows=st.integers(1, 10**7),
    columns=st.integers(1, 8192),
    sms=st.sampled_from([46, 82, 108, 132]),
    element_bytes=st.sampled_from([2, 4, 8]),
    with_weight=st.booleans(),
    with_bias=st.booleans(),
    copied=st.booleans(),
    branch=st.booleans(),
)
def test_the_two_pass_program_frees_each_temporary_once_after_it_is_made(
    rows, columns, sms, element_bytes, with_weight, with_bias, copied, branch
):
    """Whatever the sizes: nothing without a gradient; on the one-pass path the gradient's copy
    alone, after the last gradient; else one alloc and one later free of each temporary, the
    copy made after the first gradients and freed last, the partial sums of
    ``two_pass_gamma_rows`` rows, and every step beside the weight gradient or the bias gradient
    after it."""
    copy_bytes = rows * columns * element_bytes if copied else 0
    site = GammaBetaBackward(
        rows=rows, columns=columns, width=columns, multiprocessor_count=sms,
        max_threads_per_multiprocessor=2048, element_bytes=element_bytes,
        arg_bytes=8 if element_bytes == 8 else 4, accumulates_in_output=int(element_bytes != 2),
        dgamma_bytes=columns * element_bytes if with_weight else 0,
        dbeta_bytes=columns * element_bytes if with_bias else 0,
        grad_copy_bytes=copy_bytes, two_pass_branch=int(branch),
    )
    steps = gamma_beta_backward_program(site.params())
    partial_rows = two_pass_gamma_rows(rows, columns, sms) if branch else None
    gradients = int(with_weight) + int(with_bias)
    copy = [(s.action, s.nbytes) for s in steps if s.name == "norm_grad_copy"]
    if not gradients:
        assert steps == ()
        return
    assert copy == ([("alloc", copy_bytes), ("free", copy_bytes)] if copied else [])
    if partial_rows is None:
        assert len(steps) == len(copy)
        assert all(step.offset == gradients - 1 and step.after for step in steps)
        return
    order = [(step.offset, step.after) for step in steps]
    assert order == sorted(order)  # before the anchor, after it, after the next output
    assert {step.offset for step in steps} == set(range(gradients))
    made = {}
    for step in steps:
        if step.action == "alloc":
            assert step.name not in made
            made[step.name] = step.nbytes
        else:
            assert made.pop(step.name) == step.nbytes
    assert made == {}
    blocks = [step.nbytes for step in steps if step.name.endswith("_blocks")]
    assert blocks == [partial_rows * columns * element_bytes] * (2 * gradients)
    if copied:
        names = [step.name for step in steps]
        assert names.index("norm_grad_copy") == gradients  # after the first gradients
        assert steps[-1].name == "norm_grad_copy"  # freed last


@settings(max_examples=16, deadline=None)
@given(
    first=st.integers(1, 8),
    gap=st.integers(1, 6),
    target=st.integers(1, 14),
    width=st.sampled_from([64, 768, 1024]),
    bf16=st.booleans(),
    expanded=st.booleans(),
)
def test_any_norm_batch_is_synthesized_as_traced_from_any_two(
    first, gap, target, width, bf16, expanded
):
    """Whichever two batches are learned from, on either side of 65,536 rows, with or without
    a gradient to copy, the recording at any other batch is synthesized as the tracer records
    it: events, step starts and sites."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    traced = {
        b: _norms(b, width=width, dtype=dtype, expanded=expanded)
        for b in {first, first + gap, target}
    }
    if target in (first, first + gap):
        return
    synthesized = _learned(traced, first, first + gap).synthesize(target)
    assert same_recording(synthesized, traced[target])
    assert synthesized.sites == traced[target].sites


def test_before_torch_2_8_the_norm_gradients_take_one_pass_at_any_size():
    """Targets without the two-pass branch reduce in one pass at any size: the layer norm's
    site is noted (it plans a gradient's copy, where there is one; RMSNorm is the composite
    before 2.9), and plans nothing here."""
    recording = _norms(5, target=Target.resolve("h100", torch_version="2.7.1"))
    assert len([s for s in recording.sites if s.kind == GAMMA_BETA_BACKWARD_SITE]) == 2
    assert not [e for e in recording.events if e.tag("emulated", "").startswith("two_pass_")]


def test_a_recording_whose_temporaries_are_not_its_plans_is_taken_as_it_is():
    """8 bytes more on a temporary than the plan gives: not normalized, so not of the direct
    path's structure, and a batch between the two is not synthesized from them."""
    tampered = _step(4, tamper=8)
    assert not _normalize(tampered).stripped and _normalize(_step(4)).stripped
    assert recording_structure(tampered) != recording_structure(_step(2))
    interpolator = TraceInterpolator(points=2)
    interpolator.add(2, _step(2))
    interpolator.add(4, tampered)
    assert interpolator.synthesize(3) is None
    # Taken as it is, it still learns a run of its own: the same tampering at 6 is affine.
    interpolator.add(6, _step(6, tamper=8))
    assert same_recording(interpolator.synthesize(5), _step(5, tamper=8))


def test_a_site_that_points_past_the_events_or_at_an_unknown_plan_is_taken_as_it_is():
    """Sites that do not fit the events (a recording edited by hand) or name no plan: the
    recording is compared as it is, never an IndexError."""
    import dataclasses

    built = _step(4)
    past = dataclasses.replace(built, sites=(EmulationSite(EMBEDDING_BACKWARD_SITE, 10**6, (4096, 8, 0)),))
    unknown = dataclasses.replace(built, sites=(EmulationSite("no such kernel", 3, (1,)),))
    for recording in (past, unknown):
        normalized = _normalize(recording)
        assert not normalized.stripped and normalized.events == built.events


def test_add_says_a_trace_differs_when_its_temporaries_are_not_the_synthesized_ones():
    """Learned from 1 and 2, batch 4 is synthesized with the plan's temporaries: a trace at 4
    with the plan's temporaries is the same, one with another size on one differs."""
    interpolator = TraceInterpolator(points=2)
    interpolator.add(1, _step(1))
    interpolator.add(2, _step(2))
    interpolator.synthesize(4)
    assert interpolator.add(4, _step(4)) is False
    other = TraceInterpolator(points=2)
    other.add(1, _step(1))
    other.add(2, _step(2))
    other.synthesize(4)
    assert other.add(4, _step(4, tamper=8)) is True


def _gpt2_builder(seq=1024):
    from oomkit.prediction.models import StepOptions, build_preset_step

    def build(batch):
        options = StepOptions(batch_size=batch, seq_len=seq, precision="bf16-mixed", optimizer="adamw")
        return build_preset_step("gpt2-124m", options)

    return build


@pytest.fixture
def one_block_gpt2(monkeypatch):
    """Preset gpt2-124m built one block deep and 64 wide (its embeddings as they are: the
    vocabulary and the 1,024 positions), undone after the test: the embedding path is decided
    by the number of indices alone (batch * seq), not by the model's depth or width."""
    import dataclasses
    import types

    from oomkit.prediction.models import presets
    from oomkit.prediction.models.gpt2 import GPT2Shape

    preset = presets.PRESETS["gpt2-124m"]
    shape = GPT2Shape(hidden=64, layers=1, heads=2)
    assert (shape.vocab, shape.positions) == (preset.shape.vocab, preset.shape.positions)
    monkeypatch.setattr(
        presets,
        "PRESETS",
        types.MappingProxyType({**presets.PRESETS, "gpt2-124m": dataclasses.replace(preset, shape=shape)}),
    )


def test_gpt2_recordings_on_the_sort_path_are_synthesized_from_the_direct_path(one_block_gpt2):
    """GPT-2 at seq 1024 sorts its embedding indices from batch 4 on (4,096 > 3,072): traced at
    1 and 2 (direct path), the recordings at 4 and 12 are synthesized equal to their traces,
    event for event, with the temporaries (2 a step), and replay to the same bytes. (GPT-2 one
    block deep: ``one_block_gpt2``; the search over the whole model is the test below.)"""
    from oomkit.core.target import Target
    from oomkit.plan.batch_probe import new_model_cache, record_step
    from oomkit.prediction.predictor import predict_recording

    build, target, models = _gpt2_builder(), Target.resolve("h100"), new_model_cache()
    traced = {
        b: record_step(build, "train step", b, target=target, steps=2, models=models)[0]
        for b in (1, 2, 4, 12)
    }
    # Per step: the position embedding (1,024 indices whatever the batch), then the token one
    # (contiguous indices and gradients: no copies); the rest are the bias gradients' sums and
    # the layer norms' weight and bias gradients (one pass below 65,536 rows).
    embedding = [s.params for s in traced[4].sites if s.kind == EMBEDDING_BACKWARD_SITE]
    assert embedding == [(1024, 8, 0, 0, 0), (4096, 8, 0, 0, 0)] * 2
    assert {s.kind for s in traced[4].sites} == {
        EMBEDDING_BACKWARD_SITE, REDUCTION_SITE, GAMMA_BETA_BACKWARD_SITE
    }
    emulated = [e for e in traced[4].events if e.tag("emulated", "").startswith("embedding_")]
    assert len(emulated) == 4 and {e.size for e in emulated} == {4096 * 8}
    assert not [e for e in traced[2].events if e.tag("emulated", "").startswith("embedding_")]
    assert recording_structure(traced[2]) == recording_structure(traced[4])
    interpolator = _learned(traced, 1, 2)
    for batch in (4, 12):
        synthesized = interpolator.synthesize(batch)
        assert same_recording(synthesized, traced[batch])
        by_synthesis = predict_recording(synthesized, target=target)
        by_trace = predict_recording(traced[batch], target=target)
        assert (by_synthesis.peak_reserved_bytes, by_synthesis.peak_allocated_bytes) == (
            by_trace.peak_reserved_bytes,
            by_trace.peak_allocated_bytes,
        )


def test_gpt2_search_across_the_embedding_path_runs_once():
    """`fit gpt2-124m --gpu h100`: learned from 1 and 2, the sizes from 4 on synthesized on the
    sort path, and 75 and 76 traced to confirm: 4 traces, 11 syntheses, one search (it was 5
    and 20, two searches, before the site); a synthesized size has its trace's bytes."""
    from oomkit.plan.batch_probe import less_margin, predict_built
    from oomkit.plan.batch_search import max_batch_size

    build = _gpt2_builder()
    # allow_retries: the search as it was written (the largest may fit with an allocator retry)
    result = max_batch_size(build, target=Target.resolve("h100"), allow_retries=True)
    # 74 since Hopper's CUDA context is the H200's measured 685 MiB (75 with the 500 MiB estimate)
    assert (result.batch_size, result.traces, result.synthesized) == (74, 4, 11)
    assert result.probe_order == (1, 2, 4, 8, 16, 32, 64, 128, 96, 80, 72, 76, 74, 75)
    searched = less_margin(result.target, result.margin_bytes)
    probe = next(p for p in result.curve if p.batch_size == 8)
    assert probe.synthesized
    traced = predict_built(build, "train step", 8, target=searched, steps=2)
    assert (traced.peak_reserved_bytes, traced.peak_allocated_bytes) == (
        probe.train.peak_reserved_bytes,
        probe.train.peak_allocated_bytes,
    )

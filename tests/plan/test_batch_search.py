"""Tests for oomkit.plan.batch_search: the largest batch that fits, and the smallest GPU."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oomkit.core.gpus import CATALOG, GpuSpec
from oomkit.core.target import Target
from oomkit.errors import ConfigError, NoFeasibleBatchSizeError, UserCodeError
from oomkit.plan.batch_search import (
    MIN_DEFAULT_MARGIN_BYTES,
    default_margin_bytes,
    max_batch_size,
    smallest_gpu,
)

torch = pytest.importorskip("torch")

MiB = 2**20
GiB = 2**30


def _gpu(total_bytes, name="test GPU"):
    return GpuSpec(name=name, total_memory_bytes=total_bytes, context_overhead_bytes=0)


def _need_bytes(batch, extra=4, per_batch=1):
    # One request of (per_batch * batch + extra) * 2 MiB: at least 10 MiB, so it gets its own
    # segment rounded to 2 MiB (CUDACachingAllocator.cpp get_allocation_size), i.e. exactly this.
    return (per_batch * batch + extra) * 2 * MiB


def _linear(calls=None, extra=4, per_batch=1):
    """A builder whose step reserves exactly _need_bytes(batch) at its peak, every step."""

    def build(batch):
        if calls is not None:
            calls.append(batch)

        def step():
            torch.empty(_need_bytes(batch, extra, per_batch), dtype=torch.uint8)

        return step

    return build


def _true_max(capacity_bytes, margin_bytes, max_batch, extra=4, per_batch=1):
    fitting = [
        b
        for b in range(1, max_batch + 1)
        if _need_bytes(b, extra, per_batch) + margin_bytes <= capacity_bytes
    ]
    return max(fitting, default=None)


def test_bracket_then_bisect_probes_exact_sizes():
    """Doubling from 1 to the first misfit (64), then bisection: 12 probes, answer 41."""
    calls = []
    # interpolate=False: every size traced (test_fit_interpolation.py has the interpolated search).
    result = max_batch_size(
        _linear(calls), target=Target.resolve(_gpu(100 * MiB)), margin_bytes=10 * MiB, interpolate=False
    )
    assert result.probe_order == (1, 2, 4, 8, 16, 32, 64, 48, 40, 44, 42, 41)
    assert result.batch_size == 41
    assert result.traces == 12
    assert calls == list(result.probe_order)  # every size built and traced once
    assert result.peak_reserved_bytes == 90 * MiB
    assert result.peak_allocated_bytes == 90 * MiB
    assert result.headroom_bytes == 10 * MiB
    assert result.margin_bytes == 10 * MiB and not result.margin_is_default
    assert result.first_failing_batch == 42
    assert result.usable_bytes == 100 * MiB and result.capacity_bytes == 100 * MiB


def test_curve_lists_every_probe_by_batch():
    """The curve holds (batch, peak reserved, fits) for every size tried, sorted by batch."""
    result = max_batch_size(
        _linear(), target=Target.resolve(_gpu(100 * MiB)), margin_bytes=10 * MiB
    )
    curve = [(p.batch_size, p.peak_reserved_bytes, p.fits) for p in result.curve]
    assert curve == [
        (1, 10 * MiB, True),
        (2, 12 * MiB, True),
        (4, 16 * MiB, True),
        (8, 24 * MiB, True),
        (16, 40 * MiB, True),
        (32, 72 * MiB, True),
        (40, 88 * MiB, True),
        (41, 90 * MiB, True),
        (42, 92 * MiB, False),  # no OOM, but 8 MiB left is under the 10 MiB margin
        (44, 96 * MiB, False),
        (48, 104 * MiB, False),  # would OOM: what it needs on an unlimited device
        (64, 136 * MiB, False),
    ]
    assert result.answer.batch_size == 41


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    capacity_bytes=st.integers(min_value=8 * MiB, max_value=400 * MiB),
    margin_bytes=st.integers(min_value=0, max_value=40 * MiB),
    max_batch=st.integers(min_value=1, max_value=300),
)
def test_answer_is_the_true_maximum_and_never_above(capacity_bytes, margin_bytes, max_batch):
    """For a step linear in batch, the search finds exactly the largest fitting batch."""
    expected = _true_max(capacity_bytes, margin_bytes, max_batch)
    if expected is None:
        # A margin not below the GPU is a contradiction (ConfigError); else batch 1 is too big.
        error = ConfigError if margin_bytes >= capacity_bytes else NoFeasibleBatchSizeError
        with pytest.raises(error, match="not even batch 1 fits|no batch could fit"):
            max_batch_size(
                _linear(), target=Target.resolve(_gpu(capacity_bytes)), margin_bytes=margin_bytes, max_batch=max_batch
            )
        return
    result = max_batch_size(
        _linear(), target=Target.resolve(_gpu(capacity_bytes)), margin_bytes=margin_bytes, max_batch=max_batch
    )
    assert result.batch_size == expected
    assert result.headroom_bytes >= margin_bytes
    assert all(p.fits == (p.batch_size <= expected) for p in result.curve)
    # Doubling to at most max_batch, then one bisection: never more than 2 * log2 + 2 probes.
    assert result.traces <= 2 * max_batch.bit_length() + 2


def test_margin_excludes_batches_that_would_fit_without_it():
    """A 20 MiB margin lowers the answer from 46 (100 MiB, exact fit) to 36."""
    exact = max_batch_size(_linear(), target=Target.resolve(_gpu(100 * MiB)), margin_bytes=0)
    with_margin = max_batch_size(
        _linear(), target=Target.resolve(_gpu(100 * MiB)), margin_bytes=20 * MiB
    )
    assert exact.batch_size == 46 and exact.headroom_bytes == 0
    assert with_margin.batch_size == 36 and with_margin.headroom_bytes == 20 * MiB


def test_a_memory_fraction_in_the_setting_is_what_the_margin_comes_off():
    """per_process_memory_fraction:0.5 on 200 MiB: the allocator may reserve 100 MiB, so a
    20 MiB margin leaves 80 MiB and the answer is 36 ((36 + 4) * 2 MiB), as on a 100 MiB
    GPU; usable and headroom are of the 100 MiB. The margin had come off the GPU's 200 MiB
    only (batch 46, at the limit, no headroom left) and the headroom had been of 200 MiB."""
    target = Target.resolve(_gpu(200 * MiB), alloc_conf="per_process_memory_fraction:0.5")
    assert target.usable_bytes == 100 * MiB
    result = max_batch_size(_linear(), target=target, margin_bytes=20 * MiB)
    assert (result.batch_size, result.usable_bytes, result.headroom_bytes) == (36, 100 * MiB, 20 * MiB)
    assert result.alloc_conf == "per_process_memory_fraction:0.5"
    assert all(p.headroom_bytes == 100 * MiB - p.peak_reserved_bytes for p in result.curve)


def test_default_margin_is_two_percent_at_least_256_mib():
    """The default margin: 2% of usable rounded down to 2 MiB, never under 256 MiB."""
    assert MIN_DEFAULT_MARGIN_BYTES == 256 * MiB
    assert default_margin_bytes(10 * GiB) == 256 * MiB  # 2% would be 204.8 MiB
    assert default_margin_bytes(20 * GiB) == 408 * MiB  # 409.6 MiB rounded down to 2 MiB
    assert default_margin_bytes(80 * GiB) == 1638 * MiB  # 1638.4 MiB


def test_default_margin_applies_and_is_stated():
    """Without margin_bytes the default is used and flagged: 256 MiB on a 1 GiB device."""
    result = max_batch_size(_linear(per_batch=8), target=Target.resolve(_gpu(GiB)))
    assert result.margin_is_default and result.margin_bytes == 256 * MiB
    # (8b + 4) * 2 MiB <= 768 MiB  ->  b <= 47
    assert result.batch_size == 47


def test_eval_step_can_limit_the_batch():
    """An eval step needing 3x the memory per sample caps the batch at 15, named as the limit."""
    result = max_batch_size(
        _linear(),
        target=Target.resolve(_gpu(100 * MiB)),
        margin_bytes=0,
        eval_step=_linear(per_batch=3),
        interpolate=False,  # every size traced, to count them
    )
    assert result.probe_order == (1, 2, 4, 8, 16, 12, 14, 15)
    assert result.batch_size == 15
    assert result.limiting_step == "eval"
    assert result.peak_reserved_bytes == _need_bytes(15, per_batch=3)  # 98 MiB, from eval
    assert result.answer.eval is not None
    assert result.traces == 16  # the training step fits at every size, so each has an eval trace


def test_eval_is_skipped_where_training_already_fails():
    """A batch whose training step does not fit costs one trace, not two."""
    result = max_batch_size(
        _linear(per_batch=3),
        target=Target.resolve(_gpu(100 * MiB)),
        margin_bytes=0,
        eval_step=_linear(),
        interpolate=False,  # every size traced, to count them
    )
    # Training: (3b + 4) * 2 MiB <= 100 MiB -> 15; the eval step (b + 4) fits wherever it does.
    assert result.batch_size == 15
    assert result.limiting_step == "train step 1"
    assert result.probe_order == (1, 2, 4, 8, 16, 12, 14, 15)
    assert result.traces == 15  # 16 fails in training: its eval is never traced
    assert next(p for p in result.curve if p.batch_size == 16).eval is None


def _first_step_spike(batch):
    """A step whose first call (the first optimizer step) needs 4 MiB more than later ones."""
    calls = []

    def step():
        calls.append(None)
        extra = 6 if len(calls) == 1 else 4
        torch.empty(_need_bytes(batch, extra=extra), dtype=torch.uint8)

    return step


def test_first_optimizer_step_limits_the_batch():
    """The first step's spike counts: 44 fits the steady state but not step 1, answer 44 -> 42."""
    result = max_batch_size(
        _first_step_spike, target=Target.resolve(_gpu(100 * MiB)), margin_bytes=0
    )
    # Step 1: (b + 6) * 2 MiB <= 100 MiB -> 44; the steady state alone would allow 46.
    assert result.batch_size == 44
    assert result.limiting_step == "train step 1"
    assert result.peak_reserved_bytes == 100 * MiB


def test_steps_one_warns_that_the_steady_state_is_unchecked():
    """steps=1 records only the first step and says so in the warnings."""
    result = max_batch_size(
        _linear(), target=Target.resolve(_gpu(100 * MiB)), margin_bytes=0, steps=1
    )
    assert result.batch_size == 46
    assert any("only the first training step" in w for w in result.warnings)


def test_steady_state_growth_limits_at_train_step_2():
    """State created in step 1 and kept makes step 2 the limit (steps=1 would overshoot)."""
    state = {}

    def build(batch):
        kept = []

        def step():
            if kept:
                torch.empty(_need_bytes(batch), dtype=torch.uint8)
            else:
                kept.append(torch.empty(_need_bytes(batch), dtype=torch.uint8))

        state[batch] = kept
        return step

    two = max_batch_size(build, target=Target.resolve(_gpu(100 * MiB)), margin_bytes=0, steps=2)
    one = max_batch_size(build, target=Target.resolve(_gpu(100 * MiB)), margin_bytes=0, steps=1)
    # Step 2 holds the kept state and a second block: 2 * (b + 4) * 2 MiB <= 100 MiB -> 21.
    assert two.batch_size == 21 and two.limiting_step == "train step 2"
    assert one.batch_size == 46


def test_start_batch_above_the_answer_bisects_down():
    """Starting at 64 (too big), the search bisects (0, 64) and never probes 1."""
    result = max_batch_size(
        _linear(), target=Target.resolve(_gpu(100 * MiB)), margin_bytes=10 * MiB, start_batch=64
    )
    assert result.probe_order == (64, 32, 48, 40, 44, 42, 41)
    assert result.batch_size == 41


def test_start_batch_below_the_answer_doubles_from_it():
    """Starting at 20: 20, 40, 80, then bisection down to 41."""
    result = max_batch_size(
        _linear(), target=Target.resolve(_gpu(100 * MiB)), margin_bytes=10 * MiB, start_batch=20
    )
    assert result.probe_order == (20, 40, 80, 60, 50, 45, 42, 41)


def test_max_batch_stops_the_search_with_a_warning():
    """When max_batch fits, it is the answer and the result says the search stopped there."""
    result = max_batch_size(
        _linear(), target=Target.resolve(_gpu(GiB)), margin_bytes=0, max_batch=10
    )
    assert result.probe_order == (1, 2, 4, 8, 10)
    assert result.batch_size == 10
    assert result.first_failing_batch is None
    assert any("max_batch" in w for w in result.warnings)


def test_batch_one_not_fitting_raises_with_advice():
    """Not even batch 1 fits in 9 MiB: NoFeasibleBatchSizeError says what to try."""
    with pytest.raises(NoFeasibleBatchSizeError, match=r"not even batch 1 fits.*--checkpointing") as raised:
        max_batch_size(_linear(), target=Target.resolve(_gpu(9 * MiB)), margin_bytes=0)
    # The figures of the message, as numbers: batch 1 reserves more than the 9 MiB usable.
    error = raised.value
    assert (error.usable_bytes, error.margin_bytes) == (9 * MiB, 0)
    assert error.needed_reserved_bytes is not None and error.needed_reserved_bytes > 9 * MiB


@given(over_mib=st.integers(min_value=0, max_value=2**20))
@settings(max_examples=25, deadline=None)
def test_a_given_margin_not_below_usable_is_a_config_error_before_tracing(over_mib):
    """A margin the user gives that leaves nothing of the GPU contradicts the question: a
    ConfigError naming both figures and the default, raised without calling the builder."""
    calls: list[int] = []
    with pytest.raises(ConfigError) as raised:
        max_batch_size(
            _linear(calls),
            target=Target.resolve(_gpu(100 * MiB)),
            margin_bytes=(100 + over_mib) * MiB,
        )
    assert calls == []
    assert not isinstance(raised.value, NoFeasibleBatchSizeError)
    assert "usable on test GPU, so no batch could fit. Give a margin below 100.00 MiB" in str(
        raised.value
    )
    assert "the default is 256.00 MiB here" in str(raised.value)


def test_the_default_margin_above_a_small_gpu_is_nothing_fitting():
    """The default margin (256 MiB at least) above a 100 MiB GPU is not the user's doing:
    NoFeasibleBatchSizeError (fit exits 1), still without calling the builder."""
    calls: list[int] = []
    with pytest.raises(NoFeasibleBatchSizeError, match="nothing fits on test GPU") as raised:
        max_batch_size(_linear(calls), target=Target.resolve(_gpu(100 * MiB)))
    assert calls == []
    assert (raised.value.usable_bytes, raised.value.margin_bytes) == (100 * MiB, 256 * MiB)


def test_margin_is_held_as_memory_the_allocator_cannot_use():
    """The margin is replayed as missing memory: a cache flush may still make room, with a warning.

    Each step makes a 50 MiB block, frees it (cached), then asks for 60 MiB. With a 30 MiB
    margin 70 MiB are usable: 50 + 60 does not fit, so the allocator frees the cached 50 MiB and
    retries (CUDACachingAllocator.cpp malloc: release_cached_blocks, then alloc_block again).
    With a 45 MiB margin not even 60 MiB fits.
    """

    def build(batch):
        def step():
            a = torch.empty(50 * MiB, dtype=torch.uint8)
            del a
            torch.empty(60 * MiB, dtype=torch.uint8)

        return step

    tight = max_batch_size(
        build, target=Target.resolve(_gpu(100 * MiB)), margin_bytes=30 * MiB, max_batch=1
    )
    assert tight.batch_size == 1 and tight.peak_reserved_bytes == 60 * MiB
    # Step 1 retries once; step 2 splits the cached 60 MiB segment for the 50 MiB block, which
    # merges back when freed and then serves the 60 MiB request: no retry there.
    assert tight.answer.train.num_alloc_retries == 1
    assert any("frees its cache and retries 1 time(s)" in w for w in tight.warnings)
    with pytest.raises(NoFeasibleBatchSizeError, match="not even batch 1 fits"):
        max_batch_size(
            build, target=Target.resolve(_gpu(100 * MiB)), margin_bytes=45 * MiB, max_batch=1
        )


def test_curve_that_shrinks_with_batch_is_warned_about():
    """Batch 1 needing more than batch 2 (no cache flush involved) is named in a warning."""

    def build(batch):
        size = 30 * MiB if batch == 1 else _need_bytes(batch)
        return lambda: torch.empty(size, dtype=torch.uint8)

    result = max_batch_size(
        build, target=Target.resolve(_gpu(100 * MiB)), margin_bytes=0, max_batch=2
    )
    assert result.batch_size == 2
    assert any(
        "batch 2 needs 12.00 MiB, less than batch 1 (30.00 MiB)" in w for w in result.warnings
    )


def test_progress_reports_each_probe_with_a_closing_total():
    """progress gets (probes made, probes expected) once per probe; the last says n of n."""
    seen = []
    result = max_batch_size(
        _linear(),
        target=Target.resolve(_gpu(100 * MiB)),
        margin_bytes=10 * MiB,
        progress=lambda d, t: seen.append((d, t)),
        interpolate=False,  # one call per probe; test_fit_interpolation.py counts confirmations
    )
    assert [d for d, _ in seen] == list(range(1, 13))
    assert all(t >= d for d, t in seen)
    assert seen[-1] == (12, 12)
    assert result.traces == 12


def test_builder_may_return_step_and_tracked_objects():
    """(step, objects) counts the objects from the start: a 10 MiB tensor lowers 46 to 41."""

    def build(batch):
        weights = torch.empty(10 * MiB, dtype=torch.uint8)  # made under torch.device("meta")
        assert weights.device.type == "meta"
        return _linear()(batch), [weights]

    result = max_batch_size(build, target=Target.resolve(_gpu(100 * MiB)), margin_bytes=0)
    assert result.batch_size == 41  # (b + 4) * 2 MiB + 10 MiB <= 100 MiB
    assert result.peak_reserved_bytes == 100 * MiB


def test_builder_returning_a_non_step_is_a_user_error():
    """A builder that returns a number is rejected with the forms it may return."""
    with pytest.raises(UserCodeError, match="BuiltStep"):
        max_batch_size(lambda b: 42, target=Target.resolve(_gpu(100 * MiB)), margin_bytes=0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"steps": 0}, "steps must be"),
        ({"max_batch": 0}, "max_batch must be"),
        ({"start_batch": 9, "max_batch": 8}, "above max_batch"),
        ({"margin_bytes": -1}, "margin_bytes must be"),
    ],
)
def test_bad_arguments_say_what_to_pass(kwargs, match):
    """Bad search arguments raise ValueError with an example."""
    with pytest.raises(ValueError, match=match):
        max_batch_size(_linear(), target=Target.resolve(_gpu(100 * MiB)), **kwargs)


def test_smallest_gpu_names_the_smallest_fit_with_exact_headroom():
    """Batch 30 needs 68 MiB: no fit on 50 MiB, fits on 100 MiB (32 MiB headroom) and 200 MiB."""
    candidates = [_gpu(200 * MiB, "big"), _gpu(50 * MiB, "small"), _gpu(100 * MiB, "mid")]
    result = smallest_gpu(_linear(), 30, candidates=candidates, margin_bytes=0)
    rows = [(f.gpu.name, f.fits, f.headroom_bytes) for f in result.candidates]
    assert rows == [("small", False, -18 * MiB), ("mid", True, 32 * MiB), ("big", True, 132 * MiB)]
    assert result.smallest is not None and result.smallest.name == "mid"
    assert result.traces == 1  # one compute capability (None): one trace, three replays


def test_smallest_gpu_margin_can_rule_out_a_fit():
    """With a 40 MiB margin the 100 MiB device (32 MiB headroom) no longer counts."""
    candidates = [_gpu(100 * MiB, "mid"), _gpu(200 * MiB, "big")]
    result = smallest_gpu(_linear(), 30, candidates=candidates, margin_bytes=40 * MiB)
    assert [f.fits for f in result.candidates] == [False, True]
    assert result.smallest is not None and result.smallest.name == "big"


def test_smallest_gpu_under_a_memory_fraction_counts_each_gpu_s_share():
    """per_process_memory_fraction:0.5: batch 30 (68 MiB) fits in half of 200 MiB (32 MiB
    headroom), not in half of 100 MiB (-18 MiB); each row's usable memory is that half."""
    candidates = [_gpu(100 * MiB, "mid"), _gpu(200 * MiB, "big")]
    base = Target.resolve(_gpu(100 * MiB), alloc_conf="per_process_memory_fraction:0.5")
    result = smallest_gpu(_linear(), 30, candidates=candidates, margin_bytes=0, target=base)
    rows = [(f.gpu.name, f.fits, f.headroom_bytes, f.usable_bytes) for f in result.candidates]
    assert rows == [("mid", False, -18 * MiB, 50 * MiB), ("big", True, 32 * MiB, 100 * MiB)]


def test_smallest_gpu_traces_once_per_compute_capability():
    """Over the catalog, one trace per distinct compute capability; sorted by total memory."""
    result = smallest_gpu(_linear(), 8, margin_bytes=0)
    assert result.traces == len({g.compute_capability for g in CATALOG})
    totals = [f.gpu.total_memory_bytes for f in result.candidates]
    assert totals == sorted(totals)
    assert result.smallest == result.candidates[0].gpu  # 24 MiB fits everywhere


def test_smallest_gpu_accepts_a_recording():
    """A recording is replayed as is on every candidate, with no trace made."""
    from oomkit.prediction.tracing import trace_step

    recording = trace_step(lambda: torch.empty(30 * MiB, dtype=torch.uint8, device="meta"))
    result = smallest_gpu(
        recording, candidates=[_gpu(20 * MiB, "small"), _gpu(40 * MiB, "mid")], margin_bytes=0
    )
    assert result.traces == 0 and result.batch_size is None
    assert result.smallest is not None and result.smallest.name == "mid"
    assert result.candidates[1].headroom_bytes == 10 * MiB


def test_smallest_gpu_with_an_eval_step_that_does_not_fit():
    """The eval step counts: training fits on 100 MiB, evaluation (3x per sample) does not."""
    candidates = [_gpu(100 * MiB, "mid"), _gpu(400 * MiB, "big")]
    result = smallest_gpu(
        _linear(), 30, candidates=candidates, margin_bytes=0, eval_step=_linear(per_batch=3)
    )
    assert [(f.fits, f.limiting_step) for f in result.candidates] == [
        (False, "eval"),
        (True, "eval"),
    ]
    assert result.traces == 2


def test_smallest_gpu_needs_a_batch_with_a_builder():
    """A builder without batch_size is a usage error."""
    with pytest.raises(ValueError, match="needs batch_size"):
        smallest_gpu(_linear())


def test_max_batch_size_takes_a_target_and_keeps_it():
    """target= is the GPU and the allocator setting: the search runs on it and keeps it."""
    target = Target.resolve(_gpu(100 * MiB), "max_split_size_mb:64")
    by_target = max_batch_size(_linear(), target=target, margin_bytes=10 * MiB)
    by_keywords = max_batch_size(
        _linear(),
        target=Target.resolve(_gpu(100 * MiB), alloc_conf="max_split_size_mb:64"),
        margin_bytes=10 * MiB,
    )
    assert by_target.target == target
    assert by_target.alloc_conf == "max_split_size_mb:64"
    assert (by_target.batch_size, by_target.probe_order) == (
        by_keywords.batch_size,
        by_keywords.probe_order,
    )
    # Each probe is predicted on the target less the margin (held outside the allocator).
    assert by_target.answer.train.target == target.with_gpu(
        GpuSpec("test GPU", 100 * MiB, 10 * MiB)
    )
    # No target: an H100 with PyTorch's default allocator setting, the newest torch.
    assert max_batch_size(_linear(), max_batch=1).target == Target.resolve("h100")
    with pytest.raises(TypeError, match="gpu"):
        max_batch_size(_linear(), gpu="h100")  # type: ignore[call-arg]


def test_smallest_gpu_replaces_only_the_targets_gpu():
    """smallest_gpu(target=T) replays on each candidate with T's allocator setting and versions."""
    target = Target.resolve("h100", "max_split_size_mb:64", cudnn_version=91002)
    candidates = [_gpu(100 * MiB, "mid"), _gpu(50 * MiB, "small")]
    result = smallest_gpu(_linear(), 30, candidates=candidates, margin_bytes=0, target=target)
    assert [(f.gpu.name, f.fits) for f in result.candidates] == [("small", False), ("mid", True)]
    with pytest.raises(TypeError, match="alloc_conf"):
        smallest_gpu(_linear(), 30, candidates=candidates, alloc_conf="")  # type: ignore[call-arg]

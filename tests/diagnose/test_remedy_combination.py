"""When no one measured change makes a step fit, the least combination that does is offered,
re-predicted as the flags it prints; and a batch remedy is recorded with its accumulation.

Before, a step that no one change made fit got only remedies that "still do not fit"
(``oomkit predict llama-1b --batch 16 --seq 4096 --gpu rtx4090``: three of them; now
"activation checkpointing + pure bf16 ... + batch size 2 with 8 gradient-accumulation steps,
needs 17.12 GiB, fits", as predicting those flags gives). And the batch remedy
was measured as a plain smaller batch while it printed ``--grad-accum N``, which keeps the
gradients alive through the next micro-batch (tests/diagnose/test_model_remedies.py: GPT-2 on
3 GiB had been offered batch 2, which does not fit with its accumulation).
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oomkit.core.target import Target
from oomkit.diagnose.remedy_measurement import (
    measure_remedies,
    prediction_remedies,
    rank_measured,
)

pytest.importorskip("torch")

from oomkit.prediction.models import StepOptions  # noqa: E402


@dataclasses.dataclass(frozen=True)
class _Need:
    """What a fake re-prediction returns: its need and whether it fits."""

    required_bytes: int
    fits: bool


def _fake(usable: int, per_sample: int, checkpointed_per_sample: int):
    """A re-prediction whose need grows with the batch: the states by precision, the
    activations per sample, and the gradients kept between micro-batches under accumulation.
    Changes of the optimizer or what is trained save nothing here."""
    calls: list[StepOptions] = []

    def again(options: StepOptions, layout: object) -> _Need:
        calls.append(options)
        if layout is not None:  # any FSDP mesh fits
            return _Need(1, True)
        states = {"fp32": 1600, "bf16-mixed": 1700, "bf16": 800}[options.precision]
        sample = checkpointed_per_sample if options.checkpointing == "full" else per_sample
        kept = (400 if options.precision == "fp32" else 200) if options.grad_accum > 1 else 0
        if options.lora is not None or options.quantize is not None or options.optimizer != "adamw":
            return _Need(10**9, False)
        need = states + kept + sample * options.batch_size
        return _Need(need, need <= usable)

    return again, calls


BASE = StepOptions(batch_size=16, seq_len=128, precision="fp32", optimizer="adamw")


def test_the_least_combination_that_fits_at_the_largest_halved_batch():
    again, calls = _fake(usable=1100, per_sample=100, checkpointed_per_sample=20)
    remedies, _ = measure_remedies(BASE, again, required_bytes=3200, usable_bytes=1100,
                                   compute_capability=(9, 0))
    fitting = [r for r in remedies if r.fits]
    assert len(fitting) == 1
    combined = fitting[0]
    assert combined.title == (
        "activation checkpointing + pure bf16 weights, gradients and optimizer states + batch "
        "size 4 with 4 gradient-accumulation steps"
    )
    assert combined.flag == "--checkpointing full --precision bf16 --batch 4 --grad-accum 4"
    assert combined.peak_reserved_bytes == 800 + 200 + 20 * 4
    assert combined.saving_bytes == 3200 - 1080
    assert "with these changes together (no one of them fits alone) the step needs" in combined.why
    # Every re-prediction at a smaller batch keeps the gradients between two micro-batches.
    assert all(c.grad_accum == 2 for c in calls if c.batch_size < 16)
    checkpointed = [(c.precision, c.batch_size) for c in calls if c.checkpointing == "full"]
    # checkpointing alone (the single change) at 16, then at batch 1; with mixed precision at
    # 16 and 1; with pure bf16 at 16 and 1, then the bisection of 8, 4, 2: 4 fits, 8 does not.
    assert checkpointed == [
        ("fp32", 16), ("fp32", 1),
        ("bf16-mixed", 16), ("bf16-mixed", 1),
        ("bf16", 16), ("bf16", 1), ("bf16", 4), ("bf16", 8),
    ]


def test_a_combination_the_model_cannot_take_is_skipped_not_raised():
    from oomkit.errors import OomkitError

    again, _ = _fake(usable=1100, per_sample=100, checkpointed_per_sample=20)

    def refusing(options: StepOptions, layout: object) -> _Need:
        if options.checkpointing == "full" and options.precision == "bf16-mixed":
            raise OomkitError("this pairing is not modelled")
        return again(options, layout)

    remedies, _ = measure_remedies(BASE, refusing, required_bytes=3200, usable_bytes=1100,
                                   compute_capability=(9, 0))
    assert [r.flag for r in remedies if r.fits] == [
        "--checkpointing full --precision bf16 --batch 4 --grad-accum 4"
    ]


def test_the_progress_goes_on_through_the_combination_and_ends_full():
    again, calls = _fake(usable=1100, per_sample=100, checkpointed_per_sample=20)
    seen: list[tuple[int, int]] = []
    measure_remedies(BASE, again, required_bytes=3200, usable_bytes=1100,
                     compute_capability=(9, 0), progress=lambda done, total: seen.append((done, total)))
    done = [d for d, _ in seen]
    assert done == sorted(done) and seen[-1][0] == seen[-1][1]
    assert all(d <= t for d, t in seen)
    # The single changes and the batch halvings count first (8 = 7 changes + the batch); then
    # one tick for each of the combination's 7 re-predictions.
    assert [d for d, t in seen if d > 8] == list(range(9, 16)) + [15]
    assert seen[-1] == (15, 15)
    assert len(calls) == 7 + 4 + 7  # the changes, batches 8, 4, 2, 1, the combination


def test_no_combination_is_tried_when_one_change_fits():
    again, calls = _fake(usable=2400, per_sample=100, checkpointed_per_sample=20)
    remedies, _ = measure_remedies(BASE, again, required_bytes=3200, usable_bytes=2400,
                                   compute_capability=(9, 0))
    assert {r.title for r in remedies if r.fits} == {
        "activation checkpointing", "pure bf16 weights, gradients and optimizer states",
        "batch size 4 with 4 gradient-accumulation steps",
    }
    # seven single changes (precision twice, checkpointing, SGD, LoRA, QLoRA, 8-bit AdamW),
    # then batches 8 and 4 (8 does not fit); no combination
    assert len(calls) == 7 + 2
    assert not any(" + " in r.title for r in remedies)


def test_a_combination_on_the_gpus_one_has_comes_before_sharding_over_more():
    again, _ = _fake(usable=1100, per_sample=100, checkpointed_per_sample=20)
    remedies, _ = measure_remedies(BASE, again, required_bytes=3200, usable_bytes=1100,
                                   compute_capability=(9, 0), fsdp_sizes=(2,))
    ranked = rank_measured(remedies, 3200 - 1100)
    assert [r.flag for r in ranked[:2]] == [
        "--checkpointing full --precision bf16 --batch 4 --grad-accum 4", "--fsdp 2",
    ]


def test_nothing_is_offered_when_no_combination_fits_even_at_batch_1():
    again, _ = _fake(usable=900, per_sample=100, checkpointed_per_sample=20)
    remedies, _ = measure_remedies(BASE, again, required_bytes=3200, usable_bytes=900,
                                   compute_capability=(9, 0))
    assert not any(r.fits for r in remedies)


@settings(max_examples=60, deadline=None)
@given(
    usable=st.integers(min_value=500, max_value=4000),
    per_sample=st.integers(min_value=1, max_value=300),
    checkpointed=st.integers(min_value=1, max_value=300),
    batch=st.integers(min_value=1, max_value=64),
)
def test_the_combination_is_the_first_that_fits_at_its_largest_halving(
    usable, per_sample, checkpointed, batch
):
    """Against a brute force over the same combinations and every halving."""
    base = dataclasses.replace(BASE, batch_size=batch)
    again, _ = _fake(usable, per_sample, checkpointed)
    full = again(base, None)
    if full.fits:
        return
    remedies, _ = measure_remedies(base, again, required_bytes=full.required_bytes,
                                   usable_bytes=usable, compute_capability=(9, 0))
    if any(r.fits and " + " not in r.title for r in remedies):
        assert not any(" + " in r.title for r in remedies)
        return
    halvings, size = [], batch
    while size > 1 and len(halvings) < 8:
        size //= 2
        halvings.append(size)
    expected = None
    for fields in ({"checkpointing": "full"},
                   {"checkpointing": "full", "precision": "bf16-mixed"},
                   {"checkpointing": "full", "precision": "bf16"}):
        options = dataclasses.replace(base, **fields)
        if len(fields) > 1 and again(options, None).fits:
            expected = (fields, batch)
            break
        sizes = [n for n in halvings
                 if again(dataclasses.replace(options, batch_size=n, grad_accum=2), None).fits]
        if sizes:
            expected = (fields, sizes[0])
            break
    combined = [r for r in remedies if " + " in r.title]
    if expected is None:
        assert not any(r.fits for r in remedies)
    else:
        fields, size = expected
        flag = " ".join(
            [f"--checkpointing {fields['checkpointing']}"]
            + ([f"--precision {fields['precision']}"] if "precision" in fields else [])
            + ([f"--batch {size} --grad-accum {-(-batch // size)}"] if size != batch else [])
        )
        assert [r.flag for r in combined] == [flag]


def test_a_real_step_s_combination_is_what_its_flags_predict(monkeypatch):
    """GPT-2 124M (batch 8, seq 256, fp32, AdamW) on 1.6 GiB with nothing outside PyTorch: no
    change of precision, checkpointing or optimizer fits alone; checkpointing with pure bf16
    at batch 4 (2 accumulation steps) does, and its need is the prediction of exactly those
    flags. (LoRA and QLoRA, which fit GPT-2 there alone, are left out of the changes tried.)"""
    from oomkit.diagnose import remedy_measurement
    from oomkit.prediction.models import build_preset_step

    every_change = remedy_measurement.step_changes
    monkeypatch.setattr(
        remedy_measurement, "step_changes",
        lambda base, cc: [c for c in every_change(base, cc) if not c.fields.keys() & {"lora", "quantize"}],
    )
    from oomkit.prediction.predictor import predict
    from oomkit.prediction.workload import WorkloadSpec

    target = Target.resolve("1.6GiB", context_overhead_bytes=0)

    def predicted(**change):
        built = build_preset_step(
            "gpt2-124m", StepOptions(**({"batch_size": 8, "seq_len": 256, "precision": "fp32"}
                                        | change))
        )
        spec = WorkloadSpec("preset", "gpt2-124m", **dataclasses.asdict(built.options), steps=2)
        return predict(built.step_fn, target=target, steps=2, track=built.track,
                       description=built.description, workload=spec)

    prediction = predicted()
    remedies = prediction_remedies(prediction, top=None, fsdp_sizes=())
    assert remedies[0].fits and all(not r.fits for r in remedies[1:])
    assert remedies[0].flag == "--checkpointing full --precision bf16 --batch 4 --grad-accum 2"
    direct = predicted(checkpointing="full", precision="bf16", batch_size=4, grad_accum=2)
    assert direct.fits
    assert remedies[0].peak_reserved_bytes == direct.required_bytes == 1_669_332_992


def test_checkpointing_with_qlora_comes_last_and_is_marked_as_training_adapters():
    """No change and no precision combination fits; checkpointing with QLoRA (4-bit base
    weights under LoRA adapters: 300 of state here) does at the step's own batch. It is tried
    after the precision combinations, marked as changing what is trained, on a bf16 base (the
    fp32 weights of the step are not what a QLoRA user loads), which its flags name."""
    calls: list[StepOptions] = []

    def again(options: StepOptions, layout: object) -> _Need:
        calls.append(options)
        quantized = options.quantize == "nf4"
        if options.optimizer != "adamw" or (options.lora is not None and not quantized):
            return _Need(10**9, False)
        states = 300 if quantized else {"fp32": 1600, "bf16-mixed": 1700, "bf16": 800}[
            options.precision
        ]
        sample = 20 if options.checkpointing == "full" else 100
        kept = (100 if quantized else 400) if options.grad_accum > 1 else 0
        need = states + kept + sample * options.batch_size
        return _Need(need, need <= 700)

    remedies, _ = measure_remedies(BASE, again, required_bytes=3200, usable_bytes=700,
                                   compute_capability=(9, 0))
    fitting = [r for r in remedies if r.fits]
    assert [(r.flag, r.peak_reserved_bytes, r.changes_training) for r in fitting] == [
        ("--checkpointing full --lora 8 --quantize nf4 --precision bf16", 300 + 20 * 16, True)
    ]
    assert fitting[0].title == (
        "activation checkpointing + QLoRA: 4-bit nf4 base weights + LoRA adapters (peft, r8)"
    )
    tried = [(c.precision, c.quantize, c.batch_size) for c in calls if c.checkpointing == "full"]
    assert tried[-1] == ("bf16", "nf4", 16)
    assert tried.index(("bf16", None, 16)) < len(tried) - 1  # pure bf16 was tried before
    # The single QLoRA change names its flags as measured too.
    qlora = next(r for r in remedies if r.title.startswith("QLoRA"))
    assert qlora.flag == "--lora 8 --quantize nf4 --precision bf16" and not qlora.fits


def test_the_single_changes_re_predicted_in_forked_processes_give_the_same_remedies():
    """jobs=2 re-predicts the single changes two at a time in forked processes: the same
    remedies, in the same order, as one at a time; and a change every model takes that cannot
    be built raises its own error either way."""
    from oomkit.errors import OomkitError

    def remedies(jobs, again):
        found, warnings = measure_remedies(BASE, again, required_bytes=3200, usable_bytes=1100,
                                           compute_capability=(9, 0), jobs=jobs)
        return [(r.title, r.flag, r.peak_reserved_bytes, r.fits) for r in found], warnings

    again, calls = _fake(usable=1100, per_sample=100, checkpointed_per_sample=20)
    alone = remedies(1, again)
    sgd_here = sum(c.optimizer == "sgd" for c in calls)
    calls.clear()
    assert remedies(2, again) == alone
    assert len(alone[0]) == 3  # two single changes save, and the combination fits
    # The SGD change was re-predicted in a forked process: this one never saw the call.
    assert sgd_here == 1 and not any(c.optimizer == "sgd" for c in calls)

    def refusing(options, layout):
        if options.optimizer == "sgd":
            raise OomkitError("no SGD for this model")
        return again(options, layout)

    for jobs in (1, 2):
        with pytest.raises(OomkitError, match="no SGD for this model"):
            remedies(jobs, refusing)

"""Lightning's Trainer.fit and transformers' Trainer run as a step: same bytes as a plain loop."""

from __future__ import annotations

from pathlib import Path

import pytest

from oomkit.core.target import Target
from oomkit.prediction.predictor import predict
from oomkit.prediction.tracing.trainers import TrainerRefusedError
from oomkit.scenario.user_function import load_user_step

BUILDERS = Path(__file__).parent / "trainer_builders" / "builders.py"
BATCH, SEQ = 8, 128
# One small block: what a scalar the trainer keeps on the device takes (CUDACachingAllocator.cpp
# round_size: kMinBlockSize = 512).
SCALAR_BYTES = 512


def _peaks(function: str) -> tuple[int, int, list[int]]:
    user = load_user_step(f"{BUILDERS}:{function}", batch_size=BATCH, seq_len=SEQ)
    prediction = predict(user.step_fn, track=user.track, steps=3, target=Target.resolve("h100"))
    steps = [s.peak_allocated_bytes for s in prediction.step_peaks]
    return prediction.peak_allocated_bytes, prediction.peak_reserved_bytes, steps


def _prediction(function: str):
    user = load_user_step(f"{BUILDERS}:{function}", batch_size=BATCH, seq_len=SEQ)
    return predict(user.step_fn, track=user.track, steps=3, target=Target.resolve("h100"))


@pytest.fixture(scope="module")
def plain() -> tuple[int, int, list[int]]:
    return _peaks("plain")


@pytest.fixture(scope="module")
def lightning_unlogged() -> tuple[int, int, list[int]]:
    pytest.importorskip("lightning")
    return _peaks("lightning_fit_unlogged")


def test_lightning_fit_matches_the_plain_loop_plus_the_closures_scalars(plain, lightning_unlogged):
    """Trainer.fit (bf16-mixed, clipping, no self.log) = the plain loop + one scalar."""
    unlogged, unlogged_reserved, steps = lightning_unlogged
    # Both peak in backward, at the LM head's bias gradient (its sum's 16 MiB of multi-block
    # staging, emulations/reductions.py): the plain loop holds its loss there, Trainer.fit the
    # loss divided by accumulate_grad_batches and its detached clone
    # (loops/optimization/automatic.py ClosureResult.from_training_step_output).
    assert unlogged - plain[0] == SCALAR_BYTES
    assert unlogged_reserved == plain[1]
    # Steps after the first carry the optimizer state: the run continues, it does not restart.
    assert steps[1] == steps[2] > steps[0]
    assert abs(unlogged - plain[0]) / plain[0] < 0.05


def test_lightning_self_log_adds_its_result_collection(plain, lightning_unlogged):
    """self.log("train_loss", ...) adds the _ResultCollection's device scalars and the last
    step's logged value, and no more."""
    allocated, reserved, _ = _peaks("lightning_fit")
    # logger_connector/result.py ResultMetric: value and cumulated_batch_size, their reset
    # defaults and the forward cache, each a one-element tensor in its own small block; and the
    # previous step's value, which callback_metrics holds until this step's on_batch_end (one
    # fit runs on, so it is alive through this step's backward).
    assert allocated - lightning_unlogged[0] == 5 * SCALAR_BYTES
    assert reserved == plain[1]


def test_lightning_fp16_mixed_runs_with_its_grad_scaler_answered(plain):
    """precision="16-mixed": fp16 autocast and GradScaler; its overflow check reads "none"."""
    pytest.importorskip("lightning")
    user = load_user_step(f"{BUILDERS}:lightning_fit_fp16", batch_size=BATCH, seq_len=SEQ)
    prediction = predict(user.step_fn, track=user.track, steps=3, target=Target.resolve("h100"))
    assert "precision 16-mixed" in user.description
    # GradScaler.step's read of found_inf is the finite-values line's (said once)
    assert "GradScaler skipped no optimizer step" in prediction.assumptions["finite values"]
    # fp16 activations cost what bf16 ones do: the same peak as the bf16 plain loop, within 5%.
    assert abs(prediction.peak_allocated_bytes - plain[0]) / plain[0] < 0.05


@pytest.fixture(scope="module")
def hf_single():
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    return _prediction("hf_trainer")


def test_hf_trainer_matches_the_plain_loop_plus_accelerates_fp32_outputs(plain, hf_single):
    """transformers' Trainer(bf16=True) = the plain loop + accelerate's fp32 outputs + 3 scalars."""
    allocated, reserved = hf_single.peak_allocated_bytes, hf_single.peak_reserved_bytes
    steps = [s.peak_allocated_bytes for s in hf_single.step_peaks]
    converted, converted_reserved, _ = _peaks("plain_fp32_outputs")
    # accelerate converts the bf16 logits to fp32 after the autocast forward: a copy the plain
    # loop does not make, alive with the loss's temporaries.
    assert converted > plain[0]
    # What is left: the Trainer's running loss total (trainer.py _tr_loss, one fp32 scalar) and
    # the previous step's tr_loss_step and grad_norm, locals of _run_epoch that one train()
    # holds until this step rebinds them (after its backward, before its clipping).
    assert allocated - converted == 3 * SCALAR_BYTES
    assert reserved == converted_reserved
    assert steps[1] == steps[2] > steps[0]
    assert abs(allocated - converted) / converted < 0.05


def test_hf_trainer_built_with_bf16_constructs_and_picks_cuda():
    """TrainingArguments(bf16=True) builds (no "doesn't support bf16/gpu") on cuda:0 -> meta."""
    pytest.importorskip("transformers")
    user = load_user_step(f"{BUILDERS}:hf_trainer", batch_size=BATCH, seq_len=SEQ)
    model = user.track[0]
    assert next(model.parameters()).device.type == "meta"
    assert "Hugging Face Trainer.train, bf16, accumulate 1, clip 1.0" in user.description


def test_lightning_trainer_alone_is_refused_with_what_to_return():
    """A Lightning Trainer without its module: the message says to return (trainer, module)."""
    pytest.importorskip("lightning")
    with pytest.raises(TrainerRefusedError, match=r"return \(trainer, module\) or"):
        load_user_step(f"{BUILDERS}:lightning_trainer_alone")


def test_lightning_ddp_is_refused_naming_the_strategy():
    """A DDP Lightning trainer is refused: oomkit predicts one GPU."""
    pytest.importorskip("lightning")
    with pytest.raises(TrainerRefusedError, match=r"uses DDPStrategy on 1 devices; oomkit predicts"):
        load_user_step(f"{BUILDERS}:lightning_ddp", batch_size=BATCH, seq_len=SEQ)


def test_hf_trainer_on_cpu_is_refused():
    """TrainingArguments(use_cpu=True) is refused: the step would not run on a GPU."""
    pytest.importorskip("transformers")
    with pytest.raises(TrainerRefusedError, match=r"runs on cpu, not on a GPU"):
        load_user_step(f"{BUILDERS}:hf_trainer_on_cpu", batch_size=BATCH, seq_len=SEQ)


@pytest.mark.parametrize(("every", "emptying_steps"), [(1, [0, 1, 2]), (2, [0, 2]), (4, [0])])
def test_hf_trainer_empties_the_cache_in_the_steps_one_run_does(every, emptying_steps):
    """torch_empty_cache_steps=N: training_step empties the cache after the loss, before the
    backward, in the optimizer steps N divides (transformers/trainer.py training_step). Each
    recorded step restarts train() at global_step 0; the recording empties where one run's
    step does: one empty_cache in each such step, after its loss and before its first
    gradient, and none elsewhere (nor at the restarts)."""
    from oomkit.prediction.tracing.step_runner import trace_step

    pytest.importorskip("transformers")
    user = load_user_step(
        f"{BUILDERS}:hf_trainer_emptying_the_cache", batch_size=2, seq_len=16, extra={"every": every}
    )
    recording = trace_step(lambda *_tracked: user.step_fn(), *user.track, steps=3,
                           target=Target.resolve("h100"))
    events = recording.events
    bounds = [*recording.step_starts, len(events)]

    def step_of(index: int) -> int:
        return next(i for i in range(len(bounds) - 1) if bounds[i] <= index < bounds[i + 1])

    emptied = [i for i, event in enumerate(events) if event.action == "empty_cache"]
    assert [step_of(i) for i in emptied] == emptying_steps
    for index in emptied:
        before = [dict(e.tags).get("category") for e in events[bounds[step_of(index)]:index]]
        after = [dict(e.tags).get("category") for e in events[index:bounds[step_of(index) + 1]]]
        assert "gradient" not in before and "gradient" in after


def test_lightning_accumulation_keeps_the_gradients_through_the_second_micro_batch(
    lightning_unlogged,
):
    """accumulate_grad_batches=2: the second micro-batch's forward runs with the gradients held."""
    pytest.importorskip("lightning")
    accumulated = _prediction("lightning_fit_accumulate")
    gradient_bytes = accumulated.by_category_bytes["parameter"]  # fp32 grads, one per parameter
    assert accumulated.peak_allocated_bytes - lightning_unlogged[0] == gradient_bytes


def test_hf_accumulation_holds_gradients_and_prefetches_every_micro_batch(hf_single):
    """gradient_accumulation_steps=2: gradients held, and both micro-batches loaded up front."""
    single = hf_single
    accumulated = _prediction("hf_trainer_accumulate")
    gradient_bytes = accumulated.by_category_bytes["parameter"]
    extra = accumulated.peak_allocated_bytes - single.peak_allocated_bytes - gradient_bytes
    # trainer.py _run_epoch: get_batch_samples loads gradient_accumulation_steps batches before
    # the first forward: one more micro-batch's input_ids and labels (int64) on the device.
    batch_bytes = 2 * BATCH * SEQ * 8
    assert batch_bytes <= extra <= batch_bytes + SCALAR_BYTES


def test_a_trainer_restarted_per_step_empties_no_cache_between_steps(monkeypatch):
    """Each recorded step starts the trainer again, and each start (accelerate's
    free_memory) calls torch.cuda.empty_cache(): recorded, that would empty the cache between
    steps, which one run never does. The trainer's steps record no empty_cache; with
    empty_cache counted as a request there, they would."""
    from oomkit.prediction.tracing import trainers
    from oomkit.prediction.tracing.step_runner import trace_step

    pytest.importorskip("transformers")

    def actions() -> list[str]:
        user = load_user_step(f"{BUILDERS}:hf_trainer", batch_size=2, seq_len=16)
        recording = trace_step(lambda *_tracked: user.step_fn(), *user.track, steps=2,
                               target=Target.resolve("h100"))
        return [event.action for event in recording.events]

    assert "empty_cache" not in actions()
    counted = trainers.as_one_cuda_gpu

    def counting(*args, **kwargs):
        kwargs["cache_emptied"] = True
        return counted(*args, **kwargs)

    monkeypatch.setattr(trainers, "as_one_cuda_gpu", counting)
    assert actions().count("empty_cache") >= 2  # one per train() at least

"""The HF Trainer's loop: accelerate's fp32 copy of the outputs, their lifetime, ``tr_loss``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch  # noqa: E402

from oomkit.prediction.models import StepOptions, build_hf_step  # noqa: E402
from oomkit.prediction.models.trainer_args import trainer_step_options  # noqa: E402
from oomkit.prediction.tracing import TraceRecording, trace_step  # noqa: E402
from oomkit.prediction.tracing.recording import TraceEvent  # noqa: E402

TINY_LLAMA = Path(__file__).parent / "configs" / "tiny-llama"
BATCH, SEQ, VOCAB = 2, 16, 256  # tiny-llama's vocab_size is 256
# convert_outputs_to_fp32: the logits [batch, seq, vocab] copied by .float(): 4 bytes each.
FP32_LOGITS_BYTES = BATCH * SEQ * VOCAB * 4  # 32,768
BF16_LOGITS_BYTES = BATCH * SEQ * VOCAB * 2  # lm_head's output in bf16


def _trace(options: StepOptions) -> TraceRecording:
    built = build_hf_step(TINY_LLAMA, options)
    return trace_step(built.step_fn, *built.track, steps=2)


def _events(recording: TraceRecording) -> list[TraceEvent]:
    return [e for e in recording.step_events(1) if e.action != "free_requested"]


def _phase(event: TraceEvent) -> str | None:
    return dict(event.tags).get("phase")


def _conversions(events: list[TraceEvent]) -> list[tuple[int, int, int]]:
    """(alloc index, bytes, free index) of each copy made outside the model's modules right
    after its forward (GradScaler's copies come after a backward)."""
    out = []
    previous = None
    for i, e in enumerate(events):
        if e.action != "alloc":
            continue
        after_forward = previous is not None and _phase(previous) == "forward"
        previous = e
        if after_forward and _phase(e) == "user" and dict(e.tags).get("op") == "aten._to_copy.default":
            freed = next(
                j for j in range(i, len(events))
                if events[j].action == "free_completed" and events[j].address == e.address
            )
            out.append((i, e.size, freed))
    return out


def _backward_starts(events: list[TraceEvent]) -> list[int]:
    """Index of each micro-batch's first backward allocation."""
    allocs = [(i, _phase(e)) for i, e in enumerate(events) if e.action == "alloc"]
    return [
        i
        for k, (i, phase) in enumerate(allocs)
        if phase == "backward" and (k == 0 or allocs[k - 1][1] != "backward")
    ]


def test_bf16_trainer_args_record_accelerates_fp32_copy_of_the_logits():
    """bf16: true over tiny-llama's bf16 weights: one 32,768-byte copy, freed before backward."""
    options, notes = trainer_step_options(
        {"bf16": True, "per_device_train_batch_size": BATCH, "max_length": SEQ},
        model_precision="bf16",
    )
    assert (options.precision, options.trainer_mixed_precision) == ("bf16", "bf16")
    events = _events(_trace(options))
    [(made, size, freed)] = _conversions(events)
    assert size == FP32_LOGITS_BYTES
    first_backward = _backward_starts(events)[0]
    assert made < freed < first_backward  # compute_loss returned: the outputs died
    # The bf16 logits die as soon as accelerate replaced them with their copy.
    logits = next(
        e for e in reversed(events[:made])
        if e.action == "alloc" and dict(e.tags).get("op") == "aten.mm.default"
    )
    assert (dict(logits.tags).get("module"), logits.size) == ("lm_head", BF16_LOGITS_BYTES)
    logits_freed = next(
        j for j, e in enumerate(events) if e.action == "free_completed" and e.address == logits.address
    )
    assert made < logits_freed < freed
    assert "is recorded for a Hugging Face model" in notes["trainer args outputs"]
    assert "under accelerate's autocast" in notes["trainer args precision"]


def test_without_bf16_or_fp16_there_is_no_copy():
    """No bf16 / fp16: the Trainer's Accelerator has mixed_precision 'no': nothing is copied."""
    options, notes = trainer_step_options(
        {"per_device_train_batch_size": BATCH, "max_length": SEQ}, model_precision="bf16"
    )
    assert options.trainer_mixed_precision == "no"
    assert _conversions(_events(_trace(options))) == []
    assert "trainer args outputs" not in notes


def test_bf16_mixed_copies_once_per_micro_batch_in_fp32_and_fp16():
    """bf16-mixed (fp32 weights) and fp16-mixed, 2 micro-batches: each has its own copy."""
    for mixed in ("bf16", "fp16"):
        options = StepOptions(
            batch_size=BATCH,
            seq_len=SEQ,
            precision=f"{mixed}-mixed",  # type: ignore[arg-type]
            grad_accum=2,
            trainer_mixed_precision=mixed,  # type: ignore[arg-type]
        )
        events = _events(_trace(options))
        conversions = _conversions(events)
        starts = _backward_starts(events)
        assert [size for _, size, _ in conversions] == [FP32_LOGITS_BYTES] * 2
        assert [freed < start for (_, _, freed), start in zip(conversions, starts, strict=False)] == [
            True,
            True,
        ]


def test_the_trainers_outputs_die_before_backward_a_plain_loops_at_the_end():
    """Trainer loop: lm_head's logits are freed before backward; a plain loop keeps them."""

    def logits_freed_before_backward(trainer: str | None) -> bool:
        options = StepOptions(batch_size=BATCH, seq_len=SEQ, trainer_mixed_precision=trainer)  # type: ignore[arg-type]
        events = _events(_trace(options))
        logits = next(
            e for e in events if e.action == "alloc" and dict(e.tags).get("module") == "lm_head"
        )
        freed = next(
            j for j, e in enumerate(events) if e.action == "free_completed" and e.address == logits.address
        )
        return freed < _backward_starts(events)[0]

    assert logits_freed_before_backward("no")
    assert not logits_freed_before_backward(None)


def test_the_running_loss_scalar_is_tracked_and_added_to_in_place():
    """tr_loss: one 0-dim fp32 tensor tracked from the start (4 bytes); += allocates nothing."""
    built = build_hf_step(TINY_LLAMA, StepOptions(batch_size=BATCH, seq_len=SEQ, trainer_mixed_precision="no"))
    tr_loss = built.track[-1]
    assert isinstance(tr_loss, torch.Tensor)
    assert (tr_loss.shape, tr_loss.dtype) == (torch.Size([]), torch.float32)
    plain = build_hf_step(TINY_LLAMA, StepOptions(batch_size=BATCH, seq_len=SEQ))
    assert len(built.track) == len(plain.track) + 1
    with_loss = trace_step(built.step_fn, *built.track, steps=2)
    without = trace_step(plain.step_fn, *plain.track, steps=2)
    before = [e for e in with_loss.events[: with_loss.step_starts[0]] if e.action == "alloc"]
    before_plain = [e for e in without.events[: without.step_starts[0]] if e.action == "alloc"]
    assert [e.size for e in before][len(before_plain) :] == [4]
    in_place = [e for e in with_loss.step_events(1) if dict(e.tags).get("op") == "aten.add_.Tensor"]
    assert in_place == []  # _tr_loss += tr_loss_step allocates nothing


def test_without_accelerate_the_forward_is_left_and_the_note_says_so(monkeypatch):
    """accelerate not importable: no copy recorded, and the assumptions say it is not added."""
    monkeypatch.setitem(sys.modules, "accelerate", None)
    monkeypatch.setitem(sys.modules, "accelerate.utils", None)
    options, notes = trainer_step_options(
        {"bf16": True, "per_device_train_batch_size": BATCH, "max_length": SEQ},
        model_precision="bf16",
    )
    assert "accelerate is not installed" in notes["trainer args outputs"]
    assert _conversions(_events(_trace(options))) == []


def test_trainer_mixed_precision_is_checked():
    """A bad value, or the Trainer's loop outside training: refused with the fix."""
    with pytest.raises(ValueError, match="trainer_mixed_precision must be one of no, bf16, fp16"):
        StepOptions(trainer_mixed_precision="fp8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="apply to training steps"):
        StepOptions(mode="inference", trainer_mixed_precision="no")


def test_torch_empty_cache_steps_empties_after_each_loss_in_the_steps_it_divides():
    """torch_empty_cache_steps 2 with 2 micro-batches, 3 steps recorded: the optimizer steps 0
    and 2 empty the cache in each micro-batch after its loss and before its backward
    (trainer.py training_step), step 1 does not; the assumptions say so."""
    options, notes = trainer_step_options(
        {"torch_empty_cache_steps": 2, "per_device_train_batch_size": BATCH, "max_length": SEQ,
         "gradient_accumulation_steps": 2},
    )
    assert options.trainer_empty_cache_steps == 2
    assert "optimizer steps 2 divides (0, 2, ...)" in notes["trainer args torch_empty_cache_steps"]
    built = build_hf_step(TINY_LLAMA, options)
    recording = trace_step(built.step_fn, *built.track, steps=3)
    for step, expected in enumerate((2, 0, 2)):
        events = [e for e in recording.step_events(step) if e.action != "free_requested"]
        emptied = [i for i, e in enumerate(events) if e.action == "empty_cache"]
        assert len(emptied) == expected
        backwards = _backward_starts(events)
        assert len(backwards) == 2
        for at, backward in zip(emptied, backwards, strict=False):
            assert at < backward
            # After the forward and its loss: forward allocations come before it.
            assert any(_phase(e) == "forward" for e in events[:at])
    # Without it: none.
    plain, _ = trainer_step_options({"per_device_train_batch_size": BATCH, "max_length": SEQ})
    built = build_hf_step(TINY_LLAMA, plain)
    assert all(
        e.action != "empty_cache" for e in trace_step(built.step_fn, *built.track, steps=3).events
    )


def test_trainer_empty_cache_steps_is_checked():
    """A value below 1, or the setting without the Trainer's loop: refused with the fix."""
    with pytest.raises(ValueError, match="trainer_empty_cache_steps must be a whole number >= 1"):
        StepOptions(trainer_mixed_precision="no", trainer_empty_cache_steps=0)
    with pytest.raises(ValueError, match="add trainer_mixed_precision"):
        StepOptions(trainer_empty_cache_steps=2)

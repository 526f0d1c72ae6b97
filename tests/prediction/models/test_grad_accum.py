"""Gradient accumulation, clipping and reentrant checkpointing in the recorded training step."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

from oomkit.errors import OomkitError  # noqa: E402
from oomkit.prediction.models import StepOptions, build_hf_step, build_preset_step  # noqa: E402
from oomkit.prediction.models.lora_options import LoraOptions  # noqa: E402
from oomkit.prediction.tracing import TraceRecording, trace_step  # noqa: E402

TINY_LLAMA = Path(__file__).parent / "configs" / "tiny-llama"
# tiny-llama (bf16): 21 parameters, 213,632 bytes (106,816 elements x 2 bytes).
PARAMETERS, PARAMETER_BYTES = 21, 213_632
# LoRA r8 on q_proj (64 -> 64) and v_proj (64 -> 32), 2 layers: 8 fp32 adapter matrices.
ADAPTERS, ADAPTER_BYTES = 8, 2 * 8 * ((64 + 64) + (64 + 32)) * 4


def _trace(**fields: object) -> TraceRecording:
    options = StepOptions(batch_size=2, seq_len=16, **fields)  # type: ignore[arg-type]
    built = build_hf_step(TINY_LLAMA, options)
    return trace_step(built.step_fn, *built.track, steps=2)


def _allocs(recording: TraceRecording, step: int = 1) -> list[tuple[str, str, int]]:
    return [
        (str(dict(e.tags).get("category")), str(dict(e.tags).get("op")), e.size)
        for e in recording.step_events(step)
        if e.action == "alloc"
    ]


def _bytes(recording: TraceRecording, category: str) -> int:
    return sum(size for cat, _, size in _allocs(recording) if cat == category)


@pytest.fixture(scope="module")
def by_micro_batches() -> dict[int, TraceRecording]:
    return {n: _trace(grad_accum=n) for n in (1, 2, 3)}


def test_gradients_are_made_once_and_accumulated_in_place(by_micro_batches):
    """N = 1, 2, 3: the same 21 gradients (213,632 B) are allocated once and freed once."""
    for recording in by_micro_batches.values():
        gradients = [size for cat, _, size in _allocs(recording) if cat == "gradient"]
        assert (len(gradients), sum(gradients)) == (PARAMETERS, PARAMETER_BYTES)
        freed = [
            e for e in recording.step_events(1)
            if e.action == "free_completed" and dict(e.tags).get("category") == "gradient"
        ]
        assert len(freed) == PARAMETERS  # zero_grad(set_to_none=True), after the last micro


def test_every_micro_batch_runs_its_own_forward_and_backward(by_micro_batches):
    """Activations and the cuDNN backward workspaces are recorded N times, exactly."""
    one = by_micro_batches[1]
    assert _bytes(one, "activation") == 224_168
    for n, recording in by_micro_batches.items():
        assert _bytes(recording, "activation") == n * _bytes(one, "activation")
        assert _bytes(recording, "workspace") == n * _bytes(one, "workspace")


def test_the_loss_is_divided_by_the_micro_batches_as_the_trainer_does(by_micro_batches):
    """`loss / N` (and its backward) adds two 4-byte divisions per micro-batch; none at N=1."""
    for n, recording in by_micro_batches.items():
        divisions = [size for _, op, size in _allocs(recording) if op == "aten.div.Tensor"]
        assert divisions == ([] if n == 1 else [4] * (2 * n))


def test_later_micro_batches_repeat_the_second_ones_peak(by_micro_batches):
    """Once gradients exist, each further micro-batch peaks the same: N=3's peak is N=2's."""
    peaks = {n: r.peak_allocated_bytes() for n, r in by_micro_batches.items()}
    assert peaks[3] == peaks[2] > peaks[1]


def test_clipping_records_clip_grad_norms_foreach_temporaries():
    """max_grad_norm: the foreach kernel's partials (one 65,536-element chunk per adapter
    gradient, in float), one norm per adapter gradient, their stack, the total and the
    coefficient."""
    recording = _trace(lora=LoraOptions(r=8), max_grad_norm=1.0)
    ops = [(op, size) for _, op, size in _allocs(recording)]
    start = ops.index(("aten._foreach_norm.Scalar", 4 * ADAPTERS))
    assert ops[start : start + ADAPTERS + 7] == [
        ("aten._foreach_norm.Scalar", 4 * ADAPTERS),
        *[("aten._foreach_norm.Scalar", 4)] * ADAPTERS,
        ("aten.stack.default", 4 * ADAPTERS),
        ("aten.linalg_vector_norm.default", 4),
        ("aten.add.Tensor", 4),  # total_norm + 1e-6
        ("aten.reciprocal.default", 4),  # max_norm / (...)
        ("aten.mul.Tensor", 4),
        ("aten.clamp.default", 4),  # clamp(max=1.0); _foreach_mul_ is in place
    ]
    assert Counter(op for op, _ in ops)["aten._foreach_norm.Scalar"] == ADAPTERS + 1
    unclipped = _trace(lora=LoraOptions(r=8))
    assert "aten._foreach_norm.Scalar" not in {op for _, op, _ in _allocs(unclipped)}


def test_reentrant_checkpointing_still_trains_the_adapters():
    """use_reentrant=True (LoRA, frozen inputs): the adapters get their gradients all the same."""
    options = StepOptions(
        batch_size=2,
        seq_len=16,
        lora=LoraOptions(r=8),
        checkpointing=True,
        checkpoint_reentrant=True,
    )
    built = build_hf_step(TINY_LLAMA, options)
    recording = trace_step(built.step_fn, *built.track, steps=2)
    assert recording.allocated_bytes("gradient", step=1) == ADAPTER_BYTES
    assert "checkpointing (reentrant)" in built.description


def test_presets_refuse_reentrant_checkpointing():
    """A preset checkpoints with use_reentrant=False only: asking for reentrant is refused."""
    options = StepOptions(batch_size=1, seq_len=16, checkpointing=True, checkpoint_reentrant=True)
    with pytest.raises(OomkitError, match="use_reentrant=False only"):
        build_preset_step("gpt2-124m", options)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"grad_accum": 0}, "grad_accum must be a positive integer"),
        ({"grad_accum": True}, "grad_accum must be a positive integer"),
        ({"max_grad_norm": 0.0}, "max_grad_norm must be a positive number"),
        ({"checkpoint_reentrant": True}, "add StepOptions\\(checkpointing='full'\\)"),
        ({"grad_accum": 2, "mode": "inference"}, "apply to training steps"),
    ],
)
def test_bad_training_loop_options_are_refused(fields, message):
    """Each bad value says what is wrong and how to fix it."""
    with pytest.raises(ValueError, match=message):
        StepOptions(**fields)  # type: ignore[arg-type]


def test_fp16_clipping_unscales_first_and_keeps_found_inf_until_the_update():
    """fp16-mixed + clip: GradScaler.unscale_ (inv_scale freed), clip, then step and update."""
    recording = _trace(lora=LoraOptions(r=8), precision="fp16-mixed", max_grad_norm=1.0)
    events = [e for e in recording.step_events(1) if e.action != "free_requested"]
    ops = [str(dict(e.tags).get("op")) for e in events]
    first_norm = ops.index("aten._foreach_norm.Scalar")
    found_inf = next(
        e for e in reversed(events[:first_norm]) if dict(e.tags).get("op") == "aten.full.default"
    )
    inv_scale = next(  # scale.double().reciprocal().float(): the 4-byte fp32 copy
        e
        for e in reversed(events[:first_norm])
        if dict(e.tags).get("op") == "aten._to_copy.default" and e.size == 4
    )
    freed = [(e.address, i) for i, e in enumerate(events) if e.action == "free_completed"]
    freed_at = dict(freed)
    assert freed_at[inv_scale.address] < first_norm  # unscale_ returned before clipping
    assert freed_at[found_inf.address] > ops.index("aten.clamp.default")  # kept to update()
    assert found_inf.size == 4

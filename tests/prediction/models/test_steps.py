"""Step functions of the presets: train, inference, generate, fp16 GradScaler, checkpointing."""

from __future__ import annotations

import dataclasses
import types
from collections import Counter

import pytest

from oomkit.prediction.models import StepOptions, build_preset_step
from oomkit.prediction.tracing import TraceRecording, trace_step


def _allocs(recording: TraceRecording, step: int | None = None) -> list:
    events = recording.events if step is None else recording.step_events(step)
    return [e for e in events if e.action == "alloc"]


def _op(event) -> str | None:
    return dict(event.tags).get("op")


def _two_blocks_deep(monkeypatch, name: str) -> None:
    """Preset ``name`` built with its own shape but two blocks (``layers=2``), undone after the
    test: for a property of every block alike (each checkpointed block's recompute, each
    parameter's gradient), two blocks show it as the whole depth does, in a fraction of the
    recording (one block's recompute follows another's, as in the full model)."""
    from oomkit.prediction.models import presets

    preset = presets.PRESETS[name]
    assert preset.shape.layers > 2
    shallow = dataclasses.replace(preset, shape=dataclasses.replace(preset.shape, layers=2))
    monkeypatch.setattr(presets, "PRESETS", types.MappingProxyType({**presets.PRESETS, name: shallow}))


def test_gpt2_train_step_traces_three_steps():
    """The contract's call traces 3 steps of GPT-2 124M with gradients and AdamW states."""
    built = build_preset_step("gpt2-124m", StepOptions(batch_size=1, seq_len=16))
    recording = trace_step(built.step_fn, *built.track, steps=3)
    assert recording.steps == 3
    assert recording.allocated_bytes("gradient", step=2) == 4 * 124_439_808
    assert recording.allocated_bytes("input") == 2 * 8 * 16  # int64 ids and labels


def test_inference_allocates_no_gradients_or_states(monkeypatch):
    """Inference runs under no_grad: no gradient, optimizer state or saved activation (two
    blocks deep: none in any block)."""
    _two_blocks_deep(monkeypatch, "llama-1b")
    built = build_preset_step("llama-1b", StepOptions(batch_size=1, seq_len=8, mode="inference"))
    assert len(built.track) == 2  # model and ids: no optimizer
    recording = trace_step(built.step_fn, *built.track)
    assert recording.allocated_bytes("gradient") == 0
    assert recording.allocated_bytes("optimizer_state") == 0
    assert not any(dict(e.tags).get("saved_for_backward") for e in _allocs(recording))


def test_generate_grows_kv_cache_by_cat():
    """Prompt 8, 3 new tokens: two decode forwards cat K and V of 9 then 10 tokens per layer."""
    options = StepOptions(batch_size=1, seq_len=8, mode="generate", new_tokens=3)
    built = build_preset_step("gpt2-124m", options)
    recording = trace_step(built.step_fn, *built.track)
    cats = Counter(e.size for e in _allocs(recording) if _op(e) == "aten.cat.default")
    per_token = 1 * 12 * 64 * 4  # batch * heads * head_dim * fp32 bytes
    assert cats[9 * per_token] == 24  # 12 layers x (K, V)
    assert cats[10 * per_token] == 24
    # The generated ids grow by cat too: int64 [1, 9], [1, 10], [1, 11].
    assert [cats[72], cats[80], cats[88]] == [1, 1, 1]


def test_generate_description():
    """A generate step describes prompt and new tokens."""
    options = StepOptions(batch_size=2, seq_len=64, mode="generate", new_tokens=16)
    built = build_preset_step("llama-1b", options)
    assert built.description == "Llama 3.2 1B, batch 2, prompt 64 + 16 new tokens, fp32, generate"


def test_fp16_mixed_allocates_grad_scaler_tensors(monkeypatch):
    """fp16-mixed creates scale and growth tracker once, then a found_inf scalar every step
    (the GradScaler's, whatever the depth: two blocks)."""
    _two_blocks_deep(monkeypatch, "gpt2-124m")
    built = build_preset_step(
        "gpt2-124m", StepOptions(batch_size=1, seq_len=8, precision="fp16-mixed")
    )
    recording = trace_step(built.step_fn, *built.track, steps=2)
    fulls = [
        [e.size for e in _allocs(recording, step) if _op(e) == "aten.full.default"]
        for step in (0, 1)
    ]
    assert fulls == [[4, 4, 4], [4]]
    # unscale_: inv_scale = scale.double().reciprocal().float()
    reciprocals = [e.size for e in _allocs(recording, 1) if _op(e) == "aten.reciprocal.default"]
    assert reciprocals == [8]


def test_pure_bf16_parameters_are_two_bytes():
    """bf16 casts the whole model: 2 bytes per parameter (batch 2: BatchNorm needs 2 values)."""
    options = StepOptions(batch_size=2, image_size=32, precision="bf16")
    built = build_preset_step("resnet50", options)
    recording = trace_step(built.step_fn, *built.track)
    assert recording.allocated_bytes("parameter") == 2 * 25_557_032


def test_checkpointing_keeps_fewer_activations(monkeypatch):
    """Per-block checkpointing of Llama 3.2 1B keeps only each block's input in forward (two of
    its blocks: each keeps the same bytes, so the whole model's are 16 times one block's)."""
    _two_blocks_deep(monkeypatch, "llama-1b")
    blocks = 2
    results = {}
    for checkpointing in (False, True):
        options = StepOptions(batch_size=1, seq_len=32, checkpointing=checkpointing)
        built = build_preset_step("llama-1b", options)
        recording = trace_step(built.step_fn, *built.track)
        results[checkpointing] = sum(
            e.size
            for e in _allocs(recording)
            if dict(e.tags).get("category") == "activation"
            and dict(e.tags).get("phase") == "forward"
            and dict(e.tags).get("module", "").startswith("layers.")
        )
    # Each block one fp32 input [1, 32, 2048] = 262,144 bytes; without checkpointing each block
    # keeps 26.5x more, 6,947,072 bytes (Llama 3.2 1B's 16 blocks: 16 * 262,144 and 111,153,152).
    assert results[True] == blocks * 32 * 2048 * 4
    assert results[False] == blocks * 6_947_072


def test_checkpointing_with_attention_dropout_traces():
    """GPT-2 with dropout in attention traces with checkpointing on."""
    options = StepOptions(batch_size=1, seq_len=16, checkpointing=True)
    built = build_preset_step("gpt2-124m", options)
    recording = trace_step(built.step_fn, *built.track)
    assert recording.allocated_bytes("gradient") == 4 * 124_439_808


@pytest.mark.parametrize("name", ["bert-base", "vit-b16"])
def test_encoders_train(name, monkeypatch):
    """BERT (MLM loss over every position) and ViT train steps trace with gradients (two blocks
    deep: every parameter's gradient, whatever the depth)."""
    _two_blocks_deep(monkeypatch, name)
    built = build_preset_step(name, StepOptions(batch_size=2, seq_len=8, image_size=32))
    assert built.description.startswith({"bert-base": "BERT", "vit-b16": "ViT"}[name])
    recording = trace_step(built.step_fn, *built.track)
    assert recording.allocated_bytes("gradient") == 4 * built.parameter_count


def test_step_fn_runs_without_arguments():
    """step_fn() works with no arguments too (the contract's Callable[[], object])."""
    built = build_preset_step(
        "resnet50", StepOptions(batch_size=1, image_size=32, mode="inference")
    )
    assert built.step_fn() is None


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
@pytest.mark.parametrize("name", ["gpt2-124m", "llama-1b", "bert-base", "vit-b16"])
def test_mixed_precision_with_checkpointing_traces(name, precision, monkeypatch):
    """Checkpointed blocks recompute under autocast: the casts match forward (no CheckpointError).

    The weight gradients are fp32 (the parameters' dtype) whatever autocast computed in. Each
    preset two blocks deep (``_two_blocks_deep``): its own blocks, checkpointed one after another.
    """
    _two_blocks_deep(monkeypatch, name)
    options = StepOptions(
        batch_size=2, seq_len=8, image_size=32, precision=precision, checkpointing=True
    )
    built = build_preset_step(name, options)
    recording = trace_step(built.step_fn, *built.track, steps=1)
    assert recording.allocated_bytes("gradient") == 4 * built.parameter_count
    assert recording.allocated_bytes("autocast_cache", phase="backward") > 0

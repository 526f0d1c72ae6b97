"""DoRA on nf4 / int8 base weights: peft's DoRA temporaries plus bitsandbytes' dequantized weight."""

from __future__ import annotations

import pytest
from _tiny_hf import tiny_llama_config

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from oomkit.prediction.models import StepOptions, build_hf_step  # noqa: E402
from oomkit.prediction.models.lora_options import LoraOptions  # noqa: E402
from oomkit.prediction.tracing import TraceRecording, trace_step  # noqa: E402

# q_proj of layer 1: 64 -> 64, bf16 base, fp32 adapters; batch 2 x seq 16 = 32 rows.
MAGNITUDE = "model.layers.1.self_attn.q_proj.lora_magnitude_vector.default"
W_FP32, W_BF16 = 64 * 64 * 4, 64 * 64 * 2
# fp32 adapters r8 on q_proj (64+64) and v_proj (64+32), 2 layers; magnitudes 64 + 32 per layer.
ADAPTERS, MAGNITUDES = 2 * 8 * ((64 + 64) + (64 + 32)) * 4, 2 * (64 + 32) * 4


def _config() -> object:
    return tiny_llama_config(vocab_size=256, max_position_embeddings=64)


def _trace(dropout: float = 0.0, **kwargs: object) -> TraceRecording:
    lora = LoraOptions(dora=True, dropout=dropout)
    options = StepOptions(batch_size=2, seq_len=16, precision="bf16", lora=lora, **kwargs)
    built = build_hf_step(_config(), options)
    return trace_step(built.step_fn, *built.track, steps=2)


def _dora_allocs(recording: TraceRecording) -> list[tuple[int, str | None]]:
    return [
        (e.size, dict(e.tags).get("op"))
        for e in recording.step_events(1)
        if e.action == "alloc"
        and dict(e.tags).get("module") == MAGNITUDE
        and dict(e.tags).get("phase") == "forward"
    ]


@pytest.fixture(scope="module")
def plain() -> list[tuple[int, str | None]]:
    """The unquantized DoRA layer's forward allocations (peft's own DoraLinearLayer)."""
    return _dora_allocs(_trace())


def test_unquantized_dora_forward_by_hand(plain):
    """eye, weight.to(fp32), scaling * lora, W + that, the row norm, magnitude / norm, products."""
    assert plain == [
        (W_FP32, "aten.eye.default"),
        (W_FP32, "aten._to_copy.default"),  # the bf16 weight .to(x.dtype) (x cast to fp32)
        (W_FP32, "aten.mul.Tensor"),
        (W_FP32, "aten.add.Tensor"),
        (64 * 4, "aten.linalg_vector_norm.default"),
        (64 * 4, "aten.div.Tensor"),
        (64 * 4, "aten.sub.Tensor"),
        (32 * 64 * 4, "aten.mul.Tensor"),
        (32 * 64 * 4, "aten.mul.Tensor"),
        (32 * 64 * 4, "aten.mul.Tensor"),
        (32 * 64 * 4, "aten.add.Tensor"),
    ]


def test_nf4_dora_adds_the_dequantized_weight_only(plain):
    """nf4: dequantize_4bit's bf16 [out, in] before its .to(fp32); the rest is peft's, byte-exact."""
    recording = _trace(quantize="nf4")
    assert _dora_allocs(recording) == [*plain[:1], (W_BF16, "aten.empty.memory_format"), *plain[1:]]
    assert recording.allocated_bytes("gradient", step=1) == ADAPTERS + MAGNITUDES


def test_nf4_double_quant_dora_dequantizes_the_absmax_first(plain):
    """Double quantization: the fp32 absmax (64 blocks) then the weight, inside the DoRA layer."""
    allocs = _dora_allocs(_trace(quantize="nf4", double_quant=True))
    assert allocs[1:3] == [(64 * 4, "aten.empty.memory_format"), (W_BF16, "aten.empty.memory_format")]
    assert allocs[3:] == plain[1:]


def test_int8_dora_dequantizes_to_fp32_without_a_cast(plain):
    """int8: CB * SCB then * 1/127 (two fp32 [out, in]), already x's dtype: no .to copy."""
    recording = _trace(quantize="int8")
    assert _dora_allocs(recording) == [
        plain[0],
        (W_FP32, "aten.mul.Tensor"),
        (W_FP32, "aten.mul.Tensor"),
        *plain[2:],
    ]
    assert recording.allocated_bytes("gradient", step=1) == ADAPTERS + MAGNITUDES


def test_nf4_dora_with_dropout_runs_the_base_matmul_again_on_the_dequantized_weight():
    """lora_dropout > 0 in training: F.linear(dropped x, W) inside DoRA, W dequantized first."""
    plain = _dora_allocs(_trace(dropout=0.1))
    # The unquantized layer: F.linear(x, weight) on the fp32 copy of W: a [32 rows, 64] product.
    assert (32 * 64 * 4, "aten.mm.default") in plain
    assert _dora_allocs(_trace(dropout=0.1, quantize="nf4")) == [
        *plain[:1], (W_BF16, "aten.empty.memory_format"), *plain[1:]
    ]

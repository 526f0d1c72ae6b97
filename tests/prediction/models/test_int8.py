"""LLM.int8(): bitsandbytes Linear8bitLt storage byte for byte and what MatMul8bitLt allocates."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from oomkit.prediction.models.int8 import Linear8bitLtStorage, storage_bytes_int8
from oomkit.prediction.models.options import StepOptions
from oomkit.prediction.tracing import TraceRecording, trace_step

ROWS = 2 * 16  # batch 2, seq 16: the tokens a Linear sees


def _trace_layer(
    in_features: int = 64,
    *,
    dtype: torch.dtype = torch.bfloat16,
    bias: bool = False,
    outlier_columns: int = 0,
    threshold: float = 6.0,
) -> tuple[Linear8bitLtStorage, TraceRecording]:
    with torch.device("meta"):
        linear = nn.Linear(in_features, 32, bias=bias, dtype=torch.float32 if bias else dtype)
        layer = Linear8bitLtStorage(
            linear, threshold=threshold, outlier_columns=outlier_columns
        )
        x = torch.empty(2, 16, in_features, dtype=dtype, requires_grad=True)

    def step(layer: nn.Module, x: torch.Tensor) -> None:
        layer(x).sum().backward()

    return layer, trace_step(step, layer, x, steps=2)


def _events(recording: TraceRecording, phase: str) -> list[tuple[str, int, str | None]]:
    """(alloc, size, op) and (free, size, None) of step 1 inside ``phase``."""
    out: list[tuple[str, int, str | None]] = []
    inside = False
    for e in recording.step_events(1):
        tags = dict(e.tags)
        if e.action == "alloc":
            inside = tags.get("phase") == phase
            if inside:
                out.append(("alloc", e.size, tags.get("op")))
        elif e.action == "free_completed" and inside:
            out.append(("free", e.size, None))
    return out


def _peak_above_start(events: list[tuple[str, int, str | None]]) -> int:
    live = peak = 0
    for action, size, _ in events:
        live += size if action == "alloc" else -size
        peak = max(peak, live)
    return peak


def test_storage_bytes_of_one_weight():
    """Int8Params._quantize: one int8 per weight (CB) and one fp32 absmax per output row (SCB)."""
    assert storage_bytes_int8(32, 64) == {"weight": 2048, "SCB": 128}
    layer, recording = _trace_layer()
    assert layer.weight.dtype == torch.int8 and not layer.weight.requires_grad
    assert recording.allocated_bytes("parameter") == 2048
    assert recording.allocated_bytes("buffer") == 128


def test_forward_quantizes_the_input_and_dequantizes_the_int32_product():
    """bf16 [32, 64] -> [32, 32]: fp16 copy, int8 + row stats, outlier mask, int32, fp16, bf16."""
    _, recording = _trace_layer()
    assert _events(recording, "forward") == [
        ("alloc", ROWS * 64 * 2, "aten._to_copy.default"),  # A.to(float16)
        ("alloc", ROWS * 4, "aten.empty.memory_format"),  # row_stats, fp32 per row
        ("alloc", ROWS * 64, "aten.empty.memory_format"),  # out_row, int8
        ("alloc", ROWS * 64 * 2, "aten.abs.default"),  # A.abs() (fp16)
        ("alloc", ROWS * 64, "aten.ge.Scalar"),  # >= threshold (bool)
        ("free", ROWS * 64 * 2, None),
        ("alloc", 1, "aten.any.default"),  # if outliers.any():
        ("free", 1, None),
        ("free", ROWS * 64, None),
        ("alloc", 1, "aten.scalar_tensor.default"),  # out_row[:, outlier_cols] = 0
        ("free", 1, None),
        ("free", ROWS * 64 * 2, None),  # the fp16 copy, after int8_vectorwise_quant
        ("alloc", ROWS * 32 * 4, "aten.empty.memory_format"),  # int8_linear_matmul: int32
        ("alloc", ROWS * 32 * 2, "aten.empty_like.default"),  # int8_mm_dequant: fp16
        ("alloc", ROWS * 32 * 2, "aten._to_copy.default"),  # .to(bf16): the output
        ("free", ROWS * 32 * 2, None),
        ("free", ROWS * 32 * 4, None),
        ("free", ROWS * 64, None),  # CA
        ("free", ROWS * 4, None),  # SCA
    ]
    # The most the forward holds above its start: fp16 copy, row stats, int8, abs and mask.
    assert _peak_above_start(_events(recording, "forward")) == 4096 + 128 + 2048 + 4096 + 2048


def test_backward_dequantizes_the_whole_weight_for_the_input_gradient():
    """MatMul8bitLt.backward: CB.to(bf16) [32, 64] scaled by an fp32 [32, 1], then the matmul."""
    _, recording = _trace_layer()
    allocs = [(size, op) for action, size, op in _events(recording, "backward") if action == "alloc"]
    assert allocs == [
        (ROWS * 32 * 2, "aten.clone.default"),  # grad_output.reshape(...).contiguous()
        (32 * 64 * 2, "aten._to_copy.default"),  # state.CB.to(A.dtype, copy=True)
        (32 * 4, "aten.mul.Tensor"),  # SCB.unsqueeze(1).mul(1 / 127)
        (ROWS * 64 * 2, "aten.mm.default"),  # grad_A
    ]


def test_fp16_input_needs_no_casts():
    """An fp16 input is quantized as is and the fp16 dequantized product is the output."""
    _, recording = _trace_layer(dtype=torch.float16)
    ops = [op for action, _, op in _events(recording, "forward") if action == "alloc"]
    assert "aten._to_copy.default" not in ops
    assert ops[-1] == "aten.empty_like.default"


def test_no_threshold_skips_the_outlier_search():
    """threshold 0: no abs, mask or any(); the forward holds only the fp16 copy, int8 and stats."""
    _, recording = _trace_layer(threshold=0.0)
    ops = [op for action, _, op in _events(recording, "forward") if action == "alloc"]
    assert ops == [
        "aten._to_copy.default",
        "aten.empty.memory_format",
        "aten.empty.memory_format",
        "aten.empty.memory_format",
        "aten.empty_like.default",
        "aten._to_copy.default",
    ]


def test_inner_dimension_not_divisible_by_4_falls_back_to_fp32_matmul():
    """in 30: cuBLASLt cannot; A.float() and CB.float() [.., 30], an fp32 product cast to int32."""
    layer, recording = _trace_layer(30, bias=True)
    assert layer.bias is not None and layer.bias.dtype == torch.bfloat16  # cast to x's dtype
    sizes = [(size, op) for action, size, op in _events(recording, "forward") if action == "alloc"]
    assert sizes[7:12] == [
        (ROWS * 32 * 4, "aten.empty.memory_format"),  # the int32 output
        (ROWS * 30 * 4, "aten._to_copy.default"),  # B.float() (the activation)
        (32 * 30 * 4, "aten._to_copy.default"),  # A.float() (the weight)
        (ROWS * 32 * 4, "aten.mm.default"),  # the fp32 product
        (ROWS * 32 * 4, "aten._to_copy.default"),  # .to(torch.int32)
    ]


def test_outlier_columns_keep_sub_a_until_the_graph_dies():
    """k = 3 outlier columns: index, subA [32, 3] bf16, dequantized columns, addmm's output."""
    layer, recording = _trace_layer(outlier_columns=3)
    allocs = [(size, op) for action, size, op in _events(recording, "forward") if action == "alloc"]
    assert allocs[5:8] == [
        (1, "aten.any.default"),
        (64, "aten.any.dim"),  # outliers.any(dim=0)
        (3 * 8, "aten.empty.memory_format"),  # argwhere(...): int64 [k]
    ]
    assert allocs[9:14] == [
        (ROWS * 3 * 2, "aten.index.Tensor"),  # subA = A[:, outlier_cols]
        (32 * 3, "aten.index.Tensor"),  # CB[:, outlier_cols]
        (32 * 3 * 4, "aten.mul.Tensor"),  # * SCB (fp32)
        (32 * 3 * 4, "aten.mul.Tensor"),  # * 1/127
        (32 * 3 * 2, "aten._to_copy.default"),  # .to(bf16)
    ]
    assert allocs[-1] == (ROWS * 32 * 2, "aten.addmm.default")
    assert layer.idx is not None and tuple(layer.idx.shape) == (3,)  # state.idx persists


def test_refusals():
    """4-bit options with int8, bad outlier counts: clear errors; int8 may generate."""
    with pytest.raises(ValueError, match="int8 \\(Linear8bitLt\\) has neither"):
        StepOptions(quantize="int8", double_quant=True, mode="inference")
    with pytest.raises(ValueError, match="training a quantized model needs LoRA"):
        StepOptions(quantize="int8")
    assert StepOptions(quantize="int8", mode="generate").quantize == "int8"
    with torch.device("meta"), pytest.raises(ValueError, match="outlier_columns <= 8"):
        Linear8bitLtStorage(nn.Linear(8, 4), outlier_columns=9)


def test_int8_llama_with_lora_by_hand():
    """int8 Llama + LoRA: int8 weights, bf16 rest, fp32 adapters; SCB per row; no clone in peft."""
    pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from oomkit.prediction.models import build_hf_step
    from oomkit.prediction.models.lora_options import LoraOptions

    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=64,
    )
    options = StepOptions(
        batch_size=2, seq_len=16, precision="bf16", quantize="int8", lora=LoraOptions()
    )
    built = build_hf_step(config, options)
    recording = trace_step(built.step_fn, *built.track, steps=2)
    int8 = 2 * (4096 + 2048 + 2048 + 4096 + 8192 * 3)  # q, k, v, o, gate/up/down; 2 layers
    bf16 = 2 * (256 * 64) * 2 + 5 * 64 * 2  # embedding, lm_head (not quantized), 5 norms
    adapters = 2 * 8 * ((64 + 64) + (64 + 32)) * 4
    assert recording.allocated_bytes("parameter") == int8 + bf16 + adapters == 154_240
    scb = 2 * 4 * (64 + 32 + 32 + 64 + 128 + 128 + 64)
    assert recording.allocated_bytes("buffer") == scb + 2 * 8 * 4  # + rope's inv_freq twice
    assert recording.allocated_bytes("gradient", step=1) == adapters
    model = built.track[0]
    assert not isinstance(model.lm_head, Linear8bitLtStorage)
    assert isinstance(model.model.layers[1].mlp.down_proj, Linear8bitLtStorage)
    q_proj_ops = [
        dict(e.tags).get("op")
        for e in recording.step_events(1)
        if dict(e.tags).get("module") == "model.layers.1.self_attn.q_proj"
    ]
    assert q_proj_ops and "aten.clone.default" not in q_proj_ops  # peft's 8-bit layer: no clone
    assert "+ int8 + LoRA r8" in built.description

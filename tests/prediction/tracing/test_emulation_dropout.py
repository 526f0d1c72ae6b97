"""F.dropout recorded as CUDA's fused kernel: output plus a 1-byte bool mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _tiny_hf import tiny_gpt2_config

from oomkit.prediction.tracing import TraceRecording, trace_step

NATIVE_DROPOUT = "aten.native_dropout.default"
SHAPE = (4, 16, 32)
NUMEL = 4 * 16 * 32


def _allocs(recording: TraceRecording, op: str) -> list[int]:
    return [
        e.size for e in recording.events if e.action == "alloc" and dict(e.tags).get("op") == op
    ]


def _x(dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*SHAPE, device="meta", dtype=dtype, requires_grad=True)


def test_training_dropout_keeps_a_bool_mask():
    """nn.Dropout(0.1) on fp32: mask numel*1 then output numel*4 (Dropout.cu allocates the mask
    first), the mask saved for backward."""
    with torch.device("meta"):
        drop = torch.nn.Dropout(0.1)
    recording = trace_step(lambda m, x: m(x).sum().backward(), drop, _x())
    assert _allocs(recording, NATIVE_DROPOUT) == [NUMEL * 1, NUMEL * 4]
    mask = [
        e
        for e in recording.events
        if e.action == "alloc" and dict(e.tags).get("op") == NATIVE_DROPOUT
    ][0]
    assert dict(mask.tags)["saved_for_backward"] == "true"
    # meta's unfused path would have made an fp32 noise tensor with bernoulli_.
    assert _allocs(recording, "aten.bernoulli_.float") == []
    assert recording.warnings == ()


def test_bf16_dropout_mask_is_one_byte_per_element():
    """The mask does not follow the input's dtype: bf16 output numel*2, mask numel*1."""
    recording = trace_step(lambda x: F.dropout(x, 0.5).sum().backward(), _x(torch.bfloat16))
    assert _allocs(recording, NATIVE_DROPOUT) == [NUMEL, NUMEL * 2]


@pytest.mark.parametrize(
    ("kwargs", "fused"),
    [
        ({"p": 0.0}, False),
        ({"p": 1.0}, False),
        ({"p": 0.5, "training": False}, False),
        ({"p": 0.5, "inplace": True}, False),
        ({"p": 0.5}, True),
    ],
)
def test_fused_path_only_where_cuda_takes_it(kwargs, fused):
    """p in (0, 1), training, not in place: the fused kernel; otherwise meta's own path."""
    x = torch.randn(*SHAPE, device="meta")
    recording = trace_step(lambda t: F.dropout(t.clone(), **kwargs), x)
    assert bool(_allocs(recording, NATIVE_DROPOUT)) is fused


def test_hf_gpt2_dropout_masks_are_one_byte_per_element():
    """HF GPT-2 (2 layers, 64 wide) in training: every dropout keeps a numel*1 bool mask."""
    transformers = pytest.importorskip("transformers")
    config = tiny_gpt2_config(attn_implementation="sdpa")
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    model.train()
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")

    def step(model, ids):
        model(input_ids=ids, labels=ids).loss.backward()

    recording = trace_step(step, model, ids)
    sizes = _allocs(recording, NATIVE_DROPOUT)
    hidden = 2 * 16 * 64
    # embd dropout, then per layer: attn resid dropout and mlp dropout; (output, mask) pairs.
    assert sizes == [hidden, hidden * 4] * 5
    assert _allocs(recording, "aten.bernoulli_.float") == []


def test_dropout_nested_in_multihead_attention_is_fused():
    """need_weights=True: F.multi_head_attention_forward's own F.dropout call is seen and fused."""
    with torch.device("meta"):
        mha = torch.nn.MultiheadAttention(32, 4, dropout=0.1, batch_first=True)
    x = torch.randn(2, 16, 32, device="meta", requires_grad=True)

    def step(m, x):
        m(x, x, x, need_weights=True)[0].sum().backward()

    recording = trace_step(step, mha, x)
    scores = 2 * 4 * 16 * 16  # (B * heads, L, S) attention weights
    assert _allocs(recording, NATIVE_DROPOUT) == [scores, scores * 4]
    assert _allocs(recording, "aten.bernoulli_.float") == []

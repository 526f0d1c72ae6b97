"""torch.optim.Adafactor on meta: its factored states byte for byte, its RMS reads answered."""

from __future__ import annotations

import pytest
import torch

from oomkit.errors import OomkitError
from oomkit.prediction.models import StepOptions, build_hf_step
from oomkit.prediction.models.lora_options import LoraOptions
from oomkit.prediction.models.optimizers import TorchAdafactor, make_optimizer
from oomkit.prediction.tracing import TraceRecording, trace_step


def _trace_mlp(impl: str) -> tuple[TorchAdafactor, TraceRecording]:
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8))
        x = torch.empty(4, 64)
    optimizer = make_optimizer("torch-adafactor", list(model.parameters()), impl)
    assert isinstance(optimizer, TorchAdafactor)

    def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    return optimizer, trace_step(step, model, optimizer, steps=2)


def _state_allocs(recording: TraceRecording) -> list[tuple[int, str | None]]:
    return [
        (e.size, dict(e.tags).get("op"))
        for e in recording.step_events(0)
        if e.action == "alloc" and dict(e.tags).get("category") == "optimizer_state"
    ]


@pytest.mark.parametrize("impl", ["foreach", "for-loop"])
def test_row_and_column_factors_as_torch_allocates_them(impl):
    """[32, 64]: row [32, 1] + col [1, 64]; bias [32]: full; [8, 32]: [8, 1] + [1, 32]; fp32."""
    optimizer, recording = _trace_mlp(impl)
    assert _state_allocs(recording) == [
        (32 * 4, "aten.new_zeros.default"),
        (64 * 4, "aten.new_zeros.default"),
        (32 * 4, "aten.zeros_like.default"),
        (8 * 4, "aten.new_zeros.default"),
        (32 * 4, "aten.new_zeros.default"),
        (8 * 4, "aten.zeros_like.default"),
    ]
    assert recording.allocated_bytes("optimizer_state", step=1) == 0
    # `step` is torch.tensor(0.0) with no device: host memory, as on a CUDA run; counted for real.
    steps = [state["step"] for state in optimizer.state.values()]
    assert [(s.device.type, float(s)) for s in steps] == [("cpu", 2.0)] * 4
    # param and update RMS, read with .item() once each per parameter and step: 2 x 4 x 2.
    assert optimizer.reads_answered == 16


def test_foreach_holds_every_update_at_once_the_loop_one():
    """_multi_tensor_adafactor's _foreach_mul(grads, grads) for the vectors: both at once."""
    _, foreach = _trace_mlp("foreach")
    _, loop = _trace_mlp("for-loop")

    def ops(recording: TraceRecording) -> list[str | None]:
        return [
            dict(e.tags).get("op")
            for e in recording.step_events(1)
            if e.action == "alloc" and dict(e.tags).get("phase") == "optimizer"
        ]

    assert ops(foreach).count("aten._foreach_mul.List") == 2
    assert "aten._foreach_mul.List" not in ops(loop)
    assert ops(loop).count("aten.mul.Tensor") == 2


def test_lora_adapters_with_torch_adafactor_by_hand():
    """LoRA r8 on a tiny Llama: each adapter matrix gets a row and a column factor, fp32."""
    config = pytest.importorskip("transformers").LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=64,
    )
    options = StepOptions(
        batch_size=2, seq_len=16, optimizer="torch-adafactor", lora=LoraOptions(r=8)
    )
    pytest.importorskip("peft")
    built = build_hf_step(config, options)
    recording = trace_step(built.step_fn, *built.track, steps=2)
    # lora_A [8, 64]: 8 + 64; q lora_B [64, 8]: 64 + 8; v lora_B [32, 8]: 32 + 8; per layer.
    per_layer = (8 + 64) * 2 + (64 + 8) + (32 + 8)
    assert recording.allocated_bytes("optimizer_state", step=0) == 2 * per_layer * 4 == 2048
    assert "torch-adafactor" in built.description


def test_torch_adafactor_has_no_fused_kernel():
    """fused is refused by StepOptions and by make_optimizer, with the fix in the message."""
    with pytest.raises(ValueError, match="applies to adamw, adam only"):
        StepOptions(optimizer="torch-adafactor", optimizer_impl="fused")
    with pytest.raises(OomkitError, match="has no fused kernel; use optimizer_impl 'foreach'"):
        make_optimizer("torch-adafactor", [], "fused")

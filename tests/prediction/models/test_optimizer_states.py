"""Optimizer states byte for byte: bitsandbytes' 8-bit Adam (paged too), Adafactor, fused."""

from __future__ import annotations

import pytest
import torch
from _tiny_hf import tiny_llama_config

from oomkit.prediction.models import StepOptions, build_hf_step
from oomkit.prediction.models.lora_options import LoraOptions
from oomkit.prediction.models.optimizers import Adam8bitStates, PagedStateBuffer, make_optimizer
from oomkit.prediction.tracing import TraceRecording, trace_step

transformers = pytest.importorskip("transformers")

# A 2-layer Llama: hidden 64, 4 heads, 2 KV heads (k/v_proj 64 -> 32), MLP 128, vocab 2048,
# untied lm_head. Per layer: q_proj, o_proj 4096 elements; k_proj, v_proj 2048; gate/up/down
# 8192; two norms of 64. Embedding and lm_head 131072 each; the final norm 64.
PARAMETERS = 2 * (4096 * 2 + 2048 * 2 + 8192 * 3 + 64 * 2) + 131072 * 2 + 64


def _config() -> object:
    return tiny_llama_config(vocab_size=2048, max_position_embeddings=64)


def _trace(options: StepOptions) -> tuple[object, TraceRecording]:
    built = build_hf_step(_config(), options)
    return built, trace_step(built.step_fn, *built.track, steps=2)


def _eight_bit(numel: int) -> int:
    # state1 + state2 uint8, absmax1 + absmax2 fp32 per block of 256 (rounded up).
    return 2 * numel + 2 * 4 * -(-numel // 256)


def test_adamw8bit_states_counted_by_hand():
    """min_8bit_size 4096: k/v_proj and norms keep fp32 states, the rest uint8 + absmax + maps."""
    _, recording = _trace(StepOptions(batch_size=2, seq_len=16, optimizer="adamw8bit"))
    # Hand count: per layer q, o: 8192 + 128 = 8320; gate, up, down: 16384 + 256 = 16640;
    # k, v: 2 fp32 states = 16384; norms 2 * 512. Embedding and lm_head: 262144 + 4096.
    per_layer = 8320 * 2 + 16640 * 3 + 16384 * 2 + 512 * 2
    qmaps = 2 * 256 * 4  # create_dynamic_map: 256 fp32 codes, signed and unsigned, once
    expected = 2 * per_layer + 266240 * 2 + 512 + qmaps
    assert expected == 735_744
    assert recording.allocated_bytes("optimizer_state", step=0) == expected
    assert recording.allocated_bytes("optimizer_state", step=1) == 0
    # The same rules, parameter by parameter.
    layer = [4096, 2048, 2048, 4096, 8192, 8192, 8192, 64, 64]
    rule = sum(_eight_bit(n) if n >= 4096 else 8 * n for n in layer * 2 + [131072, 131072, 64])
    assert rule + qmaps == expected


def test_paged_adamw8bit_keeps_large_states_off_the_device():
    """Parameters of >= 1e5 elements (embedding, lm_head) page state1/state2: 2 x 262144 bytes."""
    built, recording = _trace(StepOptions(batch_size=2, seq_len=16, optimizer="paged-adamw8bit"))
    assert recording.allocated_bytes("optimizer_state", step=0) == 735_744 - 2 * 2 * 131072
    optimizer = built.track[1]
    assert optimizer.paged_state_bytes == 2 * 2 * 131072
    paged = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, PagedStateBuffer)]
    assert [(b.numel, b.dtype) for b in paged] == [(131072, torch.uint8)] * 4
    # said where the report shows it, counted before the first step (4 x 131072 = 512 KiB)
    assert "(512.00 KiB of paged optimizer states off the device)" in built.description


def test_adafactor_factored_states():
    """transformers' Adafactor: row + column fp32 for a matrix, full for a vector, RMS each step."""
    built, recording = _trace(StepOptions(batch_size=2, seq_len=16, optimizer="adafactor"))
    # (rows + cols) * 4 + a 4-byte RMS per matrix: q, o (64, 64) 516; k, v (32, 64) 388;
    # gate, up (128, 64), down (64, 128) 772; norms 64 * 4 + 4 = 260; embed/lm_head 8452.
    per_layer = 516 * 2 + 388 * 2 + 772 * 3 + 260 * 2
    assert recording.allocated_bytes("optimizer_state", step=0) == 2 * per_layer + 8452 * 2 + 260
    # state["RMS"] = self._rms(p) is a new 0-d fp32 tensor every step: 21 parameters.
    assert recording.allocated_bytes("optimizer_state", step=1) == 21 * 4
    assert type(built.track[1]).__module__ == "transformers.optimization"


@pytest.mark.parametrize(
    ("impl", "extra"), [("for-loop", 0), ("fused", 21 * 4)]
)
def test_torch_adamw_impls(impl, extra):
    """AdamW states 2 x fp32 per element; fused also keeps each `step` on the device (4 bytes)."""
    _, recording = _trace(StepOptions(batch_size=2, seq_len=16, optimizer_impl=impl))
    assert recording.allocated_bytes("optimizer_state", step=0) == 8 * PARAMETERS + extra


def test_lora_adapters_below_min_8bit_size_keep_fp32_states():
    """LoRA r=8 on this model: every adapter matrix has < 4096 elements, so states stay fp32."""
    options = StepOptions(batch_size=2, seq_len=16, optimizer="adamw8bit", lora=LoraOptions())
    _, recording = _trace(options)
    adapters = 2 * 8 * ((64 + 64) + (64 + 32))
    assert recording.allocated_bytes("optimizer_state", step=0) == 2 * 4 * adapters


def test_adam8bit_threshold_and_blocks():
    """4095 elements: two fp32 states; 4096: uint8 states, 16 absmax blocks, maps made once."""
    with torch.device("meta"):
        small = torch.nn.Parameter(torch.empty(4095))
        large = torch.nn.Parameter(torch.empty(4096))
        other = torch.nn.Parameter(torch.empty(4097))
    optimizer = Adam8bitStates([small, large, other])
    for p in (small, large, other):
        p.grad = torch.empty_like(p)
    optimizer.step()
    shapes = {
        name: (tuple(t.shape), t.dtype)
        for name, t in optimizer.state[large].items()
        if isinstance(t, torch.Tensor)
    }
    assert shapes == {
        "state1": ((4096,), torch.uint8),
        "state2": ((4096,), torch.uint8),
        "qmap1": ((256,), torch.float32),
        "qmap2": ((256,), torch.float32),
        "absmax1": ((16,), torch.float32),
        "absmax2": ((16,), torch.float32),
    }
    assert optimizer.state[other]["absmax1"].shape == (17,)
    assert optimizer.state[other]["qmap1"] is optimizer.state[large]["qmap1"]
    assert set(optimizer.state[small]) == {"step", "state1", "state2"}
    assert optimizer.state[small]["state1"].dtype == torch.float32
    assert optimizer.state[large]["step"] == 1


def test_optimizer_impl_refusals():
    """fused SGD (no meta kernel in torch) and fused 8-bit Adam are refused with an example."""
    with pytest.raises(ValueError, match="applies to adamw, adam only, not 'sgd'"):
        StepOptions(optimizer="sgd", optimizer_impl="fused")
    with pytest.raises(ValueError, match="not 'adamw8bit'"):
        StepOptions(optimizer="adamw8bit", optimizer_impl="for-loop")
    with pytest.raises(ValueError, match="optimizer_impl must be one of foreach, fused, for-loop"):
        StepOptions(optimizer_impl="capturable")
    with pytest.raises(Exception, match="unknown optimizer 'lion'"):
        make_optimizer("lion", [])


def test_expected_state_bytes_refuses_what_it_does_not_count():
    """The preset arithmetic covers adamw/adam/sgd full training only: others are refused."""
    from oomkit.errors import OomkitError
    from oomkit.prediction.models import expected_state_bytes

    for options in (StepOptions(optimizer="adamw8bit"), StepOptions(lora=LoraOptions())):
        with pytest.raises(OomkitError, match="expected_state_bytes covers full training"):
            expected_state_bytes("gpt2-124m", options)
    assert expected_state_bytes("gpt2-124m", StepOptions(optimizer="sgd"))["optimizer_state"] == (
        4 * 124_439_808
    )

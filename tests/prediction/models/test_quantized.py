"""QLoRA: bitsandbytes 4-bit storage byte for byte and the dequantized weight of each matmul."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _tiny_hf import tiny_llama_config

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from oomkit.errors import OomkitError  # noqa: E402
from oomkit.prediction.models import StepOptions, build_hf_step  # noqa: E402
from oomkit.prediction.models.lora_options import LoraOptions  # noqa: E402
from oomkit.prediction.models.quantized import (  # noqa: E402
    Linear4bitStorage,
    quantize_linears,
    storage_bytes_4bit,
)
from oomkit.prediction.tracing import TraceRecording, trace_step  # noqa: E402

# Per layer the Linears hold q 4096, k 2048, v 2048, o 4096, gate/up/down 8192 elements, i.e.
# 64 + 32 + 32 + 64 + 128 * 3 = 576 blocks of 64; 7 Linears; 2 layers.
BLOCKS_PER_LAYER = 576
TINY_GPT2 = Path(__file__).parent / "configs" / "tiny-gpt2"


def _config() -> object:
    return tiny_llama_config(vocab_size=256, max_position_embeddings=64)


def _trace(**kwargs: object) -> tuple[object, TraceRecording]:
    options = StepOptions(
        batch_size=2, seq_len=16, precision="bf16", quantize="nf4", lora=LoraOptions(), **kwargs
    )
    built = build_hf_step(_config(), options)
    return built, trace_step(built.step_fn, *built.track, steps=2)


def _allocs(recording: TraceRecording, module: str, phase: str) -> list[tuple[int, str | None]]:
    return [
        (e.size, dict(e.tags).get("op"))
        for e in recording.step_events(1)
        if e.action == "alloc"
        and dict(e.tags).get("module") == module
        and dict(e.tags).get("phase") == phase
    ]


def test_storage_bytes_of_one_weight():
    """quantize_4bit: 2 weights a byte, fp32 absmax per 64; double quant: uint8 absmax + nested."""
    assert storage_bytes_4bit(4097, double_quant=False) == {
        "weight": 2049,
        "code": 64,
        "absmax": 4 * 65,
    }
    assert storage_bytes_4bit(64 * 300, double_quant=True) == {
        "weight": 9600,
        "code": 64,
        "absmax": 300,
        "nested_absmax": 8,  # 300 blocks -> 2 nested blocks of 256
        "nested_code": 1024,
        "offset": 4,
    }


@pytest.mark.parametrize(("double_quant", "buffer_bytes"), [(False, 5568), (True, 16560)])
def test_quantized_llama_parameters_and_buffers_by_hand(double_quant, buffer_bytes):
    """Packed weights, bf16 embedding/lm_head/norms and fp32 adapters; the quant states."""
    built, recording = _trace(double_quant=double_quant)
    packed = 2 * (2048 + 1024 + 1024 + 2048 + 4096 * 3)
    bf16 = 2 * (256 * 64) * 2 + 5 * 64 * 2  # embedding, lm_head (not quantized), 5 norms
    adapters = 2 * 8 * ((64 + 64) + (64 + 32)) * 4
    assert recording.allocated_bytes("parameter") == packed + bf16 + adapters == 117_376
    rope = 2 * 8 * 4  # inv_freq and original_inv_freq of head_dim 16, fp32 as from_config makes them
    if double_quant:  # per Linear code 64 + nested absmax 4 + nested code 1024 + offset 4
        states = 2 * (BLOCKS_PER_LAYER + 7 * (64 + 4 + 1024 + 4))
    else:  # per Linear code 64, fp32 absmax per block
        states = 2 * (BLOCKS_PER_LAYER * 4 + 7 * 64)
    assert recording.allocated_bytes("buffer") == states + rope == buffer_bytes
    assert recording.allocated_bytes("gradient", step=1) == adapters
    model = built.track[0]
    assert not isinstance(model.lm_head, Linear4bitStorage)
    assert isinstance(model.model.layers[1].mlp.down_proj, Linear4bitStorage)


def test_each_matmul_dequantizes_its_weight_forward_and_backward():
    """q_proj (64x64, bf16): an [out, in] temporary per matmul; double quant first the absmax."""
    _, recording = _trace()
    module = "model.layers.1.self_attn.q_proj.base_layer"
    assert _allocs(recording, module, "forward") == [
        (64 * 64 * 2, "aten.empty.memory_format"),  # dequantize_4bit's output
        (2 * 16 * 64 * 2, "aten.mm.default"),  # F.linear's output
    ]
    assert _allocs(recording, module, "backward")[0] == (64 * 64 * 2, "aten.empty.memory_format")
    _, nested = _trace(double_quant=True)
    assert _allocs(nested, module, "forward")[:2] == [
        (64 * 4, "aten.empty.memory_format"),  # dequantize_blockwise(absmax): 64 fp32
        (64 * 64 * 2, "aten.empty.memory_format"),
    ]


def test_fp32_compute_dtype_casts_input_and_weight():
    """compute_dtype fp32 on a bf16 model: x.to(fp32), then the bf16 weight .to(fp32) copy."""
    _, recording = _trace(compute_dtype="fp32")
    sizes = [size for size, _ in _allocs(recording, "model.layers.1.self_attn.q_proj.base_layer",
                                          "forward")]
    assert sizes[:3] == [2 * 16 * 64 * 4, 64 * 64 * 2, 64 * 64 * 4]


def test_peft_4bit_layer_clones_the_base_output():
    """peft's bnb Linear4bit forward clones the base output once per adapted layer."""
    _, recording = _trace()
    clones = _allocs(recording, "model.layers.1.self_attn.q_proj", "forward")
    assert (2 * 16 * 64 * 2, "aten.clone.default") in clones


def test_quantize_refusals():
    """Training without LoRA, generating, options without quantize, no Linear: clear errors."""
    with pytest.raises(ValueError, match="training a quantized model needs LoRA"):
        StepOptions(quantize="nf4")
    with pytest.raises(ValueError, match="gemv_4bit"):
        StepOptions(quantize="fp4", mode="generate")
    with pytest.raises(ValueError, match="configure 4-bit weights; add quantize"):
        StepOptions(double_quant=True)
    with pytest.raises(OomkitError, match=r"no nn.Linear \(or transformers Conv1D\) layers"):
        quantize_linears(torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.LayerNorm(4)))


def _trace_gpt2(quantize: str) -> tuple[object, TraceRecording]:
    options = StepOptions(
        batch_size=2, seq_len=16, precision="bf16", quantize=quantize, lora=LoraOptions()
    )
    built = build_hf_step(TINY_GPT2, options)
    return built, trace_step(built.step_fn, *built.track, steps=2)


# tiny-gpt2 (n_embd 32, 2 layers): per layer Conv1D c_attn 32->96, attn.c_proj 32->32, c_fc
# 32->128, mlp.c_proj 128->32: 3072 + 1024 + 4096 + 4096 = 12288 weights, 288 bf16 bias values.
GPT2_WEIGHTS_PER_LAYER, GPT2_BIASES_PER_LAYER = 12288, 288
# wte 128x32 + wpe 64x32 + ln_1/ln_2 (2 x 64 per layer) + ln_f 64, bf16 (lm_head is wte, tied).
GPT2_BF16_REST = 2 * (128 * 32 + 64 * 32 + 2 * 128 + 64)
# LoRA r8 on c_attn (peft's gpt2 default), fp32: A 8x32 + B 96x8 per layer.
GPT2_ADAPTERS = 2 * (8 * 32 + 96 * 8) * 4


@pytest.mark.parametrize(
    ("quantize", "weight_bytes", "buffer_bytes"),
    [
        # nf4: 2 weights a byte; 16 fp32 code + fp32 absmax per 64 (48 + 16 + 64 + 64 blocks).
        ("nf4", 2 * GPT2_WEIGHTS_PER_LAYER // 2, 2 * (4 * 64 + 4 * 192)),
        # int8: one byte a weight; SCB one fp32 per output row (96 + 32 + 128 + 32).
        ("int8", 2 * GPT2_WEIGHTS_PER_LAYER, 2 * 4 * 288),
    ],
)
def test_gpt2_conv1d_quantized_as_transformers_converts_it(quantize, weight_bytes, buffer_bytes):
    """replace_with_bnb_linear turns GPT-2's Conv1D into [out, in] bnb layers: exact storage."""
    built, recording = _trace_gpt2(quantize)
    biases = 2 * GPT2_BIASES_PER_LAYER * 2
    assert recording.allocated_bytes("parameter") == (
        weight_bytes + biases + GPT2_BF16_REST + GPT2_ADAPTERS
    )
    assert recording.allocated_bytes("buffer") == buffer_bytes
    assert recording.allocated_bytes("gradient", step=1) == GPT2_ADAPTERS
    assert recording.allocated_bytes("optimizer_state", step=0) == 2 * GPT2_ADAPTERS
    model = built.track[0]
    c_attn = model.transformer.h[0].attn.c_attn
    assert (c_attn.base_layer.in_features, c_attn.base_layer.out_features) == (32, 96)
    assert tuple(c_attn.lora_B["default"].weight.shape) == (96, 8)
    assert f"+ {quantize}" in built.description


def test_gpt2_conv1d_nf4_dequantizes_an_out_in_weight():
    """c_attn's forward dequantizes a bf16 [96, 32] weight, then the [32 rows, 96] product."""
    _, recording = _trace_gpt2("nf4")
    assert _allocs(recording, "transformer.h.1.attn.c_attn.base_layer", "forward") == [
        (96 * 32 * 2, "aten.empty.memory_format"),
        (2 * 16 * 96 * 2, "aten.addmm.default"),
    ]


def test_cli_hf_gpt2_config_nf4_lora(capsys):
    """`predict --hf tiny-gpt2 --quantize nf4 --lora 8`: exit 0, the exact 4-bit storage bytes."""
    import json

    from oomkit.interfaces.cli import main

    args = ["predict", "--hf", str(TINY_GPT2), "--quantize", "nf4", "--lora", "8"]
    assert main([*args, "--batch", "2", "--seq", "16", "--precision", "bf16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # The report counts allocator blocks (each tensor rounded up to 512 bytes): wte 8192, wpe
    # 4096, 10 norm tensors 512 each; packed c_attn 1536, c_proj 512, c_fc and mlp c_proj 2048
    # each; 4 biases 512 each; lora_A 1024 and lora_B 3072; two layers.
    per_layer = (1536 + 512 + 2048 * 2) + 4 * 512 + (1024 + 3072)
    assert out["by_category_bytes"]["parameter"] == 8192 + 4096 + 10 * 512 + 2 * per_layer
    # code (64 bytes) and absmax (192, 64, 256, 256 bytes) of 4 layers a block each, twice.
    assert out["by_category_bytes"]["buffer"] == 2 * 8 * 512
    assert "+ nf4 + LoRA r8" in out["description"]

"""BitsAndBytesConfig / a config.json's quantization_config mapped to the 4-bit emulation."""

from __future__ import annotations

from pathlib import Path

import pytest

from oomkit.errors import ConfigError
from oomkit.prediction.models.bnb_config import bnb_step_fields

CONFIGS = Path(__file__).parent / "configs"


def test_a_bitsandbytes_config_object_maps_to_nf4_double_quant_bf16():
    """BitsAndBytesConfig(load_in_4bit, nf4, double quant, bf16 compute) -> the same fields."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    assert bnb_step_fields(config) == {
        "quantize": "nf4",
        "double_quant": True,
        "compute_dtype": "bf16",
    }


def test_bitsandbytes_defaults_are_fp4_single_quant_fp32_compute():
    """{"load_in_4bit": true} alone: BitsAndBytesConfig's defaults (fp4, no nesting, fp32)."""
    assert bnb_step_fields({"load_in_4bit": True}) == {
        "quantize": "fp4",
        "double_quant": False,
        "compute_dtype": "fp32",
    }


def test_load_in_8bit_maps_to_int8_with_bitsandbytes_defaults_only():
    """load_in_8bit is quantize int8; a threshold or fp16 weights other than the default: refused."""
    assert bnb_step_fields({"load_in_8bit": True}) == {"quantize": "int8"}
    assert bnb_step_fields({"load_in_8bit": True, "llm_int8_threshold": 6.0}) == {
        "quantize": "int8"
    }
    for extra in ({"llm_int8_threshold": 0.0}, {"llm_int8_has_fp16_weight": True}):
        with pytest.raises(ConfigError, match="load_in_8bit with llm_int8_threshold"):
            bnb_step_fields({"load_in_8bit": True, **extra})


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq' is not modelled"),
        ({"load_in_4bit": True, "load_in_8bit": True}, "both load_in_4bit and load_in_8bit"),
        ({}, "neither load_in_4bit nor load_in_8bit"),
        ({"load_in_4bit": "yes"}, "load_in_4bit must be true or false"),
        ({"load_in_4bit": True, "bnb_4bit_quant_type": "int4"}, "must be nf4 or fp4"),
        ({"load_in_4bit": True, "bnb_4bit_quant_storage": "bfloat16"}, "storage bfloat16"),
        ({"load_in_4bit": True, "bnb_4bit_compute_dtype": "float64"}, "compute_dtype must be"),
        ({"load_in_4bit": True, "llm_int8_skip_modules": ["mlp"]}, "skip_modules"),
    ],
)
def test_settings_not_modelled_are_refused(config, message):
    """Other methods, contradictions and storage changes: ConfigError saying what to do."""
    with pytest.raises(ConfigError, match=message):
        bnb_step_fields(config)


def test_a_config_dirs_quantization_config_quantizes_as_the_options_would():
    """--hf DIR with quantization_config records the same events as the options given by hand."""
    pytest.importorskip("peft")
    pytest.importorskip("transformers")
    from oomkit.prediction.models import StepOptions, build_hf_step
    from oomkit.prediction.models.lora_options import LoraOptions
    from oomkit.prediction.tracing import trace_step

    def trace(path: Path, **fields: object) -> object:
        options = StepOptions(batch_size=2, seq_len=16, lora=LoraOptions(r=8), **fields)  # type: ignore[arg-type]
        built = build_hf_step(path, options)
        return trace_step(built.step_fn, *built.track, steps=2)

    def sizes(recording: object) -> list[tuple[str, int]]:
        return [(e.action, e.size) for e in recording.events]  # type: ignore[attr-defined]

    from_config = trace(CONFIGS / "tiny-llama-4bit")
    by_hand = trace(CONFIGS / "tiny-llama", quantize="nf4", double_quant=True, compute_dtype="bf16")
    assert sizes(from_config) == sizes(by_hand)
    # bf16 embeddings and lm_head (256 x 64 x 2 each), 5 norms (64 x 2), 14 packed weights
    # (q 64x64, k/v 64x32, o 64x64, gate/up/down 64x128, per layer: numel / 2 bytes) and the
    # fp32 LoRA adapters (2 layers x 8 x ((64+64) + (64+32)) x 4).
    packed = 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128) // 2
    assert from_config.bytes_by_category["parameter"] == (  # type: ignore[attr-defined]
        2 * 256 * 64 * 2 + 5 * 64 * 2 + packed + 2 * 8 * (128 + 96) * 4
    ) == 117_376
    # per Linear: 16-entry fp32 code, uint8 absmax per 64, one fp32 nested absmax, the
    # 256-entry fp32 nested code and the offset; plus RoPE's two 32-byte buffers.
    blocks = packed * 2 // 64
    assert from_config.bytes_by_category["buffer"] == (  # type: ignore[attr-defined]
        14 * (64 + 4 + 1024 + 4) + blocks + 64
    ) == 16_560
    stated = trace(CONFIGS / "tiny-llama-4bit", quantize="fp4")  # stated: wins over the config's
    assert stated.bytes_by_category["buffer"] == 14 * 64 + 4 * blocks + 64  # type: ignore[attr-defined]


def test_a_quantization_config_and_quantize_together_are_refused():
    """build_hf_step(quantization_config=...) with StepOptions(quantize=...) as well: refused."""
    pytest.importorskip("transformers")
    from oomkit.prediction.models import StepOptions, build_hf_step
    from oomkit.prediction.models.lora_options import LoraOptions

    options = StepOptions(batch_size=1, seq_len=8, lora=LoraOptions(r=4), quantize="nf4")
    with pytest.raises(ConfigError, match="give the quantization once"):
        build_hf_step(CONFIGS / "tiny-llama", options, quantization_config={"load_in_4bit": True})

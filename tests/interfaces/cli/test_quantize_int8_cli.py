"""`predict --quantize int8`: Linear8bitLt base weights from the CLI, and its refusals."""

from __future__ import annotations

import json

import pytest

from oomkit.interfaces.cli import main

pytest.importorskip("torch")
pytest.importorskip("peft")

# GPT-2 124M preset: per block c_attn 768->2304, c_proj 768->768, c_fc 768->3072, mlp c_proj
# 3072->768 as nn.Linear; 12 blocks.
GPT2_LINEAR_ROWS = 12 * (2304 + 768 + 3072 + 768)


def test_predict_int8_lora_saves_and_counts_the_int8_weights(capsys):
    """--quantize int8 --lora 8: int8 weights and fp32 SCB per output row, saved as int8."""
    argv = ["predict", "gpt2-124m", "--quantize", "int8", "--lora", "8", "--batch", "1"]
    assert main([*argv, "--seq", "16", "--precision", "bf16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["workload"]["options"]["quantize"] == "int8"
    assert out["description"].startswith("GPT-2 124M + int8 + LoRA r8, batch 1")
    # The preset has no buffers of its own: all are SCB, one fp32 per output row of each Linear.
    assert out["by_category_bytes"]["buffer"] == 4 * GPT2_LINEAR_ROWS == 331_776


def test_int8_refuses_4bit_options(capsys):
    """--double-quant with --quantize int8: exit 2, the message names the flag to use."""
    argv = ["predict", "gpt2-124m", "--batch", "1", "--seq", "16", "--mode", "inference"]
    assert main([*argv, "--quantize", "int8", "--double-quant"]) == 2
    err = capsys.readouterr().err
    assert "int8 (Linear8bitLt) has neither" in err and "--quantize nf4" in err

"""`predict` / `fit` with --lora and its options, the new optimizers and --optimizer-impl."""

from __future__ import annotations

import json

import pytest

from oomkit.interfaces.cli import main

pytest.importorskip("torch")
pytest.importorskip("peft")

GPT2_ADAPTER_BYTES = 12 * 8 * (768 + 2304) * 4  # c_attn 768 -> 2304, r=8, fp32, 12 layers


def test_predict_lora_saves_its_options_and_counts_adapter_gradients(capsys):
    """--lora 8 on GPT-2: adapter gradients only, the options saved with the workload."""
    args = ["predict", "gpt2-124m", "--lora", "8", "--lora-dropout", "0.05", "--batch", "1"]
    assert main([*args, "--seq", "16", "--precision", "fp32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["description"].startswith("GPT-2 124M + LoRA r8, batch 1")
    assert out["workload"]["options"]["lora"] == {
        "r": 8,
        "alpha": 8,
        "targets": None,
        "dropout": 0.05,
        "modules_to_save": [],
        "dora": False,
    }
    # AdamW's two states of the adapters only (the frozen GPT-2 weights have none).
    assert out["by_category_bytes"]["optimizer_state"] == 2 * GPT2_ADAPTER_BYTES
    # explain re-predicts from the saved workload: its options are read back as built.
    from oomkit.prediction.models import StepOptions
    from oomkit.prediction.models.lora_options import LoraOptions
    from oomkit.prediction.workload import workload_from_json

    # as diagnose/_model_remedies.py rebuilds them: the fields that are known
    known = {k: v for k, v in workload_from_json(out).options.items() if v is not None}
    assert StepOptions(**known).lora == LoraOptions(r=8, dropout=0.05)


def test_predict_with_lora_targets_and_adamw8bit(capsys):
    """--lora-targets picks the layers; adamw8bit's fp32 fallback applies to tiny adapters."""
    args = ["predict", "gpt2-124m", "--lora", "4", "--lora-targets", "c_attn,c_proj"]
    assert main([*args, "--optimizer", "adamw8bit", "--batch", "1", "--seq", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["workload"]["options"]["lora"]["targets"] == ["c_attn", "c_proj"]
    assert out["workload"]["options"]["optimizer"] == "adamw8bit"
    assert "LoRA r4 (c_attn, c_proj)" in out["description"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--lora-dropout", "0.1"], "--lora-dropout configures LoRA: add --lora R"),
        (["--dora", "--lora-alpha", "16"], "--lora-alpha, --dora configure LoRA"),
        (["--lora", "8", "--lora-targets", "nope"], "peft could not add LoRA adapters"),
        (["--lora", "8", "--lora-targets", ","], "targets must be module names"),
        (["--optimizer", "sgd", "--optimizer-impl", "fused"], "applies to adamw, adam only"),
    ],
)
def test_bad_finetune_flags_exit_2(extra, message, capsys):
    """A LoRA option without --lora, a target the model lacks, fused SGD: exit 2, one message."""
    assert main(["predict", "gpt2-124m", "--batch", "1", "--seq", "16", *extra]) == 2
    assert message in capsys.readouterr().err


def test_lora_dropout_must_be_a_probability(capsys):
    """--lora-dropout 1.5 is refused by the scenario (exit 2), naming the flag and the field."""
    assert main(["predict", "gpt2-124m", "--lora", "8", "--lora-dropout", "1.5"]) == 2
    assert "--lora-dropout (lora.dropout): must be below 1.0; got '1.5'" in capsys.readouterr().err


def test_user_function_refuses_lora(tmp_path, capsys):
    """A file.py:function step runs as written: --lora and its options are refused by name."""
    script = tmp_path / "step.py"
    script.write_text("def build(batch_size):\n    return (lambda: None), []\n")
    assert main(["predict", f"{script}:build", "--lora", "8"]) == 2
    assert "--lora applies to presets and --hf only" in capsys.readouterr().err
    argv = ["predict", f"{script}:build", "--lora-targets", "q", "--quantize", "nf4", "--dora"]
    assert main(argv) == 2
    assert "--lora-targets and --dora and --quantize apply to presets" in capsys.readouterr().err


def test_fit_searches_a_lora_batch(capsys):
    """fit with --lora and paged-adamw8bit finds a batch and says LoRA in its description."""
    args = ["fit", "gpt2-124m", "--lora", "8", "--optimizer", "paged-adamw8bit", "--seq", "32"]
    assert main([*args, "--gpu", "2GiB", "--max-batch", "2", "--json"]) in (0, 1)
    out = json.loads(capsys.readouterr().out)
    assert "LoRA r8" in json.dumps(out)


def test_predict_qlora_saves_quantize_options(capsys):
    """--quantize nf4 --double-quant --compute-dtype bf16 with --lora: saved, described."""
    args = ["predict", "gpt2-124m", "--quantize", "nf4", "--double-quant", "--compute-dtype"]
    argv = [*args, "bf16", "--lora", "8", "--precision", "bf16", "--batch", "1", "--seq", "16"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    options = out["workload"]["options"]
    assert (options["quantize"], options["double_quant"], options["compute_dtype"]) == (
        "nf4",
        True,
        "bf16",
    )
    assert out["description"].startswith("GPT-2 124M + nf4 double-quant + LoRA r8, batch 1")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--double-quant"], "add quantize, e.g. --quantize nf4"),
        (["--quantize", "nf4"], "needs LoRA adapters: add --lora N"),
        (["--quantize", "fp4", "--mode", "generate"], "gemv_4bit"),
    ],
)
def test_bad_quantize_flags_exit_2(extra, message, capsys):
    """Quantize options without --quantize, 4-bit training without LoRA, generate: exit 2."""
    assert main(["predict", "gpt2-124m", "--batch", "1", "--seq", "16", *extra]) == 2
    assert message in capsys.readouterr().err

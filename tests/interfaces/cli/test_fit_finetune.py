"""`fit` searches the per-device batch of a QLoRA run (--hf, --lora, --quantize) exactly."""

from __future__ import annotations

import json

import pytest

from oomkit.interfaces.cli import main

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

# A 200 MiB GPU with no CUDA context, no margin: the bound is what predict says fits.
FLAGS = ["--lora", "8", "--quantize", "nf4", "--seq", "128", "--precision", "bf16",
         "--gpu", "200MiB", "--context-overhead", "0"]


def test_fit_finds_the_qlora_batch_that_predict_says_fits(tmp_path, capsys):
    """fit's batch N fits and N + 1 does not, by predict with the same QLoRA flags."""
    transformers.LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=4096, max_position_embeddings=256,
    ).save_pretrained(tmp_path)
    model = ["--hf", str(tmp_path)]
    assert main(["fit", *model, *FLAGS, "--margin", "0", "--batch", "8", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert (found["batch_size"], found["first_failing_batch"]) == (15, 16)
    assert "+ nf4 + LoRA r8, batch 15" in found["description"]
    assert main(["predict", *model, *FLAGS, "--batch", "15", "--json"]) == 0
    at_15 = json.loads(capsys.readouterr().out)
    assert at_15["fits"] and at_15["required_bytes"] == found["peak_reserved_bytes"]
    # --no-remedies: only the verdict is read, not the remedies measured by re-predicting.
    assert main(["predict", *model, *FLAGS, "--batch", "16", "--no-remedies", "--json"]) == 1
    assert not json.loads(capsys.readouterr().out)["fits"]

"""The examples/ recipes run through `oomkit predict examples/X.py:build` and match their plain
equivalents byte for byte, or differ by what they add, counted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from oomkit.interfaces.cli import main

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = Path(__file__).parent / "variants.py"
SIZE = ["--batch", "2", "--seq", "64"]
# One small block (CUDACachingAllocator.cpp round_size: kMinBlockSize = 512).
SCALAR_BYTES = 512


def _predict(capsys: pytest.CaptureFixture[str], target: str) -> dict:
    capsys.readouterr()
    code = main(["predict", target, *SIZE, "--gpu", "h100", "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)


def _pair(capsys: pytest.CaptureFixture[str], name: str) -> tuple[dict, dict]:
    example = _predict(capsys, f"{VARIANTS}:small_{name}")
    plain = _predict(capsys, f"{VARIANTS}:plain_{name}")
    return example, plain


def test_every_example_has_a_test():
    """Each examples/*.py recipe is run by a small_* builder here (none goes untested)."""
    examples = {p.stem for p in (ROOT / "examples").glob("*.py")}
    text = VARIANTS.read_text()
    builders = {"nanogpt_train", "hf_causal_lm", "lightning_fit", "hf_trainer"}
    assert examples == builders | {"train_loop"}  # train_loop: a whole script, tested below
    assert all(f"examples/{name}.py" in text for name in builders)


def test_the_script_example_runs_with_its_own_arguments(tmp_path, monkeypatch, capsys):
    """examples/train_loop.py as a whole script: its --batch_size after `--` sizes the step,
    and the checkpoint it saves after its loop is never written."""
    from oomkit.interfaces.cli import main

    monkeypatch.chdir(tmp_path)
    peaks = []
    for batch in ("8", "256"):
        argv = ["predict", str(ROOT / "examples/train_loop.py"), "--gpu", "rtx4090", "--json",
                "--steps", "2", "--", "--batch_size", batch]
        assert main(argv) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["scenario"]["model"]["script_args"] == ["--batch_size", batch]
        peaks.append(out["peak_allocated_bytes"])
    assert peaks[1] > peaks[0] > 0
    assert list(tmp_path.iterdir()) == []


def test_nanogpt_builder_made_autocast_is_bf16_and_logged_item_stands_in(capsys):
    """nanoGPT's ctx built once = autocast in the step, byte for byte; loss.item() is listed."""
    example, plain = _pair(capsys, "nanogpt")
    assert example["peak_allocated_bytes"] == plain["peak_allocated_bytes"]
    assert example["peak_reserved_bytes"] == plain["peak_reserved_bytes"]
    assert any("nanogpt_train.py" in w and "stand-in" in w for w in example["warnings"])


def test_hf_causal_lm_all_ones_mask_costs_what_no_mask_costs(capsys):
    """A tokenizer's all-ones attention mask is answered: the same bytes as no mask at all."""
    pytest.importorskip("transformers")
    example, plain = _pair(capsys, "hf_causal_lm")
    # The mask itself is an input on the device: batch x seq int64, 2 x 64 x 8 = 1024 bytes.
    mask_bytes = 2 * 64 * 8
    assert example["peak_allocated_bytes"] - plain["peak_allocated_bytes"] == mask_bytes
    assert example["peak_reserved_bytes"] == plain["peak_reserved_bytes"]
    assert any("_ignore_causal_mask_sdpa" in a for a in example["assumptions"])


def test_lightning_example_is_the_plain_loop_plus_lightnings_scalars(capsys):
    """Trainer.fit (bf16-mixed, clipping, self.log) = the plain loop + a few device scalars."""
    pytest.importorskip("lightning")
    example, plain = _pair(capsys, "lightning")
    extra = example["peak_allocated_bytes"] - plain["peak_allocated_bytes"]
    # Lightning's own scalars alive at the peak: the loss divided by accumulate_grad_batches,
    # its detached clone (loops/optimization/automatic.py ClosureResult) and self.log's
    # ResultMetric tensors (logger_connector/result.py): at most 6 small blocks.
    assert 0 < extra <= 6 * SCALAR_BYTES
    assert example["peak_reserved_bytes"] == plain["peak_reserved_bytes"]
    assert "Lightning Trainer.fit, precision bf16-mixed" in example["description"]


def test_hf_trainer_example_is_the_plain_loop_with_accelerates_fp32_outputs(capsys):
    """transformers' Trainer(bf16=True) = the plain loop with accelerate's fp32 logits, within
    a few scalars (the Trainer's loss total; the batch's tensors made by its collator)."""
    pytest.importorskip("transformers")
    example, plain = _pair(capsys, "hf_trainer")
    extra = example["peak_allocated_bytes"] - plain["peak_allocated_bytes"]
    assert abs(extra) <= 4 * SCALAR_BYTES
    assert example["peak_reserved_bytes"] == plain["peak_reserved_bytes"]
    assert "Hugging Face Trainer.train, bf16" in example["description"]

"""explain on a saved --hf prediction: LoRA, QLoRA and 8-bit AdamW remedies, re-predicted."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from oomkit.diagnose._finetune_remedies import finetune_changes
from oomkit.diagnose._model_remedies import MEASURED_WHY, measured_model_remedies
from oomkit.diagnose.prediction_diagnosis import diagnose_prediction

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

LORA = "LoRA adapters (peft, r8) instead of full fine-tuning"
QLORA_ADDED = "QLoRA: 4-bit nf4 base weights + LoRA adapters (peft, r8)"
QLORA_UNDER = "QLoRA: 4-bit nf4 base weights under the LoRA adapters"
EIGHT_BIT = "8-bit AdamW (bitsandbytes AdamW8bit)"
# A 200 MiB GPU with no CUDA context: the tiny model's step fits at batch 8, not at 16 (32 LoRA).
GPU = ["--gpu", "200MiB", "--context-overhead", "0", "--seq", "128", "--precision", "bf16"]


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory):
    """A one-layer Llama config directory, as save_pretrained() writes it (no weights)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    transformers.LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=4096, max_position_embeddings=256,
    ).save_pretrained(path)
    return str(path)


def _predict(config_dir: str, *flags: str) -> dict:
    """`predict --hf DIR GPU... --json FLAGS`, saved as JSON. ``--no-remedies``: the tests
    measure the remedies of a save themselves (``measured_model_remedies``,
    ``diagnose_prediction``) and read none that predict would measure for its verdict; the
    save differs only by its ``remedies`` (and ``scenario.run.no_remedies``), which neither
    reads."""
    from oomkit.interfaces.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["predict", "--hf", config_dir, *GPU, "--json", "--no-remedies", *flags])
    saved = json.loads(out.getvalue())
    assert "remedies" not in saved
    return saved


@pytest.fixture(scope="module")
def full(config_dir):
    """`predict --hf DIR --batch 16` (full fine-tuning, AdamW): an OOM, saved as JSON."""
    return _predict(config_dir, "--batch", "16")


@pytest.fixture(scope="module")
def lora(config_dir):
    """`predict --hf DIR --batch 32 --lora 8 --checkpointing --optimizer sgd`: an OOM."""
    return _predict(config_dir, "--batch", "32", "--lora", "8", "--checkpointing",
                    "--optimizer", "sgd")


def test_finetune_changes_apply_where_they_make_sense():
    """LoRA only without LoRA; QLoRA adds LoRA to a full fine-tune; 8-bit only for Adam(W)."""
    from oomkit.prediction.models import StepOptions
    from oomkit.prediction.models.lora_options import LoraOptions

    titles = [title for title, _, _ in finetune_changes(StepOptions())]
    assert titles == [LORA, QLORA_ADDED, EIGHT_BIT]
    lora = StepOptions(lora=LoraOptions(r=16), optimizer="sgd")
    assert [title for title, _, _ in finetune_changes(lora)] == [QLORA_UNDER]
    qlora = StepOptions(lora=LoraOptions(), quantize="nf4", optimizer="adamw8bit")
    assert finetune_changes(qlora) == []
    int8 = StepOptions(lora=LoraOptions(), quantize="int8", optimizer="adam",
                       optimizer_impl="fused")
    (qtitle, qchange, _), (otitle, ochange, _) = finetune_changes(int8)
    assert qtitle == "QLoRA: 4-bit nf4 base weights instead of int8 under the LoRA adapters"
    assert qchange == {"quantize": "nf4", "double_quant": False, "compute_dtype": None}
    assert (otitle, ochange) == (EIGHT_BIT, {"optimizer": "adamw8bit", "optimizer_impl": "foreach"})
    assert finetune_changes(StepOptions(mode="inference")) == []


def test_full_finetune_savings_are_differences_of_two_predictions(config_dir, full):
    """Each fine-tuning remedy saves required(before) - required(predict with the flags)."""
    assert full["oom"] is not None and full["workload"]["kind"] == "hf"
    remedies = {r.title: r for r in measured_model_remedies(full)[0]}
    assert {LORA, QLORA_ADDED, EIGHT_BIT, "activation checkpointing"} <= set(remedies)
    required = full["required_bytes"]
    for title, flags in (
        (LORA, ("--lora", "8")),
        (QLORA_ADDED, ("--lora", "8", "--quantize", "nf4")),
        (EIGHT_BIT, ("--optimizer", "adamw8bit")),
    ):
        after = _predict(config_dir, "--batch", "16", *flags)["required_bytes"]
        assert remedies[title].saving_bytes == required - after > 0, title
        assert (remedies[title].estimate, remedies[title].confidence) == (False, "high")
        assert MEASURED_WHY in remedies[title].why
    assert remedies[LORA].saving_bytes == (246 - 206) * 2**20  # 246 MiB -> 206 MiB reserved


def test_lora_batch_remedy_is_re_predicted_not_scaled_from_all_parameters(config_dir, lora):
    """Under LoRA an OOM before gradients gets no estimated batch remedy; the measured one is
    the difference of two predictions (was: gradients + states of every parameter added)."""
    by_category = lora["peak_allocated_at"]["by_category_bytes"]
    assert "gradient" not in by_category and lora["oom"] is not None
    estimated = diagnose_prediction(lora, measure=False)
    assert not any(r.title.startswith("batch size") for r in estimated.remedies)
    assert "freeze pretrained layers (transfer learning)" not in {
        r.title for r in estimated.remedies
    }
    assert any("under LoRA only the adapters" in w for w in estimated.warnings)
    measured = {r.title: r for r in diagnose_prediction(lora).remedies}
    assert LORA not in measured  # already LoRA
    # Batch 16 fits alone, not with the adapters' gradients kept between micro-batches.
    batch = measured["batch size 8 with 4 gradient-accumulation steps"]
    after = _predict(config_dir, "--batch", "8", "--grad-accum", "2", "--lora", "8",
                     "--checkpointing", "--optimizer", "sgd")
    assert batch.saving_bytes == lora["required_bytes"] - after["required_bytes"]
    assert not _predict(config_dir, "--batch", "16", "--grad-accum", "2", "--lora", "8",
                        "--checkpointing", "--optimizer", "sgd")["fits"]
    assert not batch.estimate
    # QLoRA was re-predicted and saves nothing here (the tiny model's weights are mostly its
    # embeddings, which stay bf16; each matmul adds a dequantized weight): not offered.
    qlora = _predict(config_dir, "--batch", "32", "--lora", "8", "--checkpointing",
                     "--optimizer", "sgd", "--quantize", "nf4")
    assert qlora["required_bytes"] >= lora["required_bytes"]
    assert QLORA_UNDER not in measured


def test_unreadable_hf_workload_is_estimated_with_a_warning(lora, tmp_path):
    """A --hf directory that is gone: nothing re-predicted, a warning says why."""
    moved = json.loads(json.dumps(lora))
    moved["workload"]["name"] = str(tmp_path / "gone")
    remedies, warnings = measured_model_remedies(moved)
    assert remedies == []
    assert len(warnings) == 1 and "could not be rebuilt to re-predict" in warnings[0]


def test_fused_adamw_save_re_predicts_sgd_with_foreach():
    """A fused-AdamW run's SGD change is foreach SGD (fused SGD was a ValueError before)."""
    saved = {
        "required_bytes": 2, "usable_bytes": 1,
        "workload": {"kind": "preset", "name": "not-a-preset", "steps": 2, "options": {
            "batch_size": 1, "precision": "bf16", "checkpointing": True, "mode": "train",
            "optimizer": "adamw", "optimizer_impl": "fused",
        }},
    }
    remedies, warnings = measured_model_remedies(saved)
    # The SGD change was built and rebuilding was tried: the preset is unknown.
    assert remedies == [] and "unknown model preset 'not-a-preset'" in warnings[0]


def test_a_lora_base_is_loaded_in_bf16_where_the_step_kept_fp32_weights():
    """LoRA and QLoRA on a bf16-mixed or fp32 step re-predict a bf16 base (fp16 where the GPU
    has no bf16), as peft users load it and as `--lora` defaults; a pure bf16 step and a
    Trainer's loop keep theirs."""
    from oomkit.prediction.models import StepOptions

    for precision in ("fp32", "bf16-mixed", "fp16-mixed"):
        changes = finetune_changes(StepOptions(precision=precision))
        assert [fields.get("precision") for _, fields, _ in changes] == ["bf16", "bf16", None]
        assert "torch_dtype=torch.bfloat16" in changes[0][2]
        assert "bnb_4bit_compute_dtype=torch.bfloat16" in changes[1][2]
    on_t4 = finetune_changes(StepOptions(precision="fp32"), "fp16")
    assert [fields.get("precision") for _, fields, _ in on_t4] == ["fp16", "fp16", None]
    assert all("precision" not in fields for _, fields, _ in finetune_changes(StepOptions(precision="bf16")))
    trainer = StepOptions(precision="bf16-mixed", trainer_mixed_precision="bf16")
    assert all("precision" not in fields for _, fields, _ in finetune_changes(trainer))

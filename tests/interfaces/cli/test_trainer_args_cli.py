"""`predict`/`fit` --trainer-args and --grad-accum, offline on a shipped config directory."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from oomkit.interfaces.cli import main

pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("transformers")

CONFIGS = Path(__file__).parents[2] / "prediction" / "models" / "configs"
TINY_LLAMA = str(CONFIGS / "tiny-llama")
SMALL = ["--seq", "16", "--steps", "2"]


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No network at all: HF_HUB_OFFLINE=1, an empty HF cache, and sockets that cannot connect."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "hf-home"
    cache.mkdir()
    monkeypatch.setenv("HF_HOME", str(cache))

    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError("network access in an offline test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    return cache


def _args_file(tmp_path: Path, **values: object) -> str:
    path = tmp_path / "args.json"
    path.write_text(json.dumps(values))
    return str(path)


def test_hf_dir_with_lora_and_trainer_args_predicts_offline(offline, tmp_path, capsys):
    """--hf DIR --lora --trainer-args: read, recorded and saved with no network, no download."""
    args_file = _args_file(
        tmp_path,
        output_dir="out",
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        gradient_checkpointing=True,
        bf16=True,
        optim="adamw_8bit",
        learning_rate=2e-4,
        max_length=32,
    )
    code = main(["predict", "--hf", TINY_LLAMA, "--lora", "8", "--trainer-args", args_file,
                 "--steps", "2", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    options = out["workload"]["options"]
    assert {key: options[key] for key in ("batch_size", "seq_len", "grad_accum", "checkpointing",
                                          "optimizer", "max_grad_norm", "precision")} == {
        "batch_size": 2,
        "seq_len": 32,
        "grad_accum": 2,
        "checkpointing": "full",
        "optimizer": "adamw8bit",
        "max_grad_norm": 1.0,
        "precision": "bf16",  # bf16=True over the config's bf16 weights
    }
    assumptions = out["assumptions"]
    assert assumptions["trainer args"] == args_file
    assert assumptions["trainer args ignored"].startswith("learning_rate, output_dir")
    assert "pure bf16" in assumptions["trainer args precision"]
    assert "accumulate 2, clip 1" in out["description"]
    # LoRA r8 adapters of q_proj/v_proj (2 layers, fp32) are the only gradients.
    assert out["by_category_bytes"]["gradient"] == 2 * 8 * (128 + 96) * 4
    assert list(offline.rglob("*")) == []  # nothing was downloaded or cached


def test_flags_given_override_the_file_and_say_so(tmp_path, capsys):
    """--batch 4 and --optimizer adamw beat the file's batch 2 and adafactor, reported."""
    args_file = _args_file(tmp_path, per_device_train_batch_size=2, optim="adafactor")
    code = main(["predict", "--hf", TINY_LLAMA, "--trainer-args", args_file, "--batch", "4",
                 "--optimizer", "adamw", *SMALL, "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["workload"]["options"]["batch_size"] == 4
    assert out["workload"]["options"]["optimizer"] == "adamw"
    assert out["assumptions"]["trainer args overridden"] == (
        "batch_size=4 (not 2); optimizer='adamw' (not 'adafactor')"
    )


def test_grad_accum_flag_is_recorded_and_saved(capsys):
    """--grad-accum 3: the step says so and the saved options keep it."""
    code = main(["predict", "--hf", TINY_LLAMA, "--batch", "1", "--grad-accum", "3", *SMALL,
                 "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["workload"]["options"]["grad_accum"] == 3
    assert "accumulate 3" in out["description"]
    from oomkit.prediction.models import StepOptions
    from oomkit.prediction.workload import workload_from_json

    known = {k: v for k, v in workload_from_json(out).options.items() if v is not None}
    assert StepOptions(**known).grad_accum == 3  # as explain rebuilds it


def test_torch_empty_cache_steps_is_recorded_and_saved(tmp_path, capsys):
    """torch_empty_cache_steps 2 (no longer refused): the step's options and the saved
    workload keep it, and the assumptions say where the cache is emptied (where the recording
    empties it: tests/prediction/models/test_trainer_loop.py)."""
    args_file = _args_file(tmp_path, per_device_train_batch_size=1, torch_empty_cache_steps=2)
    code = main(["predict", "--hf", TINY_LLAMA, "--trainer-args", args_file, "--seq", "16",
                 "--steps", "3", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["workload"]["options"]["trainer_empty_cache_steps"] == 2
    assert "optimizer steps 2 divides (0, 2, ...)" in (
        out["assumptions"]["trainer args torch_empty_cache_steps"]
    )
    from oomkit.prediction.models import StepOptions
    from oomkit.prediction.workload import workload_from_json

    known = {k: v for k, v in workload_from_json(out).options.items() if v is not None}
    assert StepOptions(**known).trainer_empty_cache_steps == 2  # as explain rebuilds it


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{nope", "is not valid JSON"),
        ('{"per_device_train_batch_size": "8"}', "must be a positive integer; got '8'"),
        ('{"optim": "lion_8bit"}', "optim='lion_8bit' is not modelled"),
        ('{"deepspeed": "ds.json"}', "changes memory in a way oomkit does not model"),
    ],
)
def test_bad_trainer_args_exit_2_with_the_reason(tmp_path, capsys, content, message):
    """A bad file exits 2 before anything is built, saying what is wrong."""
    path = tmp_path / "args.json"
    path.write_text(content)
    assert main(["predict", "gpt2-124m", "--trainer-args", str(path)]) == 2
    assert message in capsys.readouterr().err


def test_a_user_function_refuses_the_trainer_flags(tmp_path, capsys):
    """file.py:function runs its own loop: --grad-accum and --trainer-args are refused by name."""
    script = tmp_path / "train.py"
    script.write_text("def build(batch_size=1):\n    raise AssertionError('not called')\n")
    args_file = _args_file(tmp_path)
    code = main(["predict", f"{script}:build", "--grad-accum", "2", "--trainer-args", args_file])
    assert code == 2
    assert "--grad-accum and --trainer-args apply to presets and --hf only" in capsys.readouterr().err


def test_fit_searches_the_batch_under_trainer_args(tmp_path, capsys):
    """fit --trainer-args: the file's accumulation and clipping hold at every batch tried."""
    args_file = _args_file(tmp_path, gradient_accumulation_steps=2, max_grad_norm=0.5)
    code = main(["fit", "--hf", TINY_LLAMA, "--lora", "4", "--trainer-args", args_file,
                 "--seq", "16", "--gpu", "1GiB", "--max-batch", "2", "--steps", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0, out
    assert out["batch_size"] == 2
    assert "accumulate 2, clip 0.5" in json.dumps(out)


def test_a_config_dirs_quantization_config_applies_on_the_cli(offline, capsys):
    """--hf DIR with a bnb quantization_config: 4-bit, so training asks for --lora; with it, nf4."""
    quantized = str(CONFIGS / "tiny-llama-4bit")
    assert main(["predict", "--hf", quantized, *SMALL]) == 2
    assert "needs LoRA adapters: add --lora N" in capsys.readouterr().err
    assert main(["predict", "--hf", quantized, "--lora", "8", *SMALL, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "+ nf4 double-quant + LoRA r8" in out["description"]
    assert out["workload"]["options"]["quantize"] == "nf4"
    assert out["workload"]["options"]["compute_dtype"] == "bf16"


def test_mixed_precision_remedy_of_a_trainer_run_turns_on_the_trainers_bf16(
    tmp_path, capsys, monkeypatch
):
    """explain's mixed-precision remedy for an fp32 Trainer run re-predicts the Trainer with
    bf16 (accelerate's autocast and fp32 output copy included), not a plain bf16-mixed loop."""
    from oomkit.diagnose import _model_remedies

    args_file = _args_file(tmp_path, per_device_train_batch_size=2, max_length=16)
    code = main(["predict", "--hf", TINY_LLAMA, "--trainer-args", args_file, "--precision",
                 "fp32", "--steps", "1", "--gpu", "450MiB", "--json"])
    saved = json.loads(capsys.readouterr().out)
    assert code == 1 and saved["workload"]["options"]["trainer_mixed_precision"] == "no"
    seen = []
    real = _model_remedies._repredict

    def spy(data, workload, options):
        seen.append(options)
        return real(data, workload, options)

    monkeypatch.setattr(_model_remedies, "_repredict", spy)
    _model_remedies.measured_model_remedies(saved)
    mixed = [o for o in seen if o.precision != "fp32"]
    assert mixed and all(o.trainer_mixed_precision == o.precision.split("-")[0] for o in mixed)

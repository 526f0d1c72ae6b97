"""`oomkit predict PRESET --tp N [--fsdp M]`: rank 0 of a tensor-parallel Llama, and refusals."""

from __future__ import annotations

import json

import pytest

from oomkit.interfaces.cli import main

torch = pytest.importorskip("torch")


def _predict(argv, capsys):
    code = main(["predict", *argv, "--batch", "1", "--seq", "16", "--steps", "1", "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_tp_prediction_is_rank_0_with_the_plans_shards(tiny_llama, capsys):
    """--tp 2: rank 0 holds the plan's local fp32 parameters and the report names the layout."""
    import torch.distributed as dist

    code, data = _predict(["llama3-8b", "--tp", "2", "--precision", "fp32"], capsys)
    assert code == 0
    assert data["target"]["parallel"] == {"fsdp": 1, "tp": 2, "dp": 1, "pp": 1, "cp": 1}
    assert data["description"] == (
        "Tiny Llama, batch 1, seq 16, fp32, adamw, train, tensor parallel over 2 ranks "
        "(torchtitan's Llama plan: sequence parallel, loss parallel), rank 0 of 2"
    )
    # Linears and the embedding / 2, the five 64-wide RMSNorm weights whole: 53,568 fp32, each
    # 256-byte norm weight in a 512-byte block (the allocator's rounding).
    assert data["peak_allocated_at"]["by_category_bytes"]["parameter"] == 53_568 * 4 + 5 * 256
    assert any(w.startswith("tensor parallel: torchtitan's Llama plan over 2") for w in data["warnings"])
    assert not dist.is_initialized()


def test_fsdp_by_tp_halves_the_tp_shards(tiny_llama, capsys):
    """--fsdp 2 --tp 2: a world of 4; rank 0's parameters are the TP shards / 2 (even rows)."""
    code, data = _predict(["llama3-8b", "--fsdp", "2", "--tp", "2"], capsys)
    assert code == 0
    assert data["target"]["parallel"] == {"fsdp": 2, "tp": 2, "dp": 1, "pp": 1, "cp": 1}
    assert data["description"].endswith("FSDP2 over 2 ranks (3 units: per block + root), rank 0 of 4")
    # The five norm weights: 32 fp32 each (128 bytes) in 512-byte blocks.
    expected = 53_568 * 4 // 2 + 5 * (512 - 128)
    assert data["peak_allocated_at"]["by_category_bytes"]["parameter"] == expected


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tp", "2", "--hf", "gpt2"], "--hf models are not sharded by oomkit yet"),
        (["gpt2-124m", "--tp", "2"], "modelled for the Llama presets"),
        (["llama3-8b", "--tp", "3"], "--tp 3 must divide Llama 3.1 8B's"),
        (["llama3-8b", "--tp", "2", "--dp", "2"], "add --fsdp S"),
    ],
)
def test_tp_refusals_exit_2(argv, message, capsys):
    """What --tp does not model is refused with exit 2 and says what to do."""
    assert main(["predict", *argv, "--batch", "1", "--seq", "16"]) == 2
    assert message in capsys.readouterr().err


def test_tp_with_a_user_function_is_refused(tmp_path, capsys):
    """A file.py:function gets no TP plan from oomkit: exit 2, pointing at --fsdp."""
    path = tmp_path / "step.py"
    path.write_text("def build(mesh):\n    raise AssertionError('not called')\n")
    assert main(["predict", f"{path}:build", "--tp", "2"]) == 2
    assert "step is not parallelized by oomkit: use --fsdp N" in capsys.readouterr().err

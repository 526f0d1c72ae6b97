"""`oomkit predict PRESET --dp R --fsdp S [--tp N]`: HSDP (replicas of FSDP2 shard groups)."""

from __future__ import annotations

import json

import pytest
from _parallel_helpers import FSDP_STEP, MATRIX_NUMEL, write_step
from _recorded_once import tiny_llama_json

from oomkit.interfaces.cli import main

torch = pytest.importorskip("torch")

def _predict(argv):
    """``predict ARGV`` of the tiny Llama, batch 1, seq 16, 2 steps, recorded once per process
    (test_compile_parallel_cli.py and test_float8_cli.py read ``--fsdp 2`` too)."""
    return tiny_llama_json(["predict", *argv, "--batch", "1", "--seq", "16", "--steps", "2", "--json"])


def _parameter_bytes(data):
    return data["peak_allocated_at"]["by_category_bytes"]["parameter"]


def test_hsdp_rank_holds_one_shard_group_s_share(tiny_llama):
    """--dp 2 --fsdp 2: a world of 4, but rank 0 holds the fp32 parameters / 2 (the shard
    group), and with bf16-mixed (fp32 reduce, the parameters' dtype) the all-reduce across
    replicas is in place: the same peaks as FSDP2 over 2 ranks."""
    import torch.distributed as dist

    code, data = _predict(["llama3-8b", "--dp", "2", "--fsdp", "2"])
    assert code == 0
    assert data["target"]["parallel"] == {"fsdp": 2, "tp": 1, "dp": 2, "pp": 1, "cp": 1}
    assert data["description"].endswith(
        "HSDP: FSDP2 over 2 ranks x 2 replicas (3 units: per block + root), rank 0"
    )
    # The five 64-wide norm weights: 32 fp32 each (128 bytes), in 512-byte blocks.
    assert _parameter_bytes(data) == MATRIX_NUMEL * 4 // 2 + 5 * 512
    assert any("world size 4, 4 side stream(s)" in w for w in data["warnings"])
    assert not any("ranks differ" in w for w in data["warnings"])
    _, fsdp = _predict(["llama3-8b", "--fsdp", "2"])
    assert data["peak_allocated_bytes"] == fsdp["peak_allocated_bytes"]
    assert data["peak_reserved_bytes"] == fsdp["peak_reserved_bytes"]
    assert not dist.is_initialized()


def test_hsdp_by_tp_is_three_dimensional(tiny_llama):
    """--dp 2 --fsdp 2 --tp 2: TP shards, then HSDP on the (dp, fsdp) mesh; rank 0 of 8 holds
    the TP-local parameters / 2, as FSDP2 2 x TP 2 does."""
    code, data = _predict(["llama3-8b", "--dp", "2", "--fsdp", "2", "--tp", "2"])
    assert code == 0
    assert data["target"]["parallel"] == {"fsdp": 2, "tp": 2, "dp": 2, "pp": 1, "cp": 1}
    assert data["description"].endswith(
        "HSDP: FSDP2 over 2 ranks x 2 replicas (3 units: per block + root), rank 0 of 8"
    )
    # Matrices / tp / fsdp; norm weights replicated by TP, / 2 by FSDP2: 128 bytes in 512.
    assert _parameter_bytes(data) == MATRIX_NUMEL * 4 // 4 + 5 * 512
    _, two_d = _predict(["llama3-8b", "--fsdp", "2", "--tp", "2"])
    assert data["peak_allocated_bytes"] == two_d["peak_allocated_bytes"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["llama3-8b", "--dp", "2", "--tp", "2"], "add --fsdp S (HSDP x TP"),
        (["llama3-8b", "--dp", "2", "--fsdp", "2", "--bucket-cap-mb", "5"], "go with --dp N"),
    ],
)
def test_hsdp_refusals_exit_2(argv, message, capsys):
    """DDP with TP alone (torchtitan refuses it too) and DDP's bucket flags with --fsdp."""
    assert main(["predict", *argv, "--batch", "1", "--seq", "16"]) == 2
    assert message in capsys.readouterr().err


def test_user_function_gets_the_2d_mesh_for_hsdp(tmp_path, capsys):
    """--dp 2 --fsdp 2 with a file.py:function: its fully_shard on the (dp, fsdp) mesh is HSDP,
    so rank 0 of 4 holds half (not a quarter) of each fp32 weight."""
    path = write_step(tmp_path, "hsdp_step", FSDP_STEP)
    code = main(["predict", f"{path}:build", "--dp", "2", "--fsdp", "2", "--batch", "2", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert data["description"] == (
        f"{path}:build(batch_size=2), HSDP: FSDP2 over 2 ranks x 2 replicas, rank 0"
    )
    assert data["by_category_bytes"]["parameter"] == 2 * 32 * 64 * 4

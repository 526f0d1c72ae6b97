"""`oomkit predict PRESET --dp R --fsdp S [--tp N]`: HSDP (replicas of FSDP2 shard groups)."""

from __future__ import annotations

import json

import pytest

from oomkit.interfaces.cli import main

torch = pytest.importorskip("torch")

# Tiny Llama: hidden 64, 4 heads (2 KV heads of 16), FFN 128, vocabulary 256, 2 blocks, untied.
_HIDDEN, _KV, _FFN, _VOCAB, _LAYERS = 64, 32, 128, 256, 2
# Every weight but the five RMSNorm weights (2 per block + the final one), in elements.
_MATRIX_NUMEL = 2 * _VOCAB * _HIDDEN + _LAYERS * (
    2 * _HIDDEN * _HIDDEN + 2 * _KV * _HIDDEN + 3 * _HIDDEN * _FFN
)


@pytest.fixture
def tiny_llama(monkeypatch):
    """The FSDP and TP builders get a tiny Llama for any preset name."""
    from oomkit.prediction.models import parallel, tensor_parallel
    from oomkit.prediction.models.llama import LlamaShape
    from oomkit.prediction.models.presets import ModelPreset

    shape = LlamaShape(
        hidden=_HIDDEN, intermediate=_FFN, layers=_LAYERS, heads=4, kv_heads=2, vocab=_VOCAB,
        tied=False, positions=128,
    )
    preset = ModelPreset("llama3-8b", "Tiny Llama", shape, 16, "test", "bf16-mixed")
    monkeypatch.setattr(parallel, "shaped_preset", lambda name, options: preset)
    monkeypatch.setattr(tensor_parallel, "shaped_preset", lambda name, options: preset)


def _predict(argv, capsys):
    code = main(["predict", *argv, "--batch", "1", "--seq", "16", "--steps", "2", "--json"])
    return code, json.loads(capsys.readouterr().out)


def _parameter_bytes(data):
    return data["peak_allocated_at"]["by_category_bytes"]["parameter"]


def test_hsdp_rank_holds_one_shard_group_s_share(tiny_llama, capsys):
    """--dp 2 --fsdp 2: a world of 4, but rank 0 holds the fp32 parameters / 2 (the shard
    group), and with bf16-mixed (fp32 reduce, the parameters' dtype) the all-reduce across
    replicas is in place: the same peaks as FSDP2 over 2 ranks."""
    import torch.distributed as dist

    code, data = _predict(["llama3-8b", "--dp", "2", "--fsdp", "2"], capsys)
    assert code == 0
    assert data["target"]["parallel"] == {"fsdp": 2, "tp": 1, "dp": 2}
    assert data["description"].endswith(
        "HSDP: FSDP2 over 2 ranks x 2 replicas (3 units: per block + root), rank 0"
    )
    # The five 64-wide norm weights: 32 fp32 each (128 bytes), in 512-byte blocks.
    assert _parameter_bytes(data) == _MATRIX_NUMEL * 4 // 2 + 5 * 512
    assert any("world size 4, 4 side stream(s)" in w for w in data["warnings"])
    assert not any("ranks differ" in w for w in data["warnings"])
    _, fsdp = _predict(["llama3-8b", "--fsdp", "2"], capsys)
    assert data["peak_allocated_bytes"] == fsdp["peak_allocated_bytes"]
    assert data["peak_reserved_bytes"] == fsdp["peak_reserved_bytes"]
    assert not dist.is_initialized()


def test_hsdp_by_tp_is_three_dimensional(tiny_llama, capsys):
    """--dp 2 --fsdp 2 --tp 2: TP shards, then HSDP on the (dp, fsdp) mesh; rank 0 of 8 holds
    the TP-local parameters / 2, as FSDP2 2 x TP 2 does."""
    code, data = _predict(["llama3-8b", "--dp", "2", "--fsdp", "2", "--tp", "2"], capsys)
    assert code == 0
    assert data["target"]["parallel"] == {"fsdp": 2, "tp": 2, "dp": 2}
    assert data["description"].endswith(
        "HSDP: FSDP2 over 2 ranks x 2 replicas (3 units: per block + root), rank 0 of 8"
    )
    # Matrices / tp / fsdp; norm weights replicated by TP, / 2 by FSDP2: 128 bytes in 512.
    assert _parameter_bytes(data) == _MATRIX_NUMEL * 4 // 4 + 5 * 512
    _, two_d = _predict(["llama3-8b", "--fsdp", "2", "--tp", "2"], capsys)
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


_USER_FILE = """
import torch
from torch.distributed.fsdp import fully_shard


def build(mesh, world_size, batch_size=4):
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 64, bias=False)
    )
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters())
    batch = torch.randn(batch_size, 64)

    def step():
        model(batch).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    return step, (model, optimizer, batch)
"""


def test_user_function_gets_the_2d_mesh_for_hsdp(tmp_path, capsys):
    """--dp 2 --fsdp 2 with a file.py:function: its fully_shard on the (dp, fsdp) mesh is HSDP,
    so rank 0 of 4 holds half (not a quarter) of each fp32 weight."""
    path = tmp_path / "hsdp_step.py"
    path.write_text(_USER_FILE)
    code = main(["predict", f"{path}:build", "--dp", "2", "--fsdp", "2", "--batch", "2", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert data["description"] == (
        f"{path}:build(batch_size=2), HSDP: FSDP2 over 2 ranks x 2 replicas, rank 0"
    )
    assert data["by_category_bytes"]["parameter"] == 2 * 32 * 64 * 4

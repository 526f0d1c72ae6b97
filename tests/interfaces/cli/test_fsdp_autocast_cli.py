"""`oomkit predict file.py:function --fsdp N` with ``torch.autocast("cuda")`` inside the step."""

from __future__ import annotations

import json

import pytest
from _parallel_helpers import api_prediction, record_user_step, write_step

from oomkit.interfaces.cli import main

torch = pytest.importorskip("torch")

_USER_FILE = """
import torch
from torch.distributed.fsdp import fully_shard


def build(mesh, batch_size=8):
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256, bias=False), torch.nn.Linear(256, 64, bias=False)
    )
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters())
    batch = torch.randn(batch_size, 64)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(batch)
        out.float().sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    return step, (model, optimizer, batch)
"""


def test_cuda_autocast_in_a_sharded_user_step_records_bf16(tmp_path, capsys):
    """FSDP2's unsharded fp32 weights (fake tensors that report cpu) are cast by CUDA autocast:
    the matmuls allocate bf16 outputs, the bf16 weight copies are autocast's cache, and the CLI
    predicts what that recording gives, to the byte."""
    path = write_step(tmp_path, "autocast_step", _USER_FILE)
    assert main(["predict", f"{path}:build", "--fsdp", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    # At the peak (backward), the saved output of the second matmul: 8 x 64 bf16.
    assert data["peak_allocated_at"]["by_category_bytes"]["activation"] == 8 * 64 * 2

    recording = record_user_step(path, ranks=2)
    forward = [
        (e.size, dict(e.tags)["category"])
        for e in recording.step_events(1)
        if e.action == "alloc" and dict(e.tags).get("op") in ("aten.mm.default", "aten._to_copy.default")
    ][:5]
    # autocast casts the last argument first (GCC-built torch; measured on an H200).
    assert forward == [
        (256 * 64 * 2, "autocast_cache"),  # the first unsharded weight in bf16
        (8 * 64 * 2, "activation"),  # the input cast to bf16
        (8 * 256 * 2, "activation"),  # its bf16 matmul output
        (64 * 256 * 2, "autocast_cache"),
        (8 * 64 * 2, "activation"),
    ]
    prediction = api_prediction(data, recording)
    assert data["peak_allocated_bytes"] == prediction.peak_allocated_bytes
    assert data["peak_reserved_bytes"] == prediction.peak_reserved_bytes

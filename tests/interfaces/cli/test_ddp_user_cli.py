"""`oomkit predict file.py:function --dp N`: a step that wraps its model in DDP itself."""

from __future__ import annotations

import importlib.util
import json

import pytest

from oomkit.interfaces.cli import main

torch = pytest.importorskip("torch")

_USER_FILE = """
import torch
from torch.nn.parallel import DistributedDataParallel


def build(mesh, world_size, batch_size=4):
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 8))
    model = DistributedDataParallel(model, bucket_cap_mb=1)
    optimizer = torch.optim.AdamW(model.parameters())
    batch = torch.randn(batch_size, 64)
    assert world_size == mesh.size()

    def step():
        model(batch).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    return step, (model, optimizer, batch)


def unwrapped(batch_size=4):
    model = torch.nn.Linear(64, 8)
    return (lambda: model(torch.randn(batch_size, 64)).sum()), (model,)
"""


def test_user_ddp_is_recorded_with_its_buckets(tmp_path, capsys):
    """--dp 2 runs the function's own DDP: its buckets are recorded (the constructor under the
    recorder), and the CLI equals trace_distributed_step + predict_recording to the byte."""
    from oomkit.core.target import Target
    from oomkit.prediction.predictor import predict_recording
    from oomkit.prediction.tracing.distributed import trace_distributed_step

    path = tmp_path / "ddp_step.py"
    path.write_text(_USER_FILE)
    code = main(["predict", f"{path}:build", "--dp", "2", "--batch", "4", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert data["description"] == f"{path}:build(batch_size=4), DDP over 2 replicas, rank 0"
    assert data["target"]["parallel"] == {"fsdp": 1, "tp": 1, "dp": 2}
    # One fp32 bucket of every gradient (64x256 + 256 + 256x8 + 8 elements), in a 512-multiple.
    numel = 64 * 256 + 256 + 256 * 8 + 8
    assert data["by_category_bytes"]["ddp_bucket"] == -(-numel * 4 // 512) * 512
    assert any(w.startswith("DDP: every replica") for w in data["warnings"])

    spec = importlib.util.spec_from_file_location("ddp_step", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def build(mesh):
        with torch.device("cpu"):
            return module.build(mesh, mesh.size(), batch_size=4)

    recording = trace_distributed_step(build, world_size=2, mesh_shape=((2,), ("dp",)), steps=3)
    target = Target.resolve("h100", torch_version=data["target"]["torch_version"])
    prediction = predict_recording(recording, target=target)
    assert data["peak_allocated_bytes"] == prediction.peak_allocated_bytes
    assert data["peak_reserved_bytes"] == prediction.peak_reserved_bytes


@pytest.mark.parametrize(
    ("function", "extra", "message"),
    [
        ("unwrapped", [], "returned no DistributedDataParallel model"),
        ("build", ["--bucket-cap-mb", "5"], "pass bucket_cap_mb / gradient_as_bucket_view there"),
        ("build", ["--precision", "fp32"], "--precision"),
    ],
)
def test_user_ddp_refusals_exit_2(tmp_path, capsys, function, extra, message):
    """A function with no DDP model, or preset-only flags, exits 2 saying what to do."""
    path = tmp_path / "ddp_step.py"
    path.write_text(_USER_FILE)
    assert main(["predict", f"{path}:{function}", "--dp", "2", *extra]) == 2
    assert message in capsys.readouterr().err

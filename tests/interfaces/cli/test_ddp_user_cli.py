"""`oomkit predict file.py:function --dp N`: a step that wraps its model in DDP itself."""

from __future__ import annotations

import json

import pytest
from _parallel_helpers import DDP_STEP, api_prediction, record_user_step, write_step

from oomkit.interfaces.cli import main

torch = pytest.importorskip("torch")

def test_user_ddp_is_recorded_with_its_buckets(tmp_path, capsys):
    """--dp 2 runs the function's own DDP: its buckets are recorded (the constructor under the
    recorder), and the CLI equals trace_distributed_step + predict_recording to the byte."""
    path = write_step(tmp_path, "ddp_step", DDP_STEP)
    code = main(["predict", f"{path}:build", "--dp", "2", "--batch", "4", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert data["description"] == f"{path}:build(batch_size=4), DDP over 2 replicas, rank 0"
    assert data["target"]["parallel"] == {"fsdp": 1, "tp": 1, "dp": 2, "pp": 1, "cp": 1}
    # One fp32 bucket of every gradient (64x256 + 256 + 256x8 + 8 elements), in a 512-multiple.
    numel = 64 * 256 + 256 + 256 * 8 + 8
    assert data["by_category_bytes"]["ddp_bucket"] == -(-numel * 4 // 512) * 512
    assert any(w.startswith("DDP: every replica") for w in data["warnings"])

    recording = record_user_step(
        path, ranks=2, mesh_shape=((2,), ("dp",)), world_size=2, batch_size=4
    )
    prediction = api_prediction(data, recording)
    assert data["peak_allocated_bytes"] == prediction.peak_allocated_bytes
    assert data["peak_reserved_bytes"] == prediction.peak_reserved_bytes


@pytest.mark.parametrize(
    ("function", "extra", "message"),
    [
        ("plain", [], "returned no DistributedDataParallel model"),
        ("build", ["--bucket-cap-mb", "5"], "pass bucket_cap_mb / gradient_as_bucket_view there"),
        ("build", ["--precision", "fp32"], "--precision"),
    ],
)
def test_user_ddp_refusals_exit_2(tmp_path, capsys, function, extra, message):
    """A function with no DDP model, or preset-only flags, exits 2 saying what to do."""
    path = write_step(tmp_path, "ddp_step", DDP_STEP)
    assert main(["predict", f"{path}:{function}", "--dp", "2", *extra]) == 2
    assert message in capsys.readouterr().err

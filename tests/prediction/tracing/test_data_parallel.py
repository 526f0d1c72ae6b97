"""torch.nn.DataParallel in a script, on the one emulated GPU: its module runs once."""

from __future__ import annotations

import textwrap

from oomkit.core.target import Target
from oomkit.prediction.predictor import predict_recording
from oomkit.prediction.tracing.script_run import record_script

RTX4090 = Target.resolve("rtx4090")

SCRIPT = """
import sys
import torch

model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 10))
if sys.argv[1] == "dp":
    assert torch.cuda.get_device_properties(0).multi_processor_count == 128  # an RTX 4090's
    model = torch.nn.DataParallel(model)
model = model.to("cuda")
opt = torch.optim.Adam(model.parameters())
for step in range(4):
    x = torch.randn(64, 512)  # on the CPU: DataParallel's scatter copies it to the GPU
    loss = (model(x) if sys.argv[1] == "dp" else model(x.to("cuda"))).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_data_parallel_on_one_gpu_is_its_module(tmp_path):
    """DataParallel(model) on a machine of one GPU (its SM count read by its balance check)
    predicts the bytes of the model alone, its CPU input copied to the GPU by the scatter as
    `model(x.to("cuda"))` copies it (kept by autograd to the backward either way)."""
    (tmp_path / "train.py").write_text(textwrap.dedent(SCRIPT))

    def peaks(mode: str) -> tuple[tuple[int, int], ...]:
        run = record_script(tmp_path / "train.py", [mode], target=RTX4090, cwd=tmp_path)
        assert run.steps_recorded == 3
        p = predict_recording(run.recording, target=RTX4090)
        return tuple((s.peak_allocated_bytes, s.peak_reserved_bytes) for s in p.step_peaks)

    assert peaks("dp") == peaks("plain")

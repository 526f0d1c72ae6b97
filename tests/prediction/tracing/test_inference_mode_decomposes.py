"""Under ``torch.inference_mode()`` composite ops reach the tracer whole; CUDA runs their
decomposition, so the tracer does too (``_modes.OpDispatchMode``).

Found on an H200 (validation/fidelity-nvidia-h200-torch2.11.0.json): 8 bf16 linears under
inference_mode + autocast peaked 33 MiB above the prediction, the 32 MiB cuBLAS workspace that
``linear``'s ``addmm`` asks for and 1 MiB more; the recording never saw an ``addmm``.
"""

from __future__ import annotations

import torch

from oomkit.core.gpus import get_gpu
from oomkit.prediction.tracing import trace_step

N, BATCH = 1024, 16


def _linear_under(context):
    def step(model, x):
        with context():
            model(x).sum()

    with torch.device("meta"):
        model = torch.nn.Linear(N, N)
        x = torch.randn(BATCH, N)
    return trace_step(step, model, x, gpu=get_gpu("h100-sxm"))


def _ops(recording) -> list[tuple[str, int, str | None]]:
    return [
        (dict(e.tags).get("op", ""), e.size, dict(e.tags).get("emulated"))
        for e in recording.events[recording.step_starts[0]:]
        if e.action == "alloc"
    ]


def test_linear_under_inference_mode_runs_addmm_with_its_workspace():
    recorded = _ops(_linear_under(torch.inference_mode))
    # addmm's output, then the cuBLAS workspace (32 MiB on sm90, once per handle); then sum.
    assert recorded == [
        ("aten.addmm.default", BATCH * N * 4, None),
        ("aten.addmm.default", 32 * 2**20, "cublas_workspace"),
        ("aten.sum.default", 4, None),
    ]


def test_inference_mode_records_what_no_grad_records():
    assert _ops(_linear_under(torch.inference_mode)) == _ops(_linear_under(torch.no_grad))

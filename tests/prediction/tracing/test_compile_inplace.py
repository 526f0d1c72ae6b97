"""Inductor's in-place reuse in a compiled graph: the dying input's memory passes to the output."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from oomkit.core.gpus import get_gpu
from oomkit.prediction.tracing import trace_step
from oomkit.prediction.tracing.emulations.cublas import cublas_workspace_bytes


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(256, 1024)
        self.down = torch.nn.Linear(1024, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # gelu's kernel reads up's output, which dies there: it writes in place (same size).
        return self.down(F.gelu(self.up(x), approximate="tanh"))


def _peak_above_parameters(layers: int) -> int:
    with torch.device("meta"):
        model = torch.nn.Sequential(*(_Block() for _ in range(layers))).eval()
        x = torch.zeros(512, 256)
    compiled = torch.compile(model)

    def step(model: torch.nn.Module, x: torch.Tensor) -> None:
        with torch.no_grad():
            compiled(x)

    recording = trace_step(step, model, x, steps=1, compile=True)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    live = peak = 0
    sizes: dict[int, int] = {}
    for e in recording.events:
        if e.action == "alloc":
            sizes[e.address] = e.size
            live += e.size
            peak = max(peak, live)
        elif e.action == "free_requested":
            live -= sizes.pop(e.address)
    return peak - params


def test_compiled_inference_does_not_hold_in_place_donors_to_the_end():
    """Peak above the weights is the same for 1 and 4 blocks: each up-projection buffer is reused.

    Before the fix every block's ``addmm`` buffer stayed allocated until the graph returned
    and gelu got a buffer of its own (2 MiB more per block here).
    """
    one = _peak_above_parameters(1)
    assert _peak_above_parameters(4) == one
    # The input, one up-projection (512 x 1024 fp32, gelu written into it), one
    # down-projection output (512 x 256 fp32), and cuBLAS' workspace of the default H100.
    workspace = cublas_workspace_bytes(get_gpu("h100-sxm"), {})
    assert one == 512 * 256 * 4 + 512 * 1024 * 4 + 512 * 256 * 4 + workspace

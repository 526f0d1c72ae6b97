"""Linear layers under autocast, request by request against an H200 (torch 2.11).

``validation/fidelity-nvidia-h200-torch2.11.0.json`` holds, for eight fp32 ``Linear(4096,
4096)`` under bf16 autocast (``scripts/validate_fidelity_on_gpu.py``), every request the caching
allocator saw. For a target that runs torch 2.11 (``Target.torch_version``), oomkit gives the
same sequence up to the final ``sum``: autocast casts bias, weight, then input (GCC evaluates the
wrapper's casts right to left) and frees uncached casts input first; each ``addmm`` allocates its
output before the workspaces; the first takes the 32 MiB cuBLAS workspace, then (torch 2.9-2.11)
a separate 1 MiB cuBLASLt one. The ``sum``'s multi-block reduction then asks for a staging
buffer and semaphores (Reduce.cuh), which oomkit does not emulate: a few hundred bytes, freed at
once.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from oomkit.core.target import Target
from oomkit.prediction import predict
from oomkit.prediction.tracing import trace_step
from oomkit.prediction.tracing._torch_version import torch_minor

FIDELITY = (Path(__file__).resolve().parents[3] / "validation"
            / "fidelity-nvidia-h200-torch2.11.0.json")
_PROBES = {p["probe"]: p for p in json.loads(FIDELITY.read_text())["probes"]}
_CONTEXTS = {"no-grad-autocast": torch.no_grad, "inference-mode-autocast": torch.inference_mode}
H200_TORCH_2_11 = Target.resolve("h200", torch_version="2.11")


def _probe(context):
    """scripts/validate_fidelity_on_gpu.py ``_linears`` and its step, on meta."""
    with torch.device("meta"):
        model = torch.nn.Sequential(*(torch.nn.Linear(4096, 4096) for _ in range(8)))
        x = torch.randn(64, 4096)

    def step(model, x):
        with context(), torch.autocast("cuda", dtype=torch.bfloat16):
            return model(x).sum()

    return step, model, x


def _recorded(context) -> list[list]:
    recording = trace_step(*_probe(context), target=H200_TORCH_2_11)
    return [[e.action, e.size] for e in recording.events[recording.step_starts[0]:]
            if e.action in ("alloc", "free_completed")]


@pytest.mark.parametrize("probe", sorted(_CONTEXTS))
def test_requests_up_to_the_sum_match_the_h200(probe):
    measured = _PROBES[probe]["measured_events"]
    until_sum = measured.index(["alloc", 4])  # the sum's fp32 output
    assert _recorded(_CONTEXTS[probe])[:until_sum + 1] == measured[:until_sum + 1]


def test_a_target_without_a_torch_version_follows_this_install():
    """This install's torch (2.12 or newer: unified) records no separate 1 MiB Lt workspace."""
    if torch_minor(torch.__version__) < (2, 12):
        pytest.skip("this install's torch is older than 2.12")
    recording = trace_step(*_probe(torch.no_grad), target=Target.resolve("h200"))
    workspaces = [e.size for e in recording.events
                  if e.action == "alloc" and dict(e.tags)["category"] == "workspace"]
    assert workspaces == [32 * 2**20]


@pytest.mark.parametrize("probe", sorted(_CONTEXTS))
def test_peak_allocated_is_the_h200s(probe):
    # As the script compares: torch.cuda.max_memory_allocated() against a prediction.
    prediction = predict(*_probe(_CONTEXTS[probe]), steps=1, target=H200_TORCH_2_11)
    assert prediction.peak_allocated_bytes == _PROBES[probe]["measured_peak_allocated_bytes"]

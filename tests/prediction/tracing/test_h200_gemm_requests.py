"""Linear layers under autocast, request by request against an H200 (torch 2.11).

``validation/fidelity-nvidia-h200-torch2.11.0.json`` holds, for eight fp32 ``Linear(4096,
4096)`` under bf16 autocast (``scripts/validate_fidelity_on_gpu.py``), every request the caching
allocator saw. For a target that runs torch 2.11 (``Target.torch_version``), oomkit gives the
same sequence to the end: autocast casts bias, weight, then input (GCC evaluates the wrapper's
casts right to left) and frees uncached casts input first; each ``addmm`` allocates its output
before the workspaces; the first takes the 32 MiB cuBLAS workspace, then (torch 2.9-2.11) a
separate 1 MiB cuBLASLt one; the final ``sum`` of 262,144 floats splits across thread blocks
and asks for 128 bytes of staging and a 4-byte semaphore after its output (Reduce.cuh,
``emulations/reductions.py``). Under ``no_grad`` the autocast cache's weight casts are freed
when the region exits, in a hash map's order: those frees are compared as a set.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _request_sequences import frees_as_sets

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


def _signed(events: list[list]) -> list[int]:
    return [size if action == "alloc" else -size for action, size in events]


@pytest.mark.parametrize("probe", sorted(_CONTEXTS))
def test_the_requests_match_the_h200_to_the_end(probe):
    measured = _PROBES[probe]["measured_events"]
    recorded = _recorded(_CONTEXTS[probe])
    assert frees_as_sets(_signed(recorded)) == frees_as_sets(_signed(measured))
    # the sum's output, then its staging and semaphore, freed at once
    after_sum = measured.index(["alloc", 4])
    assert recorded[after_sum:after_sum + 5] == [
        ["alloc", 4], ["alloc", 128], ["alloc", 4], ["free_completed", 4], ["free_completed", 128]
    ]
    if probe == "inference-mode-autocast":  # no autocast cache: every free in the GPU's order
        assert recorded == measured


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

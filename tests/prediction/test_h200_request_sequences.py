"""The recording of a whole run against the H200's own request sequence, event for event.

``validation/h200-torch2.11.0-requests.json.gz`` holds, for each run of
``validation/h200-torch2.11.0.json``, the sizes the caching allocator was asked for and the
completed frees, in order (``torch.cuda.memory._snapshot()``'s device trace, written by
``scripts/validate_on_gpu.py --snapshot-dir``): the model built on the GPU, then 3 steps. oomkit
records the same program on meta as the GPU's torch 2.11 and cuDNN ran it, and the two sequences
agree from the first request on: for GPT-2 inference and Llama 1B bf16 training to the GPU's last
event (14,183 for Llama), for GPT-2 and BERT training until the first bias gradient's reduction,
whose multi-block kernel asks for a staging buffer and semaphores (Reduce.cuh
``ReduceConfig::global_memory_size``) that oomkit does not emulate. A change that makes the
recording differ earlier fails here, and says where.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNS = json.loads((ROOT / "validation" / "h200-torch2.11.0.json").read_text())
REQUESTS = json.loads(
    gzip.decompress((ROOT / "validation" / "h200-torch2.11.0-requests.json.gz").read_bytes())
)
# run -> (the index of the first request that differs, or None where the GPU's whole sequence
# is matched; the GPU's request there)
FIRST_DIFFERENCE = {
    "gpt2-124m-b4-seq512-fp32-adamw-inference": (None, None),
    "llama-1b-b1-seq512-bf16-mixed-adamw-train": (None, None),
    # c_proj's bias gradient [2048, 768] summed over tokens: a 12 MiB staging buffer, 24 bytes
    # of semaphores.
    "gpt2-124m-b4-seq512-fp32-adamw-train": (470, [12_582_912, 24, -24, -12_582_912]),
    # The MLM head's bias gradient: 6 MiB of staging, 24 bytes of semaphores.
    "bert-base-b8-seq128-fp32-adamw-train": (562, [6_291_456, 24, -24, -6_291_456]),
}


def _recorded(label: str, validation_script) -> list[int]:
    from oomkit.core.target import Target
    from oomkit.prediction.models import StepOptions, build_preset_step
    from oomkit.prediction.tracing import trace_step

    run = next(r for r in validation_script.RUNS if r.label == label)
    record = next(r for r in RUNS["runs"] if r["run"] == label)
    target = Target.resolve(
        "h200", torch_version=RUNS["torch_version"], cudnn_version=record["cudnn_version"]
    )

    def whole_run() -> None:  # what validate_on_gpu.py _measure ran
        built = build_preset_step(run.preset, StepOptions(**run.options()), device="cuda")
        for _ in range(RUNS["steps"]):
            built.step_fn()

    recording = trace_step(whole_run, target=target)
    return [e.size if e.action == "alloc" else -e.size for e in recording.events
            if e.action in ("alloc", "free_completed")]


@pytest.mark.parametrize("label", sorted(FIRST_DIFFERENCE))
def test_the_recording_is_the_gpus_request_sequence(label, validation_script):
    measured = REQUESTS["runs"][label]
    recorded = _recorded(label, validation_script)
    pairs = enumerate(zip(recorded, measured, strict=False))  # the recording runs on past the end
    first = next((i for i, (a, b) in pairs if a != b), None)
    expected_index, gpu_requests = FIRST_DIFFERENCE[label]
    assert first == expected_index, (first, measured[first:first + 6], recorded[first:first + 6])
    if first is None:
        # The recording goes on where the GPU's trace stopped (the model freed afterwards).
        assert len(recorded) >= len(measured)
    else:
        assert measured[first:first + len(gpu_requests)] == gpu_requests

"""The recording of a whole run against the H200's own request sequence, event for event.

``validation/h200-torch2.11.0-requests.json.gz`` holds, for each run of
``validation/h200-torch2.11.0.json``, the sizes the caching allocator was asked for and the
completed frees, in order (``torch.cuda.memory._snapshot()``'s device trace, written by
``scripts/validate_on_gpu.py --snapshot-dir``): the model built on the GPU, then 3 steps. oomkit
records the same program on meta as the GPU's torch 2.11 and cuDNN ran it. Frees that follow
one another with no request between them are compared as a set: their order changes nothing the
allocator decides next (freed blocks merge the same way in any order), and some of it is a hash
map's (autocast's cache, cleared when a region exits). So compared, the sequences agree from the
first request on: for GPT-2 inference, GPT-2 355M and Llama 1B bf16 training (with and without
checkpointing) to the end of the GPU's trace (up to the frees it ends in, cut off mid-way when
the snapshot was taken); for GPT-2 (fp32 and bf16) and BERT training too, whose bias
gradients' multi-block reductions ask for a staging buffer and semaphores (Reduce.cuh
``ReduceConfig::global_memory_size``, ``emulations/reductions.py``); and Llama 1B fp32, whose
grouped-query attention runs SDPA's math path (its mask added in place, ``_safe_softmax``'s
and the softmax backward's temporaries). Every run, then; and ViT too, with its cuDNN
convolution workspace set aside (``SET_ASIDE``). A change that makes the recording differ
anywhere fails here, and says where.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from _request_sequences import frees_as_sets

ROOT = Path(__file__).resolve().parents[2]
RUNS = json.loads((ROOT / "validation" / "h200-torch2.11.0.json").read_text())
REQUESTS = json.loads(
    gzip.decompress((ROOT / "validation" / "h200-torch2.11.0-requests.json.gz").read_bytes())
)
# run -> (the index of the first request that differs, or None where the GPU's whole sequence
# is matched; the GPU's request there)
FIRST_DIFFERENCE = {
    "gpt2-124m-b4-seq512-fp32-adamw-inference": (None, None),
    # The bias gradients' multi-block reductions (staging and semaphores, emulations/
    # reductions.py) and BERT's expanded token-type ids copied in the embedding backward are
    # what these three needed to match to the end.
    "gpt2-124m-b4-seq512-fp32-adamw-train": (None, None),
    "gpt2-124m-b4-seq512-bf16-mixed-adamw-train": (None, None),
    "bert-base-b8-seq128-fp32-adamw-train": (None, None),
    "gpt2-355m-b2-seq256-bf16-mixed-adamw-train": (None, None),
    "llama-1b-b1-seq512-bf16-mixed-adamw-train": (None, None),
    "llama-1b-b1-seq512-bf16-mixed-adamw-train-ckpt": (None, None),
    # fp32 grouped-query attention runs SDPA's math path: its mask added in place, the
    # temporaries of _safe_softmax (2 MiB, 8 KiB, 4 bytes here) and of the softmax backward's
    # grad * output (inplace_adds.py, softmax.py).
    "llama-1b-b1-seq256-fp32-adamw-train": (None, None),
}


def _without_trailing_frees(sequence: list[int]) -> list[int]:
    """The GPU's trace up to the run of frees it ends in (the snapshot cuts it off mid-way)."""
    end = len(sequence)
    while end and sequence[end - 1] < 0:
        end -= 1
    return sequence[:end]


def _recorded(label: str, validation_script) -> list[int]:
    from oomkit.core.target import Target
    from oomkit.prediction.tracing import trace_step

    run = next(r for r in validation_script.RUNS if r.label == label)
    record = next(r for r in RUNS["runs"] if r["run"] == label)
    target = Target.resolve(
        "h200", torch_version=RUNS["torch_version"], cudnn_version=record["cudnn_version"]
    )

    program = validation_script.measured_program(run, RUNS["steps"])
    recording = trace_step(program, target=target)
    return [e.size if e.action == "alloc" else -e.size for e in recording.events
            if e.action in ("alloc", "free_completed")]


@pytest.mark.parametrize("label", sorted(FIRST_DIFFERENCE))
def test_the_recording_is_the_gpus_request_sequence(label, validation_script):
    measured = frees_as_sets(_without_trailing_frees(REQUESTS["runs"][label]))
    recorded = frees_as_sets(_recorded(label, validation_script))
    pairs = enumerate(zip(recorded, measured, strict=False))  # the recording runs on past the end
    first = next((i for i, (a, b) in pairs if a != b), None)
    expected_index, gpu_requests = FIRST_DIFFERENCE[label]
    assert first == expected_index, (first, measured[first:first + 6], recorded[first:first + 6])
    if first is None:
        assert len(recorded) >= len(measured)  # the recording goes on where the trace stopped
    else:
        assert measured[first:first + len(gpu_requests)] == gpu_requests


# Runs with a request oomkit does not model, set aside on the GPU's side (with its frees):
# run -> (the sizes set aside, the index of the first request that differs, the GPU's there).
SET_ASIDE = {
    # The patch embedding's cuDNN convolution workspace (forward, 3 steps x 2 calls), sized by
    # cuDNN's heuristics at run time. The rest is the GPU's sequence to the end: nn.
    # MultiheadAttention's projections adding their bias in place (inplace_adds.py), ln_1's
    # transposed gradient copied contiguous in its backward (layer_norm.py), the patch
    # convolution's backward copying its channels-last gradient and summing its bias gradient
    # with staging (cudnn_workspace.py, reductions.py).
    "vit-b16-b8-img224-bf16-mixed-adamw-train": ({11_976_720}, None, None),
}


@pytest.mark.parametrize("label", sorted(SET_ASIDE))
def test_the_recording_is_the_gpus_request_sequence_but_for_what_is_set_aside(
    label, validation_script
):
    aside, expected_index, gpu_requests = SET_ASIDE[label]
    measured = [s for s in _without_trailing_frees(REQUESTS["runs"][label]) if abs(s) not in aside]
    measured = frees_as_sets(measured)
    recorded = frees_as_sets(_recorded(label, validation_script))
    first = next((i for i, (a, b) in enumerate(zip(recorded, measured, strict=False)) if a != b), None)
    assert first == expected_index, (first, measured[first:first + 6], recorded[first:first + 6])
    if first is None:
        assert len(recorded) >= len(measured)
    else:
        assert measured[first:first + len(gpu_requests)] == gpu_requests

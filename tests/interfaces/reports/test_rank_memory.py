"""The per-rank view of an FSDP2 prediction: memory by kind and by CUDA stream, in exact bytes."""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import pathlib

import pytest
from rich.console import Console

from oomkit.core.target import ParallelLayout, Target
from oomkit.interfaces.reports.prediction import (
    prediction_to_json,
    rank_memory,
    render_prediction,
)
from oomkit.prediction.predictor import predict_recording

_FSDP_TESTS = pathlib.Path(__file__).parents[2] / "prediction/tracing/test_distributed_fsdp.py"


@pytest.fixture(scope="module")
def sharded():
    """Two steps of the two-unit model of test_distributed_fsdp over 2 fake ranks, on an H100."""
    from oomkit.prediction.tracing.distributed import trace_distributed_step

    spec = importlib.util.spec_from_file_location("fsdp_model", _FSDP_TESTS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    target = dataclasses.replace(Target.resolve(gpu="h100"), parallel=ParallelLayout(fsdp=2))
    recording = trace_distributed_step(module._build, world_size=2, steps=2, target=target)
    return predict_recording(recording, target=target)


def test_json_per_rank_groups_and_streams(sharded):
    """At the peak (step 2, unit 1's backward) rank 0 holds 4 parameter shards and 8 AdamW
    states of one 512-byte block each, unit 1's unsharded weight and bias on stream 0 and
    unit 0's prefetched all-gather output on FSDP2's copy-in stream 1."""
    memory = prediction_to_json(sharded)["per_rank"]
    block = 512  # every shard here is under 512 bytes: one smallest block each
    assert memory == {
        "rank": 0,
        "world_size": 2,
        "fsdp": 2,
        "tp": 1,
        "dp": 1,
        "allocated_bytes": 67_120_640,
        "reserved_bytes": 73_400_320,
        "by_group_bytes": {
            "states": (4 + 8) * block,
            "collective_buffers": 3 * block,
            "activations": 4096,  # temporary 2560 + activation 1024 + input 512
            "other": 64 * 2**20,  # cuBLAS workspace (64 MiB on Hopper)
        },
        "by_stream": [
            {
                "stream": 0,
                "allocated_bytes": 67_120_640 - block,
                "by_category_bytes": {
                    "workspace": 64 * 2**20,
                    "optimizer_state": 8 * block,
                    "temporary": 5 * block,
                    "parameter": 4 * block,
                    "activation": 2 * block,
                    "allgather_buffer": 2 * block,
                    "input": block,
                },
            },
            {
                "stream": 1,
                "allocated_bytes": block,
                "by_category_bytes": {"allgather_buffer": block},
            },
        ],
    }
    assert sum(memory["by_group_bytes"].values()) == memory["allocated_bytes"]
    at = prediction_to_json(sharded)["peak_allocated_at"]
    assert at["by_stream_category_bytes"]["1"] == {"allgather_buffer": block}


def test_text_report_shows_the_rank_tables(sharded):
    """The terminal report prints rank 0's memory by kind and by stream."""
    out = io.StringIO()
    render_prediction(sharded, Console(file=out, width=160, color_system=None))
    text = out.getvalue()
    assert "Rank 0 of 2 at peak allocated, by kind" in text
    assert "unsharded all-gather / reduce-scatter buffers" in text
    assert "Rank 0 at peak allocated, by CUDA stream" in text
    assert "0 (default)" in text


def test_one_gpu_prediction_has_no_per_rank_view(sharded):
    """Without a parallel layout there is no per-rank object."""
    single = dataclasses.replace(sharded, target=dataclasses.replace(sharded.target, parallel=None))
    assert rank_memory(single) is None
    assert "per_rank" not in prediction_to_json(single)

"""The GPU's timeline of collectives on a 2-block FSDP2 model, known to the byte."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oomkit.core.gpus.nccl import COMMUNICATOR_FIXED_BYTES, PROCESS_FIXED_BYTES
from oomkit.core.target import ParallelLayout, Target
from oomkit.prediction.predictor import Prediction, predict_recording
from oomkit.prediction.tracing.distributed import trace_distributed_step
from oomkit.prediction.tracing.recording import TraceRecording
from oomkit.prediction.tracing.stream_timeline import records_nccl_stream
from oomkit.units import format_bytes

torch = pytest.importorskip("torch")

MIB = 1 << 20
D = 4096  # each block: Linear(D, D) in fp32
B = 4  # batch rows
W = D * D * 4  # an unsharded block weight (and its all-gather output), 64 MiB
S = W // 2  # a rank's shard (world size 2), 32 MiB
X = B * D * 4  # an activation / the input, 64 KiB
SCALAR = 512  # the loss and its ones_like (4 bytes each), rounded to kMinBlockSize


def _build(blocks: int, dim: int, prefetch: bool) -> Any:
    def build(mesh: Any) -> tuple[Any, ...]:
        from torch import nn
        from torch.distributed.fsdp import fully_shard

        model = nn.Sequential(*(nn.Linear(dim, dim, bias=False) for _ in range(blocks)))
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if prefetch:
            for block, after in zip(model, list(model)[1:], strict=False):
                block.set_modules_to_forward_prefetch([after])  # type: ignore[operator]
        x = torch.randn(B, dim)

        def step() -> None:
            model(x).sum().backward()

        return step, (model, x)

    return build


def _record(torch_version: str, blocks: int = 2, dim: int = D) -> tuple[TraceRecording, Target]:
    target = dataclasses.replace(
        Target.resolve("h100", torch_version=torch_version), parallel=ParallelLayout(fsdp=2)
    )
    build = _build(blocks, dim, prefetch=True)
    # No CUDA emulations: no cuBLAS workspace, only FSDP2's buffers and the step's tensors.
    recording = trace_distributed_step(build, world_size=2, target=target, emulations={})
    return recording, target


@pytest.fixture(scope="module")
def new_torch() -> tuple[TraceRecording, Prediction]:
    recording, target = _record("2.13")
    return recording, predict_recording(recording, target=target)


@pytest.fixture(scope="module")
def old_torch() -> tuple[TraceRecording, Prediction]:
    recording, target = _record("2.5")
    return recording, predict_recording(recording, target=target)


def test_lower_end_peaks_to_the_byte(new_torch: tuple[TraceRecording, Prediction]) -> None:
    """Peak allocated while block 0's weight gradient is made in backward; reserved by stream."""
    recording, prediction = new_torch
    # Backward of block 0: the shards (2S), block 1's sharded gradient (S: the reduce-scatter
    # output on the RS stream), block 1's reduce-scatter input (W, held until the next group's
    # post_backward), block 0's unsharded weight (W) and its weight gradient (W), the input and
    # the grad of block 0's output (2X), the loss and its ones_like.
    assert prediction.peak_allocated_bytes == 3 * S + 3 * W + 2 * X + 2 * SCALAR
    assert recording.peak_allocated_bytes() == 3 * S + 3 * W + 2 * X + 2 * 4  # unrounded
    # Segments: the two shards; one small segment (input, activations); on the all-gather
    # copy-in stream two all-gather outputs (block 0's kept as all_gather_state while block 1's,
    # prefetched in block 0's forward, is in flight); on the default stream three W blocks (an
    # unsharded weight, a weight gradient, the reduce-scatter input kept for the next group);
    # on the reduce-scatter stream the two sharded gradients.
    assert prediction.peak_reserved_bytes == 2 * S + 2 * MIB + 2 * W + 3 * W + 2 * S


def test_forward_prefetch_holds_three_unsharded_blocks(
    new_torch: tuple[TraceRecording, Prediction],
) -> None:
    """In block 0's forward: its all-gather output, its unsharded weight and block 1's prefetch."""
    recording, _ = new_torch
    live = peak = 0
    for event in recording.events:
        if event.tag("phase") == "backward":
            break
        if event.action == "alloc":
            live += event.size
            peak = max(peak, live)
        elif event.action == "free_requested":
            live -= event.size
    assert peak == 2 * S + X + 3 * W + X
    streams = [e.stream for e in recording.events if e.action == "alloc" and e.size == W][:3]
    assert streams == [1, 0, 1]  # copy-in stream, default stream (copy-out), copy-in stream


def test_new_torch_range_is_one_figure(new_torch: tuple[TraceRecording, Prediction]) -> None:
    """torch 2.8+: no record_stream, so both ends of the range are the recorded figure."""
    recording, prediction = new_torch
    assert recording.collective_ids is None
    assert prediction.distributed is not None
    low = prediction.peak_reserved_bytes
    assert prediction.distributed.reserved_range_bytes == (low, low)
    assert "range is one figure" in (recording.timing_note or "")


def test_old_torch_upper_end_to_the_byte(old_torch: tuple[TraceRecording, Prediction]) -> None:
    """torch 2.5: collectives' blocks come back at the step's end at the upper end."""
    recording, prediction = old_torch
    distributed = prediction.distributed
    assert distributed is not None
    lower_reserved = 2 * S + 2 * MIB + 5 * W + 2 * S
    assert prediction.peak_reserved_bytes == lower_reserved  # the verdict's: the lower end
    # Upper end: the four all-gather outputs (two per block, forward and backward) stay until
    # the step ends, so the backward's two cannot reuse the forward's segments (+2W); at block
    # 0's reduce-scatter: 4 all-gather outputs, both reduce-scatter inputs, block 0's weight
    # gradient (7W), the shards and both sharded gradients (4S).
    assert distributed.reserved_range_bytes == (lower_reserved, lower_reserved + 2 * W)
    assert distributed.allocated_range_bytes == (
        3 * S + 3 * W + 2 * X + 2 * SCALAR,
        4 * S + 7 * W + X + 2 * SCALAR,
    )
    assert "record_stream" in (distributed.timing_note or "")


def test_an_upper_end_above_the_usable_bytes_says_the_allocator_synchronizes(
    old_torch: tuple[TraceRecording, Prediction],
) -> None:
    """The range's record carries the prediction's usable bytes; an upper end above them is
    said to stop there (malloc's release_cached_blocks synchronizes the waiting blocks'
    events), one at or below them is not."""
    _, prediction = old_torch
    distributed = prediction.distributed
    assert distributed is not None and distributed.reserved_range_bytes is not None
    assert distributed.usable_bytes == prediction.usable_bytes
    low, high = distributed.reserved_range_bytes
    assert high == low + 2 * W

    def cap_lines(usable: int) -> list[str]:
        lines = dataclasses.replace(distributed, usable_bytes=usable).lines()
        return [line for line in lines if "synchronize_and_free_events" in line]

    assert cap_lines(high) == []
    (said,) = cap_lines(high - 1)
    assert said.startswith(f"the upper end is above the {format_bytes(high - 1)} this GPU")
    assert "reserved stays within it" in said


def test_nccl_lines_come_off_the_usable_bytes(new_torch: tuple[TraceRecording, Prediction]) -> None:
    """FSDP 2 on an H100: NCCL's fixed costs (one process, one communicator), 384 MiB of ring
    buffers and 64 MiB of NVLS, each a line with a source."""
    _, prediction = new_torch
    distributed = prediction.distributed
    assert distributed is not None
    fixed = PROCESS_FIXED_BYTES + COMMUNICATOR_FIXED_BYTES
    assert distributed.nccl_bytes == fixed + 384 * MIB + 16 * 2 * MIB * 2
    assert prediction.usable_bytes == prediction.gpu.usable_bytes() - distributed.nccl_bytes
    assert [what for what, _, _ in distributed.outside_lines][0] == "CUDA context"
    assert len(distributed.outside_lines) == 5
    assert "NCCL fsdp communicator" in str(prediction)


def test_avoid_record_streams_makes_old_torch_timing_free() -> None:
    """TORCH_NCCL_AVOID_RECORD_STREAMS=1 on torch 2.5: no record_stream, one figure."""
    assert records_nccl_stream("2.5", None)
    assert not records_nccl_stream("2.5", True)
    assert not records_nccl_stream("2.8", None)
    assert not records_nccl_stream(None, None)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(blocks=st.integers(min_value=1, max_value=3), dim=st.sampled_from([512, 1536, 2048, 3072]))
def test_upper_end_at_least_lower_end_at_least_at_once(blocks: int, dim: int) -> None:
    """For random block counts and sizes: upper >= lower >= the at-once figure (reserved)."""
    recording, target = _record("2.5", blocks, dim)
    prediction = predict_recording(recording, target=target)
    at_once = predict_recording(
        dataclasses.replace(recording, collective_ids=None, timing_note=None), target=target
    )
    assert prediction.distributed is not None
    low, high = prediction.distributed.reserved_range_bytes or (0, 0)
    assert high >= low >= at_once.peak_reserved_bytes


def _tp_build(dim: int, rows: int) -> Any:
    def build(mesh: Any) -> tuple[Any, ...]:
        from torch import nn
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        model = nn.Sequential(nn.Linear(dim, 4 * dim, bias=False), nn.Linear(4 * dim, dim, bias=False))
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
        x = torch.randn(rows, dim)

        def step() -> None:
            model(x).sum().backward()

        return step, (model, x)

    return build


@pytest.mark.parametrize("torch_version", ["2.13", "2.5"])
def test_tensor_parallel_all_reduce_waits_on_old_torch(torch_version: str) -> None:
    """TP 2, torch 2.5: the row-wise all-reduce's output (it reduces a clone of the partial sum,
    Functional.cpp all_reduce) waits on NCCL's stream, so the upper end holds it (32 KiB) to
    the step's end; torch 2.13: one figure."""
    dim, rows = 1024, 8
    target = dataclasses.replace(
        Target.resolve("h100", torch_version=torch_version), parallel=ParallelLayout(tp=2)
    )
    recording = trace_distributed_step(
        _tp_build(dim, rows), world_size=2, target=target, emulations={},
        mesh_shape=((2,), ("tp",)),
    )
    prediction = predict_recording(recording, target=target)
    shard = dim * 4 * dim * 4 // 2  # each weight's TP shard, 8 MiB
    x = rows * dim * 4  # the input, the partial sum and the all-reduced output: 32 KiB each
    hidden_grad = rows * (4 * dim // 2) * 4  # the column-sharded hidden's gradient, 64 KiB
    # Peak at the second weight gradient: two weights, two weight gradients, the input, the
    # hidden's gradient, the loss and its ones_like.
    lower = 4 * shard + x + hidden_grad + 2 * SCALAR
    assert prediction.distributed is not None
    if torch_version == "2.13":
        assert recording.collective_ids is None
        assert prediction.distributed.allocated_range_bytes == (lower, lower)
        return
    reduced = [e for e in recording.events if e.tag("op") == "_c10d_functional.all_reduce.default"]
    assert len(reduced) == 1
    assert recording.collective_ids == {reduced[0].address}
    assert prediction.distributed.allocated_range_bytes == (lower, lower + x)

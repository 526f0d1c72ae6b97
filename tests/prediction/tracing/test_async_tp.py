"""Async TP under torch.compile: Inductor's micro-pipeline pass run, its fused ops' CUDA memory."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oomkit.core.target import Target
from oomkit.prediction.predictor import predict_recording
from oomkit.prediction.tracing.async_tp import (
    SIGNAL_PAD_BYTES,
    SYMM_MEM_GRANULARITY_BYTES,
    AsyncTpEmulations,
    async_tp_state_kept,
    symmetric_block_bytes,
)
from oomkit.prediction.tracing.distributed import trace_distributed_step

# A sequence-parallel MLP block on 2 ranks: fp32, batch B, sequence S (S/2 per rank), width D,
# hidden F (F/2 per rank).
B, S, D, F = 2, 64, 1024, 2048
FULL = B * S * D * 4  # one rank's gathered activation, and the MLP output before reduce-scatter
SHARD = FULL // 2  # the sequence shard
HIDDEN = B * S * (F // 2) * 4  # the column-parallel output (F/2 == D here: FULL bytes too)
CUBLAS_HOPPER = 32 * 2**20  # CublasHandlePool.cpp: 4096 KiB x 8 on compute capability 9.x
AG = "symm_mem.fused_all_gather_matmul.default"
RS = "symm_mem.fused_matmul_reduce_scatter.default"


class _Block(torch.nn.Module):
    def __init__(self, width: int = D, hidden: int = F) -> None:
        super().__init__()
        self.norm = torch.nn.RMSNorm(width)
        self.w1 = torch.nn.Linear(width, hidden, bias=False)
        self.w2 = torch.nn.Linear(hidden, width, bias=False)

    def forward(self, x: Any) -> Any:
        return x + self.w2(torch.nn.functional.silu(self.w1(self.norm(x))))


def _sequence_parallel_step(
    mesh: Any, batch: int = B, width: int = D, hidden: int = F
) -> tuple[Any, tuple[Any, ...]]:
    """The block under torchtitan's TP plan (sequence-parallel norm, colwise w1, rowwise w2),
    compiled whole; the step and what it keeps alive (the block, its input)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    block = _Block(width, hidden)
    parallelize_module(block, mesh, {
        "norm": SequenceParallel(),
        "w1": ColwiseParallel(input_layouts=Shard(1)),
        "w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    })
    block.compile(fullgraph=True)
    x = torch.randn(batch, S // 2, width, requires_grad=True)

    def step() -> None:
        block(DTensor.from_local(x, mesh, [Shard(1)])).to_local().sum().backward()

    return step, (block, x)


def _record(async_tp: bool, batch: int = B, width: int = D, hidden: int = F) -> Any:
    import torch._inductor.config as inductor_config

    def build(mesh: Any) -> tuple[Any, ...]:
        if async_tp:  # torchtitan/distributed/compile.py _maybe_enable_async_tp
            from torch.distributed._symmetric_memory import enable_symm_mem_for_group

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable_symm_mem_for_group(mesh.get_group().group_name)
            inductor_config._micro_pipeline_tp = True
        return _sequence_parallel_step(mesh, batch, width, hidden)

    torch._dynamo.reset()  # each size compiles afresh (no recompile limit across examples)
    with async_tp_state_kept():
        return trace_distributed_step(
            build, world_size=2, target=Target.resolve("h100"), compile=True,
            mesh_shape=((2,), ("tp",)),
        )


@pytest.fixture(scope="module")
def recordings() -> dict[str, Any]:
    """The block recorded with async TP, and without, cuBLAS workspaces as on an H100."""
    return {"async": _record(True)}


def _allocs(recording: Any, op: str) -> list[tuple[int, str, int]]:
    """(bytes, phase, stream) of each allocation the op made, in order."""
    out = []
    for event in recording.events:
        tags = dict(event.tags)
        if event.action == "alloc" and tags.get("op") == op:
            out.append((event.size, tags.get("phase"), event.stream))
    return out


def test_fused_ops_replace_the_collectives(recordings: dict[str, Any]) -> None:
    """Forward and backward each get one fused all-gather+matmul and one matmul+reduce-scatter;
    no plain all-gather or reduce-scatter is left."""
    recording = recordings["async"]
    assert dict(recording.kernel_choices) == {f"async TP {AG}": 2, f"async TP {RS}": 2}
    ops = {dict(e.tags).get("op") for e in recording.events if e.action == "alloc"}
    assert "_c10d_functional.all_gather_into_tensor.default" not in ops
    assert "_c10d_functional.reduce_scatter_tensor.default" not in ops


def test_fused_ops_allocate_as_their_cuda_implementations(recordings: dict[str, Any]) -> None:
    """_fused_all_gather_matmul_impl: the gathered A and the full output, then a cuBLAS workspace
    on the current stream (the first GEMM of the thread) and one on the backend stream;
    _fused_matmul_reduce_scatter_impl: the unreduced partials, then the reduced shard."""
    recording = recordings["async"]
    assert _allocs(recording, AG) == [
        (FULL, "forward", 0), (HIDDEN, "forward", 0),
        (CUBLAS_HOPPER, "forward", 0), (CUBLAS_HOPPER, "forward", 1),
        (FULL, "backward", 0), (HIDDEN, "backward", 0),
        (CUBLAS_HOPPER, "backward", 0), (CUBLAS_HOPPER, "backward", 1),
    ]
    assert _allocs(recording, RS) == [
        (FULL, "forward", 0), (SHARD, "forward", 0),
        (FULL, "backward", 0), (SHARD, "backward", 0),
    ]


def test_workspace_is_a_line_outside_the_allocator(recordings: dict[str, Any]) -> None:
    """The largest request is the reduce-scatter's two output chunks (2 x FULL/2, more than the
    all-gather's shard, FULL/2); mapped with the signal pad, rounded to 2 MiB; the prediction
    takes it off the usable bytes."""
    recording = recordings["async"]
    assert 2 * (FULL // 2) == 524_288 > SHARD
    ((what, mapped, source),) = recording.outside_allocator
    assert "524,288 bytes asked" in what
    assert mapped == 2 * 2**20
    assert "get_symm_mem_workspace" in source
    prediction = predict_recording(recording, target=Target.resolve("h100"))
    plain = predict_recording(
        dataclasses_replace(recording, outside_allocator=()), target=Target.resolve("h100")
    )
    assert plain.usable_bytes - prediction.usable_bytes == mapped
    assert prediction.distributed is not None
    assert any("symmetric-memory workspace" in w for w, _, _ in prediction.distributed.outside_lines)


def dataclasses_replace(recording: Any, **changes: Any) -> Any:
    import dataclasses

    return dataclasses.replace(recording, **changes)


def test_peak_against_plain_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without cuBLAS workspaces (CUBLAS_WORKSPACE_CONFIG=:0:0), async TP peaks SHARD lower.

    Plain compile peaks at the backward's second weight gradient: parameters, the input, the
    saved all-gathered input (FULL), the gradient's all-gather (FULL) and its matmul's output
    (FULL), two weight gradients. Async TP's backward peaks in its matmul+reduce-scatter: the
    saved input was copied in the forward's layout and is dead by then, and the gathered
    gradient (FULL), the partials (FULL) and the reduced shard (SHARD) are live: 3 x FULL
    against 2 x FULL + SHARD.
    """
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    fused = predict_recording(_record(True), target=Target.resolve("h100"))
    plain = predict_recording(_record(False), target=Target.resolve("h100"))
    assert plain.peak_allocated_bytes - fused.peak_allocated_bytes == 3 * FULL - (2 * FULL + SHARD)


def test_flag_restored_after_the_recording() -> None:
    """Inductor's _micro_pipeline_tp is as before the recording (torchtitan sets it)."""
    import torch._inductor.config as inductor_config

    with async_tp_state_kept():
        inductor_config._micro_pipeline_tp = True
    assert inductor_config._micro_pipeline_tp is False


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    # batch 1: DTensor gathers the sequence with a view, not split+cat, and torch's matcher
    # leaves that all-gather unfused (only the reduce-scatters are)
    batch=st.integers(min_value=2, max_value=3),
    width=st.sampled_from([1024, 1536]),
    hidden_factor=st.sampled_from([2, 3]),
)
def test_fused_buffers_follow_the_shapes(batch: int, width: int, hidden_factor: int) -> None:
    """For any batch above 1, width and hidden size: the forward's fused all-gather allocates the
    gathered input (batch x S x width) and the column-parallel output (batch x S x hidden/2),
    the reduce-scatter the partials (batch x S x width) and the shard (half of it), and the
    workspace asks for the larger of the shard and two output chunks (batch x S x width)."""
    hidden = hidden_factor * width
    recording = _record(True, batch, width, hidden)
    full, columns = batch * S * width * 4, batch * S * (hidden // 2) * 4
    forward = [(n, p) for n, p, _ in _allocs(recording, AG) if n != CUBLAS_HOPPER]
    assert forward[:2] == [(full, "forward"), (columns, "forward")]
    assert [(n, p) for n, p, _ in _allocs(recording, RS)][:2] == [(full, "forward"), (full // 2, "forward")]
    ((what, mapped, _),) = recording.outside_allocator
    assert f"{full:,} bytes asked" in what
    assert mapped == symmetric_block_bytes(full)


@given(size=st.integers(min_value=1, max_value=2**34))
def test_symmetric_block_bytes_rounds_to_the_granularity(size: int) -> None:
    """CUDASymmetricMemoryAllocator::alloc: size (16-byte aligned) + signal pad, rounded up."""
    block = symmetric_block_bytes(size)
    assert block % SYMM_MEM_GRANULARITY_BYTES == 0
    assert size + SIGNAL_PAD_BYTES <= block < size + 16 + SIGNAL_PAD_BYTES + SYMM_MEM_GRANULARITY_BYTES


def test_workspace_keeps_the_largest_request() -> None:
    """get_symm_mem_workspace grows to the largest request and keeps it, per group."""
    emulations = AsyncTpEmulations()
    for group, size in (("0", 100), ("0", 300), ("0", 200), ("1", 50)):
        emulations._workspace(group, size)
    assert emulations.workspace_bytes == {"0": 300, "1": 50}
    assert [n for _, n, _ in emulations.outside_lines()] == [2 * 2**20, 2 * 2**20]


def test_preset_helper_turns_the_pass_on_for_the_step_only() -> None:
    """models/async_tp.py with_async_tp (for the preset route): the step compiles with the pass
    on, as torchtitan's _maybe_enable_async_tp leaves it, and the flag is off again after."""
    import torch._inductor.config as inductor_config

    from oomkit.prediction.models.async_tp import with_async_tp

    def build(mesh: Any) -> tuple[Any, ...]:
        step, alive = _sequence_parallel_step(mesh)
        return with_async_tp(step, mesh), alive

    recording = trace_distributed_step(
        build, world_size=2, target=Target.resolve("h100"), compile=True,
        mesh_shape=((2,), ("tp",)),
    )
    assert dict(recording.kernel_choices) == {f"async TP {AG}": 2, f"async TP {RS}": 2}
    assert inductor_config._micro_pipeline_tp is False

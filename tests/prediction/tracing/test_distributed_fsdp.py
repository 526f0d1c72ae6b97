"""Rank 0 of FSDP2 recorded on a fake process group: shards, buffers and streams, in exact bytes."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from oomkit.core.target import Target
from oomkit.errors import ConfigError
from oomkit.prediction.tracing.distributed import (
    EmulatedStreams,
    fake_process_group,
    trace_distributed_step,
)

# Two FSDP units; the second has 5 output rows, which 2 and 4 ranks do not divide.
_SHAPES = (((16, 8), (16,)), ((5, 16), (5,)))


def _padded_rows(rows: int, world_size: int) -> int:
    """Rows of rank 0's shard: _fsdp_param.py _init_sharded_param pads every shard to chunk 0."""
    return math.ceil(rows / world_size)


def _shard_numel(shape: tuple[int, ...], world_size: int) -> int:
    return _padded_rows(shape[0], world_size) * math.prod(shape[1:])


def _unit_shard_numel(unit: int, world_size: int) -> int:
    return sum(_shard_numel(shape, world_size) for shape in _SHAPES[unit])


def _build(mesh, *, reshard_after_forward: bool | int = True):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 5))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters())
    batch = torch.randn(3, 8)

    def step():
        model(batch).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    return step, (model, optimizer, batch)


def _allocs(recording, step, category, stream=None):
    found = []
    for event in recording.step_events(step):
        tags = dict(event.tags)
        if event.action == "alloc" and tags["category"] == category:
            if stream is None or event.stream == stream:
                found.append(event.size)
    return found


@pytest.fixture(scope="module", params=[2, 4])
def recorded(request):
    """world size -> rank 0's recording of two steps (steady state in the second)."""
    world_size = request.param
    recording = trace_distributed_step(_build, world_size=world_size, steps=2)
    assert not dist.is_initialized()
    return world_size, recording


def test_sharded_parameters_are_padded_shards(recorded):
    """Before step 0 rank 0 holds 1/N of each parameter, padded to ceil(rows / N) rows (fp32)."""
    world_size, recording = recorded
    before = recording.events[: recording.step_starts[0]]
    sizes = [e.size for e in before if dict(e.tags)["category"] == "parameter"]
    expected = [4 * _shard_numel(s, world_size) for unit in _SHAPES for s in unit]
    assert sizes == expected
    if world_size == 4:
        assert expected == [128, 16, 128, 8]


def test_allgather_buffers_per_unit_on_the_copy_in_stream(recorded):
    """Each unit's bf16 all-gather output (N padded shards) is made on FSDP2's copy-in stream."""
    world_size, recording = recorded
    outputs = [2 * world_size * _unit_shard_numel(u, world_size) for u in (0, 1)]
    # Forward gathers units 0, 1; backward re-gathers 1 (resharded after forward), then 0.
    assert _allocs(recording, 1, "allgather_buffer", stream=1) == [*outputs, outputs[1], outputs[0]]
    # The bf16 copy-in buffer (one shard) is a temporary on the same stream.
    copy_in = [2 * _unit_shard_numel(u, world_size) for u in (0, 1)]
    assert _allocs(recording, 1, "temporary", stream=1) == [*copy_in, copy_in[1], copy_in[0]]


def test_unsharded_parameters_are_allgather_buffers_on_the_default_stream(recorded):
    """The unsharded bf16 parameters (padded to N shards) are refilled by resize_ on stream 0."""
    world_size, recording = recorded
    padded = [
        [2 * world_size * _shard_numel(s, world_size) for s in unit] for unit in _SHAPES
    ]
    assert _allocs(recording, 1, "allgather_buffer", stream=0) == [
        *padded[0],
        *padded[1],
        *padded[1],
        *padded[0],
    ]


def test_reduce_scatter_and_sharded_gradients(recorded):
    """fp32 reduce-scatter inputs on stream 0; their outputs, the sharded grads, on stream 3."""
    world_size, recording = recorded
    shards = [4 * _unit_shard_numel(u, world_size) for u in (1, 0)]  # backward order
    assert _allocs(recording, 1, "reduce_scatter_buffer", stream=0) == [
        world_size * s for s in shards
    ]
    assert _allocs(recording, 1, "gradient") == shards
    assert _allocs(recording, 1, "gradient", stream=3) == shards


def test_optimizer_state_is_sharded_and_step_counters_stay_on_host(recorded):
    """AdamW makes exp_avg and exp_avg_sq per shard in step 0; its CPU step counters cost none."""
    world_size, recording = recorded
    per_param = [4 * _shard_numel(s, world_size) for unit in _SHAPES for s in unit]
    expected = [size for size in per_param for _ in range(2)]
    assert _allocs(recording, 0, "optimizer_state") == expected
    assert _allocs(recording, 1, "optimizer_state") == []
    assert recording.allocated_bytes(phase="optimizer", step=1) == sum(per_param)  # foreach sqrt


def test_recording_warns_what_is_not_modelled(recorded):
    """The recording says it is rank 0 of a fake group and that NCCL's buffers are left out."""
    world_size, recording = recorded
    note = recording.warnings[-2]
    assert "rank 0 of a fake process group" in note
    assert f"world size {world_size}, 3 side stream(s)" in note


def test_uneven_shards_say_ranks_differ(recorded):
    """5 rows over N ranks: the smallest rank holds 1 (N=2) or 2 (N=4) rows less of 5x16 + 5."""
    world_size, recording = recorded
    short_rows = {2: 1, 4: 2}[world_size]
    note = recording.warnings[-1]
    assert note.startswith(f"ranks differ: 2 sharded parameter(s) have rows that {world_size}")
    assert f"up to {short_rows * (16 + 1) * 4} bytes less" in note


def test_reshard_after_forward_false_keeps_unsharded_parameters():
    """reshard_after_forward=False: backward re-gathers nothing, so stream 1 allocates 2 outputs."""
    recording = trace_distributed_step(
        lambda mesh: _build(mesh, reshard_after_forward=False), world_size=2, steps=1
    )
    outputs = [2 * 2 * _unit_shard_numel(u, 2) for u in (0, 1)]
    assert _allocs(recording, 0, "allgather_buffer", stream=1) == outputs


def _copy_in_sizes(recording):
    """Sizes of the all-gather copy-in buffers (empty on the all-gather stream) in step 1."""
    return [
        e.size
        for e in recording.step_events(0)
        if e.action == "alloc"
        and e.stream == 1
        and dict(e.tags)["category"] == "temporary"
        and dict(e.tags).get("op") == "aten.empty.memory_format"
    ]


def test_reshard_after_forward_to_two_ranks_keeps_half_shards_for_backward():
    """reshard_after_forward=2 on 4 ranks: FSDP2 reshards to 2-way shards after forward, so the
    backward all-gathers copy in 2-way shards (twice the 4-way forward ones), and the 2-way
    shards are freed in backward."""
    full = trace_distributed_step(lambda mesh: _build(mesh), world_size=4, steps=1)
    half = trace_distributed_step(
        lambda mesh: _build(mesh, reshard_after_forward=2), world_size=4, steps=1
    )
    # bf16 copy-in of rank 0's shard: unit 0 (4 of 16 rows + bias) then unit 1 (2 of 8 padded)
    forward = [2 * _unit_shard_numel(0, 4), 2 * _unit_shard_numel(1, 4)]
    assert _copy_in_sizes(full) == forward + forward[::-1]
    assert _copy_in_sizes(half) == forward + [2 * size for size in forward[::-1]]


def test_fake_process_group_is_destroyed_and_refuses_nesting():
    """The group exists only inside the block; a second one inside is refused."""
    with fake_process_group(2) as mesh:
        assert dist.get_world_size() == 2 and mesh.size() == 2
        with pytest.raises(ConfigError, match="already initialised"):
            with fake_process_group(2):
                pass
    assert not dist.is_initialized()


def test_bad_world_size():
    """A world size below 1 is a ConfigError that says what to pass."""
    with pytest.raises(ConfigError, match="world size must be at least 1"):
        with fake_process_group(0):
            pass


def test_emulated_streams_follow_stream_contexts():
    """torch.cpu.stream(s) makes s current (current_stream() answers it); the default is 0."""
    streams = EmulatedStreams()
    first, second = torch.cpu.Stream(), torch.cpu.Stream()
    default = torch.cpu.current_stream()
    with streams.installed():
        assert streams.current() == 0
        with torch.cpu.stream(first):
            assert streams.current() == 1
            with torch.cpu.stream(second):
                assert streams.current() == 2
            assert torch.cpu.current_stream() is first
            with torch.cpu.stream(torch.cpu.current_stream()):
                assert streams.current() == 1
        with torch.cpu.stream(first):
            assert streams.current() == 1
        assert streams.current() == 0
        assert torch.cpu.current_stream() is default
        with torch.cpu.stream(default):
            assert streams.current() == 0
    assert streams.streams_used == 2
    assert torch.cpu.current_stream() is default


def test_side_streams_reserve_their_own_segments(recorded):
    """Replayed, each side stream that allocates (1 and 3) gets its own 2 MiB small segment."""
    import dataclasses

    from oomkit.prediction.predictor import predict_recording

    _, recording = recorded
    assert {e.stream for e in recording.events} == {0, 1, 3}
    one_stream = dataclasses.replace(
        recording, events=tuple(dataclasses.replace(e, stream=0) for e in recording.events)
    )
    with_streams = predict_recording(recording, target=Target.resolve("h100"))
    without = predict_recording(one_stream, target=Target.resolve("h100"))
    assert with_streams.peak_allocated_bytes == without.peak_allocated_bytes
    # CUDACachingAllocator.cpp kSmallBuffer: a small-pool segment is 2 MiB, per stream.
    assert with_streams.peak_reserved_bytes - without.peak_reserved_bytes == 2 * 2 * 1024 * 1024

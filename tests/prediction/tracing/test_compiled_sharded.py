"""Blocks compiled inside FSDP2 on a fake process group: recorded compiled, in exact bytes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _residual_mlp import ResidualMLP

from oomkit.core.target import Target
from oomkit.prediction.tracing.distributed import trace_distributed_step

# One block: x + down(gelu(up(x))), 64 -> 256 -> 64, fp32, on a local batch of 8 x 32 tokens.
TOKENS, HIDDEN, WIDE = 8 * 32, 64, 256
WIDE_BYTES, HIDDEN_BYTES = TOKENS * WIDE * 4, TOKENS * HIDDEN * 4  # 262144, 65536


def _builder(compiled: bool):
    def build(mesh):
        from torch.distributed.fsdp import fully_shard

        model = torch.nn.Sequential(ResidualMLP(HIDDEN, WIDE), ResidualMLP(HIDDEN, WIDE))
        for block in model:
            if compiled:  # torchtitan apply_compile: in place, before fully_shard
                block.compile(fullgraph=True)
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters())
        batch = torch.randn(8, 32, HIDDEN)

        def step():
            model(batch).sum().backward()
            optimizer.step()
            optimizer.zero_grad()

        return step, (model, optimizer, batch)

    return build


@pytest.fixture(scope="module")
def recordings():
    """Eager and compiled rank 0 of FSDP2 over 2 ranks, two steps each."""
    eager = trace_distributed_step(_builder(False), world_size=2, steps=2)
    compiled = trace_distributed_step(_builder(True), world_size=2, steps=2, compile=True)
    assert not dist.is_initialized()
    return eager, compiled


def _activations_of_forward(recording, step):
    """The sizes of the forward's activation and temporary allocations, in order."""
    sizes = []
    for event in recording.step_events(step):
        tags = dict(event.tags)
        if event.action == "alloc" and tags["category"] == "temporary":
            if tags.get("op") in ("aten.sum.default", "aten.ones_like.default"):
                break  # the loss: the forward is over
        if event.action == "alloc" and tags["category"] in ("activation", "temporary"):
            sizes.append(event.size)
    return sizes


def test_compiled_blocks_are_recorded_compiled_inside_fsdp2(recordings):
    """Each block's forward and backward ran as compiled graphs, entered twice per step."""
    _, compiled = recordings
    said = " ".join(compiled.warnings)
    assert "compiled code was entered 4 time(s)" in said  # 2 blocks x 2 steps
    assert "world size 2" in said


def test_inductor_writes_the_residual_add_into_the_down_projection(recordings):
    """Eager: up (262144), gelu (262144), down (65536, freed after the add), add (65536) per
    block. Compiled (AOTAutograd's forward: addmm, gelu's erf decomposition fused into one
    kernel, addmm, add): the add writes into down's dying output (scheduler.py
    decide_inplace_update), so each block makes one 65536-byte buffer less."""
    eager, compiled = recordings
    block_eager = [WIDE_BYTES, WIDE_BYTES, HIDDEN_BYTES, HIDDEN_BYTES]
    block_compiled = [WIDE_BYTES, WIDE_BYTES, HIDDEN_BYTES]
    assert _activations_of_forward(eager, 1) == block_eager * 2
    assert _activations_of_forward(compiled, 1) == block_compiled * 2


def test_fsdp2_collectives_stay_eager_around_compiled_blocks(recordings):
    """FSDP2's hooks run outside the compiled graphs (dynamo's skip_fsdp_hooks): the same
    all-gather and reduce-scatter buffers, on the same streams, compiled or not."""
    eager, compiled = recordings

    def comms(recording):
        return [
            (e.size, e.stream, dict(e.tags)["category"])
            for e in recording.step_events(1)
            if e.action == "alloc"
            and dict(e.tags)["category"] in ("allgather_buffer", "reduce_scatter_buffer")
        ]

    assert comms(compiled) == comms(eager)
    # 4 all-gathers (each block in forward, again in backward) of 5 buffers; 2 reduce-scatters.
    assert len(comms(eager)) == 4 * 5 + 2


def test_peaks_compiled_and_eager_and_why_they_differ(recordings):
    """Both peak in the second step's backward of block 1, just after its all-gather.

    Eager holds there block 1's down backward: grad input (262144), weight grad (65536) and
    bias grad (256, a 512-byte block), the gelu output still saved until the whole addmm
    backward node ends. Compiled holds the grad input and weight grad too, but frees the gelu
    output after its last reader (the weight-grad mm), before the bias grad is summed; and it
    first copies the incoming gradient (a stride-0 expand of the loss's ones) to a contiguous
    65536-byte buffer, as AOTAutograd's backward prologue does for a tangent traced contiguous
    (torch/_functorch/_aot_autograd/runtime_wrappers.py coerce_to_expected_memory_format).
    So compiled = eager + 65536 - 512 allocated; the segments (reserved) are the same."""
    from oomkit.prediction.predictor import predict_recording

    eager, compiled = recordings
    target = Target.resolve("h100")
    eager_peak = predict_recording(eager, target=target)
    compiled_peak = predict_recording(compiled, target=target)
    assert compiled_peak.peak_allocated_bytes - eager_peak.peak_allocated_bytes == 65536 - 512
    assert eager_peak.peak_allocated_bytes == 69282304
    assert compiled_peak.peak_allocated_bytes == 69347328
    assert eager_peak.peak_reserved_bytes == compiled_peak.peak_reserved_bytes == 75497472


def test_the_contiguous_tangent_is_the_compiled_backward_s_first_buffer(recordings):
    """Block 1's compiled backward starts with the 65536-byte contiguous copy of its gradient."""
    _, compiled = recordings
    events = compiled.step_events(1)
    loss = next(
        i for i, e in enumerate(events) if dict(e.tags).get("op") == "aten.ones_like.default"
    )
    after = [
        (e.size, dict(e.tags).get("op"))
        for e in events[loss + 1 :]
        if e.action == "alloc" and dict(e.tags)["category"] == "temporary"
    ]
    assert after[:3] == [
        (HIDDEN_BYTES, "aten.empty_strided.default"),
        (WIDE_BYTES, "aten.mm.default"),
        (HIDDEN * WIDE * 4, "aten.mm.default"),
    ]

"""Blocks compiled inside DDP on a fake process group: dynamo's DDPOptimizer runs, in exact bytes.

Dynamo compiles a frame inside ``DistributedDataParallel.forward`` through its DDPOptimizer
(torch/_dynamo/backends/distributed.py), which splits the captured graph at DDP's gradient
buckets and compiles each piece through the backend; oomkit's compiled backend records each.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _residual_mlp import ResidualMLP

from oomkit.core.target import Target
from oomkit.prediction.tracing.distributed import trace_distributed_step

# One block: x + down(gelu(up(x))), HIDDEN -> WIDE -> HIDDEN, fp32, a local batch of 8 x 32.
TOKENS, HIDDEN, WIDE = 8 * 32, 64, 256
WIDE_BYTES, HIDDEN_BYTES = TOKENS * WIDE * 4, TOKENS * HIDDEN * 4  # 262144, 65536


def _builder(compiled: bool, *, hidden: int = HIDDEN, wide: int = WIDE, bucket_cap_mb=None):
    def build(mesh):
        from torch.nn.parallel import DistributedDataParallel

        model = torch.nn.Sequential(ResidualMLP(hidden, wide), ResidualMLP(hidden, wide))
        for block in model:
            if compiled:  # torchtitan apply_compile: in place, before DDP
                block.compile(fullgraph=True)
        ddp = DistributedDataParallel(
            model, process_group=mesh.get_group(), bucket_cap_mb=bucket_cap_mb
        )
        optimizer = torch.optim.AdamW(ddp.parameters())
        batch = torch.randn(8, 32, hidden)

        def step():
            ddp(batch).sum().backward()
            optimizer.step()
            optimizer.zero_grad()

        return step, (model, optimizer, batch)

    return build


@pytest.fixture(scope="module")
def recordings():
    """Eager and compiled rank 0 of DDP over 2 ranks, two steps each. Dynamo's table of
    tensor methods behind Python operators is emptied first, so the compiled recording fills
    it while dynamo traces inside DDP's forward (builtin.py populate_builtin_to_tensor_fn_map
    runs real ops on its own CPU tensors): with the recording's fake mode off there, as
    compiled.py's _ddp_compiles_without_modes makes it."""
    from torch._dynamo.variables import builtin

    eager = trace_distributed_step(_builder(False), world_size=2, steps=2)
    builtin.BUILTIN_TO_TENSOR_FN_MAP.clear()
    builtin.BUILTIN_TO_TENSOR_RFN_MAP.clear()
    compiled = trace_distributed_step(_builder(True), world_size=2, steps=2, compile=True)
    assert not dist.is_initialized()
    return eager, compiled


def _forward_sizes(recording, step):
    """The sizes of the forward's activation and temporary allocations, in order."""
    sizes = []
    for event in recording.step_events(step):
        tags = dict(event.tags)
        if event.action == "alloc" and tags.get("op") in ("aten.sum.default", "aten.ones_like.default"):
            break  # the loss: the forward is over
        if event.action == "alloc" and tags["category"] in ("activation", "temporary"):
            sizes.append(event.size)
    return sizes


def test_blocks_compiled_inside_ddp_are_recorded_compiled(recordings):
    """Each block's forward and backward ran as compiled graphs (2 blocks x 2 steps entered),
    none fell back to eager, and DDP's own note is kept."""
    _, compiled = recordings
    said = " ".join(compiled.warnings)
    assert "compiled code was entered 4 time(s)" in said
    assert "could not be compiled GPU-free" not in said
    assert "existed before tracing" not in said
    assert "DDP: every replica holds the same parameters" in said
    # Module.compile compiles each block on its own: one forward and one backward graph each.
    assert "(2 backward, 2 forward)" in compiled.assumptions["torch.compile"]


def test_inductor_writes_the_residual_add_into_the_down_projection(recordings):
    """Eager: up (262144), gelu (262144), down (65536, freed after the add), add (65536) per
    block. Compiled: the add writes into down's dying output (scheduler.py
    decide_inplace_update), one 65536-byte buffer less per block, as under FSDP2. Both start
    step 2 with DDP's bucket rebuild (reducer.cpp sync_bucket_indices): the device copies of
    the 8 parameters' indices and their count (9 int32, 36 bytes) and of the 1 bucket's size."""
    eager, compiled = recordings
    rebuild = [9 * 4, 1 * 4]
    assert _forward_sizes(eager, 1) == rebuild + [WIDE_BYTES, WIDE_BYTES, HIDDEN_BYTES, HIDDEN_BYTES] * 2
    assert _forward_sizes(compiled, 1) == rebuild + [WIDE_BYTES, WIDE_BYTES, HIDDEN_BYTES] * 2


def test_ddp_buckets_are_the_same_compiled_or_not(recordings):
    """DDP's gradient buckets (reducer.cpp initialize_buckets) do not depend on compile."""
    eager, compiled = recordings

    def buckets(recording):
        return sorted(
            e.size for e in recording.events
            if e.action == "alloc" and dict(e.tags)["category"] == "ddp_bucket"
        )

    assert buckets(compiled) == buckets(eager) != []


def test_peaks_compiled_and_eager(recordings):
    """The compiled peak is the eager one + 65536 - 512, as under FSDP2
    (test_compiled_sharded.py): at the peak (block 1's backward) the compiled backward holds
    a contiguous copy of the incoming gradient (AOTAutograd's runtime_wrappers.py
    coerce_to_expected_memory_format) and has freed the gelu output before the 512-byte bias
    gradient is summed."""
    from oomkit.prediction.predictor import predict_recording

    eager, compiled = recordings
    target = Target.resolve("h100")
    eager_peak = predict_recording(eager, target=target).peak_allocated_bytes
    compiled_peak = predict_recording(compiled, target=target).peak_allocated_bytes
    assert (eager_peak, compiled_peak) == (69678080, 69743104)
    assert compiled_peak - eager_peak == 65536 - 512


def test_ddp_optimizer_splits_a_block_at_its_bucket():
    """With 1 MiB buckets and a block of two 1 MiB weights (256 x 1024 fp32), the
    DDPOptimizer cuts each captured block graph where a bucket fills
    (backends/distributed.py DDPOptimizer.compile_fn: a new submodule when the parameters'
    bytes pass bucket_bytes_cap): each of the 2 blocks becomes 2 pieces, so 4 forward and 4
    backward graphs are compiled, each recorded through the compiled backend."""
    recording = trace_distributed_step(
        _builder(True, hidden=256, wide=1024, bucket_cap_mb=1), world_size=2, steps=1,
        compile=True,
    )
    said = " ".join(recording.warnings)
    assert "could not be compiled GPU-free" not in said
    assert "(4 backward, 4 forward)" in recording.assumptions["torch.compile"]

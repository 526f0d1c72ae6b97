"""`oomkit predict --torchtitan llama3:debugmodel -- --compile.enable`: torchtitan's own compile.

torchtitan's ``apply_compile`` compiles each transformer block (fullgraph, Inductor) after its
selective op activation checkpointing (the debugmodel's default) and before FSDP2, and
``BaseLoss`` compiles the loss (``CompileConfig.components`` ``["model", "loss"]``); the step is
recorded through the compiled backend on the fake process group.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest
from _recorded_once import torchtitan_json

from oomkit.interfaces.cli import main

_OVERRIDES = [
    "--parallelism.spmd_backend", "partial_dtensor",
    "--training.local_batch_size", "2",
    "--training.seq_len", "256",
    "--training.disable_cuda_graphs",
]


def _job(*extra: str) -> tuple[int, dict]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(
            ["predict", "--torchtitan", "llama3:debugmodel", "--world-size", "2", "--steps", "2",
             "--json", "--", *_OVERRIDES, *extra]
        )
    return code, json.loads(out.getvalue())


@pytest.fixture(scope="module")
def eager_and_compiled():
    """The debugmodel on FSDP 2, rank 0, 2 steps: eager (recorded once per process, as
    test_torchtitan_cli.py reads it too), then with --compile.enable."""
    pytest.importorskip("torchtitan")
    eager = torchtitan_json(
        ["predict", "--torchtitan", "llama3:debugmodel", "--world-size", "2", "--steps", "2",
         "--json", "--", *_OVERRIDES]
    )
    return eager, _job("--compile.enable")


def test_compile_enable_records_the_blocks_and_the_loss_compiled(eager_and_compiled):
    """6 compiled blocks entered once per step (their selective checkpoint is recomputed inside
    the compiled backward) and the compiled loss: 28 entries in 2 steps; every storage was
    recorded when made."""
    (code, eager), (code_compiled, compiled) = eager_and_compiled
    assert code == code_compiled == 0
    assert compiled["description"] == eager["description"]
    said = " ".join(compiled["warnings"])
    assert "torch.compile: compiled (AOTAutograd partitioner real" in said
    assert "compiled code was entered 28 time(s)" in said
    assert "existed before tracing" not in said
    assert compiled["scenario"]["torchtitan"]["overrides"] == [*_OVERRIDES, "--compile.enable"]


def test_compiled_peak_keeps_fsdp2_s_buffers_and_holds_fewer_activations(eager_and_compiled):
    """At both peaks (step 2) the parameters, optimizer state and FSDP2's all-gather and
    reduce-scatter buffers are the same (FSDP2's hooks stay eager around the compiled blocks);
    the compiled step holds fewer activations and temporaries (Inductor's fused kernels
    materialise fewer intermediates), so its peak is lower."""
    (_, eager), (_, compiled) = eager_and_compiled
    at_eager = eager["peak_allocated_at"]["by_category_bytes"]
    at_compiled = compiled["peak_allocated_at"]["by_category_bytes"]
    for kind in ("parameter", "optimizer_state", "allgather_buffer", "reduce_scatter_buffer"):
        assert at_eager[kind] == at_compiled[kind], kind
    assert at_compiled["activation"] < at_eager["activation"]
    assert at_compiled["temporary"] < at_eager["temporary"]
    # The eager blocks' RMSNorms are torch 2.13's fused kernel (emulations/rms_norm.py): the
    # composite's fp32 products, recomputed under the selective checkpoint, are not there.
    assert eager["peak_allocated_bytes"] == 130877440
    # The compiled blocks save SDPA's output as torchtitan's selective-op policy asks (the CUDA
    # kernel CUDA picks, in the save list), where the composite traced on the fake device
    # would be recomputed.
    assert compiled["peak_allocated_bytes"] == 128647168


def test_torchtitan_s_dynamo_settings_do_not_outlive_the_job(eager_and_compiled):
    """apply_compile sets capture_scalar_outputs process-wide; the recording restores it."""
    import torch._dynamo

    assert torch._dynamo.config.capture_scalar_outputs is False
    assert torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint is False


def test_compile_with_tensor_parallel_records_the_blocks_and_the_loss_compiled():
    """FSDP 2 x TP 2 with --compile.enable (the debugmodel's selective op AC): every block and
    the loss-parallel loss are compiled and recorded (the TP mesh that a compiled selective
    checkpoint saves for backward is an opaque object; the loss's CPU constants are host
    memory; DTensor's all-gathers and reduce-scatters in the compiled graphs wait on their own
    buffers). At step 2's peak the shards, gradients, optimizer state and FSDP2's buffers are
    the eager step's; the compiled step holds 1441792 activation and 1836032 temporary bytes
    less (AOTAutograd's partition and Inductor's fused kernels)."""
    pytest.importorskip("torchtitan")
    layout = ["--parallelism.tensor_parallel_degree", "2",
              "--parallelism.data_parallel_shard_degree", "2"]
    jobs = []
    for extra in ([], ["--compile.enable"]):
        # Both in this process, after the module's own jobs: each recording starts with
        # DTensor's sharding caches empty (distributed.py _forget_sharding_results), else the
        # compiled job got the last job's mesh and its destroyed process group.
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(
                ["predict", "--torchtitan", "llama3:debugmodel", "--world-size", "4",
                 "--steps", "2", "--json", "--", *_OVERRIDES, *layout, *extra]
            )
        assert code == 0
        jobs.append(json.loads(out.getvalue()))
    eager, compiled = jobs
    said = " ".join(compiled["warnings"])
    assert "compiled code was entered 28 time(s)" in said
    assert "could not be compiled GPU-free" not in said and "existed before tracing" not in said
    at_eager = dict(eager["peak_allocated_at"]["by_category_bytes"])
    at_compiled = dict(compiled["peak_allocated_at"]["by_category_bytes"])
    assert at_eager.pop("activation") - at_compiled.pop("activation") == 1441792
    assert at_eager.pop("temporary") - at_compiled.pop("temporary") == 1836032
    assert at_compiled == at_eager
    assert (eager["peak_allocated_bytes"], compiled["peak_allocated_bytes"]) == (
        102028288,
        98750464,
    )


def test_compile_with_tensor_parallel_under_full_ac_records():
    """FSDP 2 x TP 2, --compile.enable and full AC: the compiled checkpoint recomputes SDPA
    (seeded) and saves the TP mesh; its saved RNG state is put among the saved tensors, where
    AOTAutograd's runtime reads it (compile_rng_order.py), so it records. At the peak only the
    temporaries differ from the eager job's: 1441792 bytes fewer compiled."""
    pytest.importorskip("torchtitan")
    jobs = []
    for extra in ([], ["--compile.enable"]):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(
                ["predict", "--torchtitan", "llama3:debugmodel", "--world-size", "4",
                 "--steps", "2", "--json", "--", *_OVERRIDES,
                 "--parallelism.tensor_parallel_degree", "2",
                 "--parallelism.data_parallel_shard_degree", "2", *extra,
                 "activation_checkpoint:full"]  # a subcommand: after the other overrides
            )
        assert code == 0
        jobs.append(json.loads(out.getvalue()))
    eager, compiled = jobs
    said = " ".join(compiled["warnings"])
    assert "compiled code was entered 28 time(s)" in said
    assert "could not be compiled GPU-free" not in said and "existed before tracing" not in said
    at_eager = dict(eager["peak_allocated_at"]["by_category_bytes"])
    at_compiled = dict(compiled["peak_allocated_at"]["by_category_bytes"])
    assert at_eager.pop("temporary") - at_compiled.pop("temporary") == 1441792
    assert at_compiled == at_eager
    assert (eager["peak_allocated_bytes"], compiled["peak_allocated_bytes"]) == (
        98750464,
        97308672,
    )

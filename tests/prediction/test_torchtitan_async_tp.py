"""torchtitan's async TP (``--compile.enable_async_tensor_parallel``) on the torchtitan route.

torchtitan 0.3.0's llama3 ``debugmodel`` cut to its first 2 blocks (``_torchtitan_two_blocks``:
width 256, fp32; each block is compiled and fused alike, so 2 show what 6 show) on 2 TP ranks,
local batch 2 x seq 2048: ``apply_compile`` runs ``_maybe_enable_async_tp``, Inductor's
micro-pipeline pass runs on each compiled block's graphs (prediction/tracing/async_tp.py).
"""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan")

from _torchtitan_small_job import TWO_BLOCKS  # noqa: E402

from oomkit.core.target import Target  # noqa: E402
from oomkit.prediction.torchtitan_job import TorchtitanJob, record_torchtitan_job  # noqa: E402

_BASE = (
    "--parallelism.tensor_parallel_degree", "2",
    "--parallelism.spmd_backend", "partial_dtensor",
    "--training.disable_cuda_graphs",
    "--compile.enable", "--compile.components", "model",
    "--training.local_batch_size", "2", "--training.seq_len", "2048",
)
AG = "symm_mem.fused_all_gather_matmul.default"
RS = "symm_mem.fused_matmul_reduce_scatter.default"
CUBLAS_HOPPER = 32 * 2**20
_BLOCKS = 2


def _record(*extra: str) -> object:
    job = TorchtitanJob(*TWO_BLOCKS, _BASE + extra, world_size=2)
    recording, _ = record_torchtitan_job(job, target=Target.resolve("h100"), steps=1)
    return recording


@pytest.fixture(scope="module")
def fused() -> object:
    return _record("--compile.enable_async_tensor_parallel")


def test_the_pass_fuses_each_blocks_collectives(fused) -> None:
    """Per block and step: forward all-gathers before the fused qkv and before w1/w3 and
    reduce-scatters after wo and w2; backward all-gathers wo's and w2's output gradients and the
    norm's, and reduce-scatters one input gradient (the other sums two matmuls, which the pass
    does not fuse): 5 all-gather+matmul and 3 matmul+reduce-scatter, times the blocks."""
    assert dict(fused.kernel_choices).get(f"async TP {AG}") == 5 * _BLOCKS
    assert dict(fused.kernel_choices).get(f"async TP {RS}") == 3 * _BLOCKS


def test_workspace_and_backend_stream(fused) -> None:
    """The largest request: two reduce-scatter chunks of 2 x 2048/2 rows x 256 fp32 (2 MiB),
    mapped with the signal pad in 4 MiB; each thread's first GEMM on the backend stream takes a
    cuBLAS workspace (forward, backward), and flags are restored afterwards."""
    import torch._inductor.config as inductor_config

    ((what, mapped, _),) = fused.outside_allocator
    assert "2,097,152 bytes asked" in what
    assert mapped == 4 * 2**20
    backend = [
        (e.size, dict(e.tags).get("phase"))
        for e in fused.events
        if e.action == "alloc" and e.stream != 0 and dict(e.tags).get("op") in (AG, RS)
    ]
    assert backend == [(CUBLAS_HOPPER, "forward"), (CUBLAS_HOPPER, "backward")]
    assert inductor_config._micro_pipeline_tp is False


def test_without_async_tp_nothing_is_fused() -> None:
    """The same job with async TP off: no fused op, no workspace line."""
    plain = _record("--compile.no-enable-async-tensor-parallel")
    assert not any(k.startswith("async TP") for k in plain.kernel_choices)
    assert plain.outside_allocator == ()

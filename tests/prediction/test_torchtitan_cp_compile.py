"""torchtitan's compiled blocks under context parallel: SDPA's CUDA kernel in dynamo's capture.

The model is llama3's ``debugmodel`` cut to 2 blocks (``_torchtitan_two_blocks``: 16 heads of
16, no grouped K/V), 2 sequences of 256 tokens, CP 2 (FSDP2 over the 2 CP ranks, bf16), no AC,
on an H100, which picks cuDNN attention (torch's cuDNN ring function runs it on local shards).
"""

from __future__ import annotations

import collections

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torchtitan")

from _torchtitan_recordings import recorded_job  # noqa: E402
from _torchtitan_small_job import TWO_BLOCKS, small_step  # noqa: E402

from oomkit.core.target import Target  # noqa: E402
from oomkit.prediction._torchtitan_cp_compile import (  # noqa: E402
    CPU_FLASH_OP,
    _as_cuda_sdpa,
    cpu_sdpa_as_cuda,
)
from oomkit.prediction._torchtitan_env import SUPPORTED_TORCHTITAN, torchtitan_version  # noqa: E402
from oomkit.prediction.torchtitan_job import TorchtitanJob  # noqa: E402
from oomkit.prediction.tracing.emulations.sdpa import sdpa_backend_for  # noqa: E402
from oomkit.prediction.tracing.emulations.sdpa_backend import SdpaSettings  # noqa: E402

if torchtitan_version() not in SUPPORTED_TORCHTITAN:  # pragma: no cover - another release
    pytest.skip("an unsupported torchtitan is installed", allow_module_level=True)

_BATCH, _SEQ, _HEADS, _HEAD_DIM, _BF16, _FP32 = 2, 256, 16, 16, 2, 4
_CP = 2
_LOCAL = _SEQ // _CP  # this rank's tokens (two head-tail chunks of 64)
_BLOCKS, _STEPS = 2, 2
_BASE = (*small_step(_BATCH, _SEQ), "--parallelism.context_parallel_degree", str(_CP))
_CUDNN = "aten._scaled_dot_product_cudnn_attention.default"
_CUDNN_BACKWARD = "aten._scaled_dot_product_cudnn_attention_backward.default"
_CPU_OPS = (CPU_FLASH_OP, "aten._scaled_dot_product_attention_math.default")


@pytest.fixture(scope="module")
def recorded():
    """(label) -> (recording, prediction): CP 2 with the blocks compiled, and eagerly, without
    AC; compiled under torchtitan's selective (op) AC and its full AC."""
    out = {}
    for label, extra, ac in (
        ("compiled", ("--compile.enable",), "none"),
        ("eager", (), "none"),  # test_torchtitan_cp.py's CP 2 job: recorded once for both
        ("compiled_sac", ("--compile.enable",), "selective"),
        ("compiled_full_ac", ("--compile.enable",), "full"),
    ):
        job = TorchtitanJob(*TWO_BLOCKS, (*_BASE, *extra, f"activation_checkpoint:{ac}"), world_size=_CP)
        recording, _, prediction = recorded_job(job)
        out[label] = (recording, prediction)
    return out


def _allocs(recording, op: str) -> collections.Counter[int]:
    return collections.Counter(
        e.size for e in recording.events if e.action == "alloc" and dict(e.tags).get("op") == op
    )


def test_compiled_blocks_with_cp_record_every_graph_compiled(recorded):
    """No refusal, no captured graph left eager: 2 forward and 2 backward graphs compiled
    (dynamo's cache keeps one per block, each recompiled once for its second call's sizes)."""
    recording, _ = recorded["compiled"]
    compiled = recording.assumptions["torch.compile"]
    assert "(2 backward, 2 forward)" in compiled
    assert not [w for w in recording.warnings if "could not be compiled" in w]


def test_the_compiled_graphs_run_the_cuda_sdpa_kernels(recorded):
    """The fused cuDNN forward and backward the H100 picks, run by torch's ring in the compiled
    forward and backward graphs; never SDPA's CPU kernel nor its math path."""
    recording, _ = recorded["compiled"]
    assert recording.kernel_choices == {"SDPA cudnn_attention": 2}
    assert _allocs(recording, _CUDNN) and _allocs(recording, _CUDNN_BACKWARD)
    for op in _CPU_OPS:
        assert not _allocs(recording, op)


def test_the_fused_kernels_outputs_are_sized_from_the_local_shapes(recorded):
    """Per block and step, the ring's two cuDNN calls on this rank's 128 tokens: the whole local
    query against the local K/V (out bf16 [2, 16, 128, 16], softmax stats fp32 [2, 16, 128, 1])
    and the head-tail half against the gathered half (64 tokens), each with its 8-byte philox
    seed and offset and the 256-byte graph workspace sm90 asks for (measured on an H200);
    compiled, the same bytes as eager."""
    compiled, _ = recorded["compiled"]
    eager, _ = recorded["eager"]
    calls = _BLOCKS * _STEPS
    out_bytes = _BATCH * _HEADS * _LOCAL * _HEAD_DIM * _BF16
    stats_bytes = _BATCH * _HEADS * _LOCAL * _FP32
    expected = {
        out_bytes: calls, out_bytes // 2: calls,
        stats_bytes: calls, stats_bytes // 2: calls,
        8: 2 * 2 * calls,
        256: 2 * calls,
    }
    assert _allocs(compiled, _CUDNN) == expected
    assert _allocs(eager, _CUDNN) == expected
    assert _allocs(compiled, _CUDNN_BACKWARD) == _allocs(eager, _CUDNN_BACKWARD)
    # the backward's one graph workspace: the fp32 dQ accumulator of its query, the fp32
    # softmax sum and the engine's 256 bytes (sm90), for the whole local query and the half
    backward = _allocs(compiled, _CUDNN_BACKWARD)
    assert backward[out_bytes * 2 + stats_bytes + 256] == calls
    assert backward[out_bytes + stats_bytes // 2 + 256] == calls


def test_selective_ac_saves_the_rings_cudnn_outputs_and_full_ac_recomputes_them(recorded):
    """torchtitan's op-level save list holds ``_scaled_dot_product_cudnn_attention``
    (torchtitan/distributed/activation_checkpoint.py ``_get_default_save_ops``): compiled under
    selective AC, the ring's cuDNN calls run once per block and step, as without AC; under full
    AC the backward graph recomputes them, twice the forward's bytes, the same backward."""
    no_ac = _allocs(recorded["compiled"][0], _CUDNN)
    assert _allocs(recorded["compiled_sac"][0], _CUDNN) == no_ac
    full = _allocs(recorded["compiled_full_ac"][0], _CUDNN)
    assert full == {size: 2 * n for size, n in no_ac.items()}
    backward = _allocs(recorded["compiled"][0], _CUDNN_BACKWARD)
    for label in ("compiled_sac", "compiled_full_ac"):
        recording = recorded[label][0]
        assert _allocs(recording, _CUDNN_BACKWARD) == backward
        assert not [w for w in recording.warnings if "could not be compiled" in w]
        for op in _CPU_OPS:
            assert not _allocs(recording, op)


def test_compiled_cp_peaks_no_higher_than_eager_cp(recorded):
    """Inductor's fusion keeps fewer intermediates than the eager blocks: 97,278,976 against
    98,867,200 bytes allocated at the peak (the same ring, parameters and gradients)."""
    compiled = recorded["compiled"][1].peak_allocated_bytes
    eager = recorded["eager"][1].peak_allocated_bytes
    assert compiled <= eager
    assert eager - compiled < 4 << 20  # the blocks' fused intermediates, not the ring's


def test_cps_handlers_are_put_back_after_the_job(recorded):
    """The CPU op's handler lives while a job records only."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    assert op not in _attention.custom_ops
    with cpu_sdpa_as_cuda(Target.resolve("h100")):
        assert op in _attention.custom_ops
    assert op not in _attention.custom_ops


_NO_CUDNN = SdpaSettings(cudnn_version=None)


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 4),
    heads=st.sampled_from([(8, 8), (8, 2), (4, 1)]),
    seq=st.integers(1, 300),
    head_dim=st.sampled_from([16, 60, 64, 128]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    capability=st.sampled_from([(7, 0), (8, 0), (9, 0)]),
    causal=st.booleans(),
)
def test_the_cpu_op_runs_as_the_fused_kernel_the_gpu_picks(
    batch, heads, seq, head_dim, dtype, capability, causal
):
    """Whatever the shapes, the handler's output is the query's shape and dtype, and its second
    element is the picked kernel's: fp32 stats for a fused kernel (flash [B, H, L]; cuDNN
    [B, H, L, 1]; memory-efficient [B, H, L rounded up to 32]), the probabilities for math."""
    q_heads, kv_heads = heads
    q = torch.empty(batch, q_heads, seq, head_dim, dtype=dtype, device="meta", requires_grad=True)
    k = torch.empty(batch, kv_heads, seq, head_dim, dtype=dtype, device="meta", requires_grad=True)
    v = torch.empty_like(k, requires_grad=True)
    picked = sdpa_backend_for(
        q, k, v, capability, is_causal=causal, enable_gqa=q_heads != kv_heads, settings=_NO_CUDNN
    )
    out, second = _as_cuda_sdpa((q, k, v, 0.0, causal), {}, capability, _NO_CUDNN)
    assert (out.shape, out.dtype) == (q.shape, dtype)
    lse_shapes = {
        "flash_attention": (batch, q_heads, seq),
        "cudnn_attention": (batch, q_heads, seq, 1),
        "efficient_attention": (batch, q_heads, (seq + 31) // 32 * 32),
        "math": (batch, q_heads, seq, seq),
    }
    assert tuple(second.shape) == lse_shapes[picked]
    if picked != "math":
        assert second.dtype == torch.float32

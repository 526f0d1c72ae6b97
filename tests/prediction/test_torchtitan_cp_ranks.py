"""Context parallel's middle ranks differ: ``--all-ranks`` records every CP rank.

torch's load-balanced ring attention (torch/distributed/tensor/experimental/_context_parallel/
_attention.py ``_templated_ring_attention`` and ``_templated_ring_attention_backward``): at ring
step 0 each CP rank attends causally over its own full query and K/V; at step ``i > 0`` CP rank
``r`` uses its full query and the first half of K/V where ``i <= r``, the second half of its
query and the full K/V where ``i > r``. The job: torchtitan 0.3.0's llama3 debugmodel cut to 2
blocks (``_torchtitan_two_blocks``: dim 256, 16 heads of 16), 1 sequence of 1,024 tokens, CP 4 on
4 ranks (256 local tokens a rank), no AC, on an H100 (SDPA picks cuDNN attention there).
"""

from __future__ import annotations

import collections

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("torchtitan")

from _torchtitan_small_job import small_step  # noqa: E402

from oomkit.core.target import ParallelLayout, Target  # noqa: E402
from oomkit.errors import OomkitError  # noqa: E402
from oomkit.prediction._torchtitan_env import SUPPORTED_TORCHTITAN, torchtitan_version  # noqa: E402
from oomkit.prediction._torchtitan_ranks import job_layout, job_layout_and_cp  # noqa: E402
from oomkit.prediction.predictor import predict_recording  # noqa: E402
from oomkit.prediction.torchtitan_job import TorchtitanJob, record_torchtitan_job  # noqa: E402
from oomkit.scenario.ranks import distinct_ranks  # noqa: E402

if torchtitan_version() not in SUPPORTED_TORCHTITAN:  # pragma: no cover - another release
    pytest.skip("an unsupported torchtitan is installed", allow_module_level=True)

_CP, _SEQ, _HEADS, _HEAD_DIM = 4, 1024, 16, 16
_LOCAL = _SEQ // _CP  # 256 tokens a rank
_BF16, _FP32 = 2, 4
_OVERRIDES = (
    *small_step(1, _SEQ),
    "--parallelism.context_parallel_degree", str(_CP),
    "activation_checkpoint:none",
)
_SDPA = "aten._scaled_dot_product_cudnn_attention.default"
_SDPA_BACKWARD = "aten._scaled_dot_product_cudnn_attention_backward.default"
_BLOCKS = 2
# one head-major [1, 16, 256, 16] bf16 tensor (a full local query's output, dQ, dK or dV)
_FULL = _HEADS * _LOCAL * _HEAD_DIM * _BF16
_HALF = _FULL // 2
_FULL_LSE, _HALF_LSE = _HEADS * _LOCAL * _FP32, _HEADS * _LOCAL // 2 * _FP32
_FULL_DQ_ACC = _HEADS * _LOCAL * _HEAD_DIM * _FP32  # cuDNN's fp32 dQ accumulator
_HALF_DQ_ACC = _FULL_DQ_ACC // 2
# The backward's one graph workspace on sm90: dQ accumulator, fp32 softmax sum and the engine's
# 256 bytes (emulations/sdpa.py, measured on an H200).
_FULL_WS = _FULL_DQ_ACC + _FULL_LSE + 256
_HALF_WS = _HALF_DQ_ACC + _HALF_LSE + 256


def _job(rank: int) -> TorchtitanJob:
    return TorchtitanJob(
        "_torchtitan_two_blocks", "llama3_debug_two_blocks", _OVERRIDES, world_size=_CP, rank=rank
    )


@pytest.fixture(scope="module")
def recorded():
    """rank -> (recording, prediction) of two train steps, for each of the 4 CP ranks (the
    registry module is on ``sys.path``: tests/prediction/conftest.py), for torch 2.8 on CUDA:
    its RMSNorm is the composite (emulations/rms_norm.py), whose fp32 products leave rank 2
    one segment more; with 2.9's fused RMSNorm this small job's ranks reserve alike."""
    target = Target.resolve("h100", torch_version="2.8.0")
    out = {}
    for rank in range(_CP):
        recording, _ = record_torchtitan_job(_job(rank), target=target)
        out[rank] = (recording, predict_recording(recording, target=target))
    return out


def _allocs(recording, step: int, op: str) -> collections.Counter[int]:
    return collections.Counter(
        e.size for e in recording.step_events(step) if e.action == "alloc" and e.tag("op") == op
    )


@pytest.mark.parametrize("rank", range(_CP))
def test_each_rank_runs_its_own_mix_of_full_and_half_query_steps(recorded, rank):
    """Per block, step 0 and the ``r`` steps with ``i <= r`` attend with the full query (a
    1 x 16 x 256 x 16 bf16 output, a 16 x 256 fp32 log-sum-exp), the ``3 - r`` steps with
    ``i > r`` with its second half (128 tokens)."""
    full_steps, half_steps = 1 + rank, _CP - 1 - rank
    for step in (0, 1):
        forward = _allocs(recorded[rank][0], step, _SDPA)
        got = {size: forward[size] for size in (_FULL, _HALF, _FULL_LSE, _HALF_LSE)}
        assert got == {
            _FULL: _BLOCKS * full_steps, _HALF: _BLOCKS * half_steps,
            _FULL_LSE: _BLOCKS * full_steps, _HALF_LSE: _BLOCKS * half_steps,
        }


@pytest.mark.parametrize("rank", range(_CP))
def test_the_backward_mirrors_the_ring_rule(recorded, rank):
    """Per block: step 0 gives full dQ, dK, dV and a full workspace (its fp32 dQ accumulator
    and softmax sum); each ``i <= r`` step full dQ (and workspace), half dK and dV; each
    ``i > r`` step half dQ (and half workspace), full dK and dV."""
    low, high = rank, _CP - 1 - rank  # steps with i <= r, with i > r (i > 0)
    backward = _allocs(recorded[rank][0], 1, _SDPA_BACKWARD)
    assert {size: backward[size] for size in (_FULL, _HALF, _FULL_WS, _HALF_WS)} == {
        _FULL: _BLOCKS * (3 + low + 2 * high),
        _HALF: _BLOCKS * (2 * low + high),
        _FULL_WS: _BLOCKS * (1 + low),
        _HALF_WS: _BLOCKS * high,
    }


def test_a_middle_cp_rank_reserves_more_than_either_end(recorded):
    """CP rank 2 needs one more 2 MiB segment (18 cudaMallocs against 17), its reserved peak in
    attention's backward: the first and last ranks do not stand for it. Peak allocated is
    within 16,896 bytes on every rank (the cuDNN workspace live at the peak is a full or a half
    one by rank)."""
    allocated = {rank: recorded[rank][1].peak_allocated_bytes for rank in range(_CP)}
    reserved = {rank: recorded[rank][1].peak_reserved_bytes for rank in range(_CP)}
    mallocs = {rank: recorded[rank][1].num_device_alloc for rank in range(_CP)}
    assert allocated == {0: 89_912_832, 1: 89_929_728, 2: 89_929_728, 3: 89_929_728}
    assert reserved == {0: 136_314_880, 1: 136_314_880, 2: 138_412_032, 3: 136_314_880}
    assert reserved[2] - reserved[0] == 2 << 20
    assert mallocs == {0: 17, 1: 17, 2: 18, 3: 17}
    assert max(reserved, key=lambda r: (reserved[r], -r)) not in distinct_ranks(ParallelLayout(fsdp=_CP))


def test_the_jobs_ranks_are_every_cp_rank():
    """The job's layout folds CP into FSDP (fsdp 4) and names CP 4: all 4 ranks are recorded."""
    layout, cp = job_layout_and_cp(_job(0), Target.resolve("h100"))
    assert job_layout(_job(0), Target.resolve("h100")) == layout
    assert (layout, cp) == (ParallelLayout(fsdp=4), 4)
    assert distinct_ranks(layout, cp_in_fsdp=cp) == (0, 1, 2, 3)


@pytest.mark.parametrize(
    ("layout", "cp", "ranks"),
    [
        (ParallelLayout(fsdp=4), 1, (0, 3)),  # no CP: first and last
        (ParallelLayout(fsdp=8), 4, (0, 1, 2, 3, 7)),  # dp_shard 2 x cp 4
        (ParallelLayout(fsdp=4, tp=2), 2, (0, 2, 7)),  # dp_shard 2 x cp 2, CP outside TP
        (ParallelLayout(fsdp=2, pp=2), 2, (0, 1, 2, 3)),  # PP 2 x CP 2
        (ParallelLayout(fsdp=4, pp=2), 2, (0, 1, 3, 4, 5, 7)),
        # the presets' --cp: its own dimension inside FSDP's, the same ring
        (ParallelLayout(cp=4), 1, (0, 1, 2, 3)),
        (ParallelLayout(fsdp=2, cp=4), 1, (0, 1, 2, 3, 7)),
    ],
)
def test_distinct_ranks_with_cp(layout, cp, ranks):
    assert distinct_ranks(layout, cp_in_fsdp=cp) == ranks


@pytest.mark.parametrize(("fsdp", "cp"), [(4, 3), (2, 0), (2, -1), (1, 2)])
def test_a_cp_degree_that_does_not_divide_fsdp_is_refused(fsdp, cp):
    with pytest.raises(OomkitError, match=f"CP degree of {cp} inside an FSDP degree of {fsdp}"):
        distinct_ranks(ParallelLayout(fsdp=fsdp), cp_in_fsdp=cp)


@given(
    pp=st.integers(1, 4), dp=st.integers(1, 3), shard=st.integers(1, 4),
    cp=st.integers(1, 4), tp=st.integers(1, 4),
)
def test_distinct_ranks_cover_the_old_selection_and_each_cp_rank(pp, dp, shard, cp, tp):
    """Unique ranks in the world, the stage-first / FSDP-last ones kept, and per stage exactly
    the CP ranks of its first dp_shard group (CP coordinate c, TP 0) besides."""
    layout = ParallelLayout(fsdp=shard * cp, tp=tp, dp=dp, pp=pp)
    ranks = distinct_ranks(layout, cp_in_fsdp=cp)
    assert len(set(ranks)) == len(ranks)
    assert all(0 <= r < layout.world_size for r in ranks)
    assert set(distinct_ranks(layout)) <= set(ranks)
    inner = layout.world_size // pp
    for stage in range(pp):
        expected = {stage * inner + c * tp for c in range(cp)}
        if layout.fsdp > 1:
            expected.add(stage * inner + inner - 1)
        assert {r for r in ranks if r // inner == stage} == expected

"""torchtitan's own context parallel on the fake group: its mesh, its attention wrapper, torch's ring.

The model is torchtitan 0.3.0's llama3 ``debugmodel`` cut to its first 2 blocks
(``_torchtitan_two_blocks``: 2,753,792 parameters; 16 heads of 16, no grouped K/V), 2 sequences
of 256 tokens, FSDP2 in bf16 (``mixed_precision_param``), no AC, on an H100 (SDPA picks cuDNN
attention there; the ring runs torch's cuDNN ring function). The recordings are shared with the
other modules that record the same jobs (``_torchtitan_recordings``).
"""

from __future__ import annotations

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torchtitan")

from _torchtitan_recordings import recorded_job  # noqa: E402
from _torchtitan_small_job import TWO_BLOCKS, small_step  # noqa: E402

from oomkit.core.target import Target  # noqa: E402
from oomkit.errors import ConfigError  # noqa: E402
from oomkit.prediction._torchtitan_cp import CP_NOTE  # noqa: E402
from oomkit.prediction._torchtitan_env import SUPPORTED_TORCHTITAN, torchtitan_version  # noqa: E402
from oomkit.prediction.torchtitan_job import TorchtitanJob, record_torchtitan_job  # noqa: E402

if torchtitan_version() not in SUPPORTED_TORCHTITAN:  # pragma: no cover - another release
    pytest.skip("an unsupported torchtitan is installed", allow_module_level=True)

# 2 x 2048 x 256 (embedding, LM head) + 2 blocks of 852,480 + the 256 final norm
_BLOCKS = 2
_PARAMETERS = 2 * 2048 * 256 + _BLOCKS * 852_480 + 256
_BATCH, _SEQ, _HEADS, _HEAD_DIM, _BF16 = 2, 256, 16, 16, 2
_BASE = small_step(_BATCH, _SEQ)
_NO_AC = ("activation_checkpoint:none",)
_ALL_GATHER = "_c10d_functional.all_gather_into_tensor.default"


def _job(world_size: int, *extra: str) -> TorchtitanJob:
    return TorchtitanJob(*TWO_BLOCKS, _BASE + extra + _NO_AC, world_size=world_size)


@pytest.fixture(scope="module")
def recorded():
    """(label) -> (recording, run, prediction): CP 2 alone, FSDP 2 alone (the same 2 ranks)."""
    return {
        "cp2": recorded_job(_job(2, "--parallelism.context_parallel_degree", "2")),
        "fsdp2": recorded_job(_job(2)),
    }


def _allocs(recording, op: str) -> collections.Counter[int]:
    return collections.Counter(
        e.size for e in recording.events if e.action == "alloc" and dict(e.tags).get("op") == op
    )


def test_cp_alone_shards_the_parameters_over_the_cp_ranks(recorded):
    """torchtitan's fsdp mesh is dp_shard x cp: CP 2 alone holds half of every fp32 parameter."""
    recording, run, _ = recorded["cp2"]
    before = collections.Counter()
    for event in recording.events[: recording.step_starts[0]]:
        if event.action == "alloc":
            before[dict(event.tags)["category"]] += event.size
    assert before["parameter"] == _PARAMETERS * 4 // 2
    assert run.layout["cp"] == 2 and run.layout["dp_shard"] == 1


def test_the_ring_all_gathers_each_blocks_k_and_v_over_the_cp_mesh(recorded):
    """torch's _AllGatherRotater: K and V of this rank's 128 tokens, concatenated, gathered from
    both CP ranks (bf16), once in each block's forward and once in its backward, two steps."""
    recording, _, _ = recorded["cp2"]
    local_kv_bytes = 2 * _BATCH * (_SEQ // 2) * _HEADS * _HEAD_DIM * _BF16
    assert _allocs(recording, _ALL_GATHER) == {2 * local_kv_bytes: _BLOCKS * 2 * 2}


def test_the_ring_runs_the_fused_kernel_the_gpu_picks_on_local_queries(recorded):
    """SDPA on the CP DTensors is the fused op the H100 picks (cuDNN), run on the local shard:
    the whole local query (128 tokens, bf16) and, under head-tail balancing, its half."""
    recording, _, _ = recorded["cp2"]
    outputs = _allocs(recording, "aten._scaled_dot_product_cudnn_attention.default")
    local_out = _BATCH * _HEADS * (_SEQ // 2) * _HEAD_DIM * _BF16
    assert outputs[local_out] > 0 and outputs[local_out // 2] > 0
    assert max(outputs) == local_out  # never the whole 256-token sequence
    assert not _allocs(recording, "aten._scaled_dot_product_flash_attention_for_cpu.default")


def test_cp_holds_fewer_activations_than_fsdp_on_the_same_ranks(recorded):
    """The same parameter shards (both halve them), half the tokens a rank: a lower peak."""
    cp = recorded["cp2"][2].peak_allocated_bytes
    fsdp = recorded["fsdp2"][2].peak_allocated_bytes
    assert cp < fsdp


def test_the_recording_says_how_cp_ran(recorded):
    recording, run, _ = recorded["cp2"]
    assert CP_NOTE in recording.warnings
    assert "cp 2" in run.description


def test_torchs_cp_dispatcher_is_put_back_after_the_job(recorded):
    """torchtitan enables torch's CP dispatcher and never resets it; the route does."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental._context_parallel import _attention

    assert DTensor._op_dispatcher._custom_op_handlers is _attention.existing_custom_ops


def test_torchs_cp_globals_are_put_back_as_they_were():
    """What torchtitan's CP sets (the dispatcher, the load-balance switch, the dispatch mode)
    is put back to what it was, whatever that was."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental._context_parallel import _attention

    from oomkit.prediction._torchtitan_cp import torch_cp_state_kept

    options = _attention._cp_options
    saved = options.enable_load_balance, _attention._dispatch_mode
    try:
        options.enable_load_balance = False
        handlers = DTensor._op_dispatcher._custom_op_handlers
        with torch_cp_state_kept():
            _attention._enable_context_parallel_dispatcher()
            options.enable_load_balance = True
            _attention._dispatch_mode = _attention._DispatchMode.MODULE_WRAPPER
            assert DTensor._op_dispatcher._custom_op_handlers is not handlers
        assert DTensor._op_dispatcher._custom_op_handlers is handlers
        assert (options.enable_load_balance, _attention._dispatch_mode) == (False, saved[1])
    finally:
        options.enable_load_balance, _attention._dispatch_mode = saved


def test_a_sequence_the_head_tail_balancer_cannot_split_is_refused():
    """trainer.py: seq_len divides by 2 x CP (two chunks a rank); 250 is not a multiple of 4."""
    job = TorchtitanJob(
        "llama3", "debugmodel",
        (*_BASE, "--training.seq_len", "250", "--parallelism.context_parallel_degree", "2"),
        world_size=2,
    )
    with pytest.raises(ConfigError, match="must divide by 4 .* use --training.seq_len 248"):
        record_torchtitan_job(job, target=Target.resolve("h100"))


@settings(max_examples=60, deadline=None)
@given(
    seq=st.integers(1, 1 << 18), cp=st.integers(1, 16), tp=st.integers(1, 8), sp=st.booleans()
)
def test_check_seq_len_refuses_exactly_what_the_trainer_refuses(seq, cp, tp, sp):
    """trainer.py:306-314: seq_len must divide by (TP under sequence parallel) x (2 x CP under
    CP); a refusal's suggested length divides and is the largest one not above seq (or the
    divisor itself)."""
    import re
    import types

    from oomkit.prediction._torchtitan_cp import check_seq_len

    divisor = (tp if sp else 1) * (2 * cp if cp > 1 else 1)
    dims = types.SimpleNamespace(cp=cp, tp=tp)
    if seq % divisor == 0:
        check_seq_len(dims, seq, sp)
        return
    with pytest.raises(ConfigError, match=f"must divide by {divisor} ") as caught:
        check_seq_len(dims, seq, sp)
    suggested = int(re.search(r"--training.seq_len (\d+)", str(caught.value)).group(1))
    assert suggested % divisor == 0
    assert suggested == max(divisor, seq // divisor * divisor)

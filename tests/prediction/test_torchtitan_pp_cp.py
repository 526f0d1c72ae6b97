"""torchtitan's pipeline parallel with context parallel, and the first step's shape inference.

The model is torchtitan 0.3.0's llama3 ``debugmodel`` cut to 2 blocks, a registry module of
one's own (``_torchtitan_two_blocks:llama3_debug_two_blocks`` in tests/prediction):
dim 256, 16 heads of 16, vocabulary 2048. PP 2 with 1F1B gives stage 0 the embedding and block
0, stage 1 block 1, the norm and the LM head (torchtitan's split counts the embedding and the
head as a block each). Local batch 2 x 512 tokens in micro-batches of 1 (2 micro-batches), FSDP2
computing in bf16 (what the stages pass), no AC, the plain cross-entropy over the full logits
(``loss="cross_entropy"``, as 2024's torchtitan and the pipeline rows: one log-softmax a
micro-batch, where 0.3.0's chunked loss runs 8 chunks' worth of ops for the same tokens, and
nothing asserted here is about the loss's chunks), on an H100 (SDPA picks cuDNN attention there).
PP 2 x CP 2 on 4 ranks: ranks 0 and 1 run stage 0 (CP ranks 0 and 1), ranks 2 and 3 stage 1.
"""

from __future__ import annotations

import collections
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torchtitan")

from _torchtitan_small_job import small_step  # noqa: E402

from oomkit.core.target import Target  # noqa: E402
from oomkit.prediction._torchtitan_env import SUPPORTED_TORCHTITAN, torchtitan_version  # noqa: E402
from oomkit.prediction._torchtitan_pipeline import pickled_bytes  # noqa: E402
from oomkit.prediction.predictor import predict_recording  # noqa: E402
from oomkit.prediction.torchtitan_job import TorchtitanJob, record_torchtitan_job  # noqa: E402

if torchtitan_version() not in SUPPORTED_TORCHTITAN:  # pragma: no cover - another release
    pytest.skip("an unsupported torchtitan is installed", allow_module_level=True)

_MICRO, _SEQ, _DIM, _HEADS, _HEAD_DIM, _VOCAB = 1, 512, 256, 16, 16, 2048
_INT64, _BF16, _FP32 = 8, 2, 4
_BASE = (
    *small_step(2, _SEQ),
    "--parallelism.pipeline_parallel_degree", "2",
    "--parallelism.pipeline_parallel_schedule", "1F1B",
)
_CP2 = ("--parallelism.context_parallel_degree", "2")
_NO_AC = ("activation_checkpoint:none",)
_SDPA = "aten._scaled_dot_product_cudnn_attention.default"


@pytest.fixture(scope="module")
def recorded():
    """(cp, rank) -> (recording, run, prediction) of two train steps: PP 2 alone on 2 ranks
    (ranks 0 and 1) and PP 2 x CP 2 on 4 (ranks 0, 1 and 3)."""
    target = Target.resolve("h100")
    out = {}
    for cp, world, ranks in ((1, 2, (0, 1)), (2, 4, (0, 1, 3))):
        for rank in ranks:
            job = TorchtitanJob(
                "_torchtitan_two_blocks", "llama3_debug_two_blocks", _BASE + (_CP2 if cp > 1 else ()) + _NO_AC,
                world_size=world, rank=rank, loss="cross_entropy",
            )
            recording, run = record_torchtitan_job(job, target=target)
            out[(cp, rank)] = (recording, run, predict_recording(recording, target=target))
    return out


def _allocs(recording, step: int, op: str, category: str | None = None) -> collections.Counter[int]:
    """Sizes (bytes) of the step's allocations by ``op`` (and category), with their counts."""
    return collections.Counter(
        e.size for e in recording.step_events(step)
        if e.action == "alloc" and e.tag("op") == op
        and (category is None or e.tag("category") == category)
    )


def test_pp_with_cp_records_each_stage_on_its_cp_ranks(recorded):
    """CP 2 x PP 2 is recorded (no longer refused): ranks 0 and 1 run stage 0, rank 3 stage 1,
    and the layout names both degrees."""
    for rank, stage in ((0, "stage 0 (tok_embeddings, layer 0)"), (1, "stage 0 (tok_embeddings, layer 0)"),
                        (3, "stage 1 (layer 1, norm, lm_head)")):
        run = recorded[(2, rank)][1]
        assert f"this rank runs {stage}" in run.description
        assert run.layout == {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 2, "cp": 2}
    assert any("context parallel" in w for w in recorded[(2, 0)][0].warnings)


@pytest.mark.parametrize("step", [0, 1])
def test_the_first_stage_takes_each_micro_batch_cut_to_its_cp_half(recorded, step):
    """post_dataloading_process -> prepare_context_parallel_input per micro-batch: stage 0's
    token ids are 1 x 256 int64 (2,048 bytes) a micro-batch under CP 2, the loader's own
    1 x 512 (4,096 bytes) without CP; its embedding outputs 1 x 256 (512) x 256 in bf16."""
    cp_half = _MICRO * _SEQ // 2 * _INT64
    assert _allocs(recorded[(2, 0)][0], step, "aten.clone.default", "input") == {cp_half: 2} == {2048: 2}
    assert _allocs(recorded[(1, 0)][0], step, "aten.zeros.default", "input") == {2 * cp_half: 2}
    # step 0 runs the stage on micro-batch 0 once more: the shape inference's forward
    forwards = 3 if step == 0 else 2
    embedded = _MICRO * _SEQ // 2 * _DIM * _BF16
    assert _allocs(recorded[(2, 0)][0], step, "aten.embedding.default") == {embedded: forwards}
    assert _allocs(recorded[(1, 0)][0], step, "aten.embedding.default") == {2 * embedded: forwards}


def test_the_last_stage_receives_cp_sharded_hidden_states(recorded):
    """Stage 1 allocates its receive buffers for the 2 micro-batches in the first step (stage.py
    _setup_forward_recv_info) and one more input for the shape inference's forward
    (TensorMeta.to_tensor): 1 x 256 x 256 bf16 under CP 2, twice that without; none after."""
    hidden = _MICRO * (_SEQ // 2) * _DIM * _BF16
    assert _allocs(recorded[(2, 3)][0], 0, "aten.empty_strided.default", "input") == {hidden: 3} == {131_072: 3}
    assert _allocs(recorded[(1, 1)][0], 0, "aten.empty_strided.default", "input") == {2 * hidden: 3}
    assert _allocs(recorded[(2, 3)][0], 1, "aten.empty_strided.default", "input") == {}


def test_the_shape_inference_runs_once_with_its_metadata_on_the_device(recorded):
    """The first step's metadata inference on stage 0 (stage.py _forward_metadata_inference,
    _backward_metadata_inference): it sends its output metadata and receives the input
    gradients' metadata as device tensors (send_object_list / recv_object_list: the pickled
    object, its int64 size, and on the send a torch.cat of that size), and builds a ones
    gradient of its 1 x 256 x 256 bf16 output; the second step runs none of it."""
    import torch
    from torch.distributed.pipelining._utils import (
        _StageBackwardMeta,
        _StageForwardMeta,
        _TensorMeta,
    )

    shape = torch.Size([_MICRO, _SEQ // 2, _DIM])
    stride = (_SEQ // 2 * _DIM, _DIM, 1)
    sent = _StageForwardMeta((_TensorMeta(shape, stride, torch.bfloat16, True),))
    received = _StageBackwardMeta((_TensorMeta(shape, stride, torch.bfloat16, False),))
    recording = recorded[(2, 0)][0]
    payloads = _allocs(recording, 0, "aten.empty.memory_format", "temporary")
    assert payloads[pickled_bytes(sent)] == 1 and payloads[pickled_bytes(received)] == 1
    assert payloads[_INT64] == 2  # the size sent, the size received
    assert _allocs(recording, 0, "aten.cat.default")[_INT64] == 1
    assert _allocs(recording, 0, "aten.ones.default") == {int(shape.numel()) * _BF16: 1}
    for op in ("aten.ones.default", "aten.cat.default"):
        assert _allocs(recording, 1, op)[_INT64 if op == "aten.cat.default" else 131_072] == 0
    assert pickled_bytes(sent) not in _allocs(recording, 1, "aten.empty.memory_format")


def test_the_last_stage_computes_one_more_loss_in_the_first_step(recorded):
    """Stage 1's shape inference computes micro-batch 0's loss (the cross-entropy's fp32 log-
    softmax over its 256 tokens (CP half) x 2048 logits, one a micro-batch): 3 in step 0 (the
    2 micro-batches and the inference's), 2 in step 1."""
    recording = recorded[(2, 3)][0]
    log_softmax = _MICRO * (_SEQ // 2) * _VOCAB * _FP32
    first = _allocs(recording, 0, "aten._log_softmax.default")
    second = _allocs(recording, 1, "aten._log_softmax.default")
    assert (first, second) == ({log_softmax: 3}, {log_softmax: 2}) == ({2_097_152: 3}, {2_097_152: 2})
    assert sum(first.values()) * 2 == sum(second.values()) * 3


def test_cp_ranks_of_a_stage_differ_by_the_load_balanced_ring(recorded):
    """torch's ring attention with the head-tail balancer: at the ring's second step CP rank 0
    attends with the second half of its queries (128 tokens: a 1 x 16 x 128 x 16 bf16 output
    and 1 x 16 x 128 fp32 log-sum-exp), CP rank 1 with all 256 against the first half of the
    keys; the first step is causal over the 256 local tokens on both. So the two ranks of
    stage 0 record different SDPA outputs and different peaks."""
    full_out, full_lse = _HEADS * 256 * _HEAD_DIM * _BF16, _HEADS * 256 * _FP32
    half_out, half_lse = full_out // 2, full_lse // 2
    for step, forwards in ((0, 3), (1, 2)):
        rank0 = _allocs(recorded[(2, 0)][0], step, _SDPA, "temporary")
        rank1 = _allocs(recorded[(2, 1)][0], step, _SDPA, "temporary")
        assert {size: rank0[size] for size in (full_out, half_out, full_lse, half_lse)} == {
            full_out: forwards, half_out: forwards, full_lse: forwards, half_lse: forwards,
        }
        assert {size: rank1[size] for size in (full_out, half_out, full_lse, half_lse)} == {
            full_out: 2 * forwards, half_out: 0, full_lse: 2 * forwards, half_lse: 0,
        }
    assert recorded[(2, 0)][2].peak_allocated_bytes != recorded[(2, 1)][2].peak_allocated_bytes


def test_cp_lowers_each_stage_peak(recorded):
    """Half the tokens a rank: both stages' peak allocated drop under CP 2."""
    for cp_rank, rank in ((0, 0), (3, 1)):
        assert recorded[(2, cp_rank)][2].peak_allocated_bytes < recorded[(1, rank)][2].peak_allocated_bytes


def test_the_warnings_say_the_shape_inference_is_recorded(recorded):
    """The pipeline note names the first step's metadata inference as recorded."""
    assert any("metadata inference" in w and "recorded as on a GPU" in w for w in recorded[(1, 0)][0].warnings)


_SHAPES = st.lists(st.integers(1, 1 << 20), min_size=1, max_size=4)
_DTYPES = st.sampled_from(["bfloat16", "float32", "int64", "float8_e4m3fn"])


@settings(max_examples=60, deadline=None)
@given(shapes=st.lists(st.tuples(_SHAPES, _DTYPES, st.booleans()), min_size=1, max_size=3),
       forward=st.booleans())
def test_the_emulated_payload_is_what_send_object_list_moves(shapes, forward):
    """pickled_bytes(meta) is the byte count of torch's own _object_to_tensor(meta) (the device
    tensor send_object_list sends and recv_object_list allocates), for any stage metadata."""
    import torch
    from torch.distributed.distributed_c10d import _object_to_tensor
    from torch.distributed.pipelining._utils import (
        _StageBackwardMeta,
        _StageForwardMeta,
        _TensorMeta,
    )

    metas = []
    for dims, dtype, grad in shapes:
        size = torch.Size(dims)
        stride = tuple(math.prod(dims[i + 1:]) for i in range(len(dims)))
        metas.append(_TensorMeta(size, stride, getattr(torch, dtype), grad))
    meta = _StageForwardMeta(tuple(metas)) if forward else _StageBackwardMeta(tuple(metas))
    byte_tensor, size = _object_to_tensor(meta, torch.device("cpu"), None)
    assert pickled_bytes(meta) == byte_tensor.numel() == int(size.item())


class _Stage:
    def __init__(self) -> None:
        self.has_backward = None
        self.cleared = 0

    def clear_runtime_states(self) -> None:
        self.cleared += 1


def test_the_schedule_runs_the_cut_micro_batches_without_splitting_them():
    """torch 2.13's step splits a whole batch; _schedule_step runs its body on the micro-batches
    given: each stage's has_backward set and state cleared, then _step_microbatches with them,
    no outputs returned."""
    from oomkit.prediction._torchtitan_pipeline import _schedule_step

    class Multi:
        _has_backward = True

        def __init__(self) -> None:
            self._stages = [_Stage(), _Stage()]
            self.calls: list[tuple] = []

        def step(self, *args, target=None, losses=None, return_outputs=True, loss_kwargs=None, **kwargs):
            raise AssertionError("the whole-batch step must not run")

        def _step_microbatches(self, arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=None):
            self.calls.append((arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs))

    schedule = Multi()
    args, kwargs, targets, losses = [("a",), ("b",)], [{"positions": 1}, {"positions": 2}], ["t0", "t1"], []
    _schedule_step(schedule, args, kwargs, targets, losses, {"global_valid_tokens": 7})
    assert schedule.calls == [(args, kwargs, targets, losses, False, {"global_valid_tokens": 7})]
    assert [(s.has_backward, s.cleared) for s in schedule._stages] == [(True, 1), (True, 1)]


def test_a_schedule_that_takes_micro_batches_is_called_as_torchtitan_calls_it():
    """A torch whose step takes arg_mbs / kwarg_mbs / target_mbs gets torchtitan 0.3.0's call
    (trainer.py pp_forward_backward_step) as it is."""
    from oomkit.prediction._torchtitan_pipeline import _schedule_step

    calls: list[dict] = []

    class Newer:
        def step(self, *, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None,
                 loss_kwargs=None, return_outputs=True):
            calls.append(dict(arg_mbs=arg_mbs, kwarg_mbs=kwarg_mbs, target_mbs=target_mbs,
                              losses=losses, loss_kwargs=loss_kwargs, return_outputs=return_outputs))

    _schedule_step(Newer(), None, [{}], None, None, {"global_valid_tokens": 3})
    assert calls == [dict(arg_mbs=None, kwarg_mbs=[{}], target_mbs=None, losses=None,
                          loss_kwargs={"global_valid_tokens": 3}, return_outputs=False)]

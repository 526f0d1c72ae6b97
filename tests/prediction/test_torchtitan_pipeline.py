"""torchtitan's own pipeline parallel (``pipeline_llm`` and its schedule) on the fake group.

The recorded jobs run torchtitan 0.3.0's llama3 ``debugmodel`` cut to its first 2 blocks
(``_torchtitan_two_blocks``: 2 blocks of 852,480 parameters, a 2048 x 256 embedding and LM
head, a 256 final norm) in fp32; the refused split below is the whole 6-block ``debugmodel``.
torchtitan's split (pipeline_parallel.py ``_generate_llm_fqn_per_model_part``) counts the
embedding and the norm + LM head as one block each: 2 stages of 2 weighted blocks give stage 0
the embedding and block 0, stage 1 block 1, the norm and the LM head; 4 stages
(Interleaved1F1B, 2 a rank) of 1 give stage 0 the embedding, stage 1 block 0, stage 2 block 1,
stage 3 the norm and head, and rank 0 runs stages 0 and 2. (The split of 6 blocks into
``layers 0-2`` and ``layers 3-5`` is test_torchtitan_rows_stages.py's.)
"""

from __future__ import annotations

import collections
import copy

import pytest

pytest.importorskip("torchtitan")

from _torchtitan_recordings import recorded_job  # noqa: E402
from _torchtitan_small_job import TWO_BLOCKS, small_step  # noqa: E402

from oomkit.core.target import Target  # noqa: E402
from oomkit.errors import OomkitError  # noqa: E402
from oomkit.prediction._torchtitan_env import SUPPORTED_TORCHTITAN, torchtitan_version  # noqa: E402
from oomkit.prediction._torchtitan_pipeline import copies_keep_the_fake_mode  # noqa: E402
from oomkit.prediction.torchtitan_job import TorchtitanJob, record_torchtitan_job  # noqa: E402

if torchtitan_version() not in SUPPORTED_TORCHTITAN:  # pragma: no cover - another release
    pytest.skip("an unsupported torchtitan is installed", allow_module_level=True)

_BLOCK = 852_480
_EMBEDDING = 2048 * 256  # and the LM head
_NORM = 256
_NORMS_PER_BLOCK = 2 * 256  # replicated over TP
_FP32 = 4
_BASE = small_step(4, 512)
_PP2 = ("--parallelism.pipeline_parallel_degree", "2")
_NO_AC = ("activation_checkpoint:none",)
# the debugmodel's config runs Interleaved1F1B unless told
_1F1B = ("--parallelism.pipeline_parallel_schedule", "1F1B")
_INTERLEAVED = ("--parallelism.pipeline_parallel_schedule", "Interleaved1F1B")


def _bytes_by_category(events) -> dict[str, int]:
    found: collections.Counter[str] = collections.Counter()
    for event in events:
        if event.action == "alloc":
            found[dict(event.tags)["category"]] += event.size
    return dict(found)


@pytest.fixture(scope="module")
def recorded():
    """(name, rank) -> (recording, run, prediction) of the 2-block jobs' two train steps on an
    H100; of one for FSDP 2 and TP 2, whose tests read the parameter shards only (made before
    the first step)."""
    jobs = {
        "1f1b": (2, _1F1B, 2),
        "interleaved": (2, _INTERLEAVED, 2),
        "fsdp2": (4, (*_1F1B, "--parallelism.data_parallel_shard_degree", "2"), 1),
        "tp2": (4, (*_1F1B, "--parallelism.tensor_parallel_degree", "2"), 1),
    }
    ranks = {"1f1b": (0, 1), "interleaved": (0,), "fsdp2": (0, 2), "tp2": (0,)}
    out = {}
    for name, (world, extra, steps) in jobs.items():
        for rank in ranks[name]:
            job = TorchtitanJob(*TWO_BLOCKS, _BASE + _PP2 + extra + _NO_AC, world_size=world, rank=rank)
            out[(name, rank)] = recorded_job(job, steps=steps)
    return out


def _parameters(recorded, key) -> int:
    recording = recorded[key][0]
    return _bytes_by_category(recording.events[: recording.step_starts[0]])["parameter"]


def test_1f1b_each_rank_holds_its_stage_blocks(recorded):
    """PP 2, 1F1B: rank 0 the embedding + block 0, rank 1 block 1 + norm + LM head."""
    assert _parameters(recorded, ("1f1b", 0)) == (_EMBEDDING + _BLOCK) * _FP32 == 5_507_072
    assert _parameters(recorded, ("1f1b", 1)) == (_BLOCK + _NORM + _EMBEDDING) * _FP32 == 5_508_096
    assert "rank 0 of 2" in recorded[("1f1b", 0)][1].description
    assert "1F1B over 2 ranks, 4 micro-batches of 1: this rank runs stage 0 (tok_embeddings, layer 0)" in (
        recorded[("1f1b", 0)][1].description
    )
    assert "stage 1 (layer 1, norm, lm_head)" in recorded[("1f1b", 1)][1].description
    assert recorded[("1f1b", 1)][1].layout == {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 2}


def test_1f1b_first_stage_keeps_more_micro_batches_in_flight(recorded):
    """1F1B on 2 ranks: stage 0 runs 2 forwards before its first backward, stage 1 one, so rank
    0's activations at its peak exceed rank 1's though rank 1 also holds the logits."""
    first = recorded[("1f1b", 0)][2].peak_allocated_at.by_category_bytes["activation"]
    last = recorded[("1f1b", 1)][2].peak_allocated_at.by_category_bytes["activation"]
    assert first > last


def test_interleaved_rank_0_runs_stages_0_and_2(recorded):
    """Interleaved1F1B: 4 stages, rank 0 runs stage 0 (the embedding) and 2 (block 1)."""
    _, run, predicted = recorded[("interleaved", 0)]
    assert "stage 0 (tok_embeddings); stage 2 (layer 1)" in run.description
    assert _parameters(recorded, ("interleaved", 0)) == (_EMBEDDING + _BLOCK) * _FP32
    assert predicted.peak_allocated_bytes != recorded[("1f1b", 0)][2].peak_allocated_bytes


def test_fsdp2_halves_each_stage(recorded):
    """FSDP 2 x PP 2 on 4 ranks: ranks 0 and 2 run stages 0 and 1, each half of its blocks."""
    assert _parameters(recorded, ("fsdp2", 0)) == (_EMBEDDING + _BLOCK) * _FP32 // 2 == 2_753_536
    assert _parameters(recorded, ("fsdp2", 2)) == (_BLOCK + _NORM + _EMBEDDING) * _FP32 // 2 == 2_754_048


def test_tp2_shards_the_stage_but_its_norms(recorded):
    """TP 2 x PP 2: the stages pass DTensors (given with their gradients); rank 0 holds half of
    stage 0 but its block's norms whole."""
    norms = _NORMS_PER_BLOCK
    expected = ((_EMBEDDING + _BLOCK - norms) // 2 + norms) * _FP32
    assert _parameters(recorded, ("tp2", 0)) == expected == 2_754_560


def test_the_steady_state_is_said(recorded):
    """The warnings say the first step's metadata inference is not recorded."""
    assert any("metadata inference" in w for w in recorded[("1f1b", 0)][0].warnings)


def test_fake_tensors_deep_copied_keep_their_mode():
    """torch/_tensor.py Tensor.__deepcopy__ copies a FakeTensor's __dict__ (its fake_mode):
    a copy made while the split runs keeps the active mode; one made without does not."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        module = torch.nn.Linear(4, 4)
        plain = copy.deepcopy(module)
        with copies_keep_the_fake_mode():
            kept = copy.deepcopy(module)
    assert module.weight.fake_mode is mode
    assert plain.weight.fake_mode is not mode
    assert kept.weight.fake_mode is mode
    assert "__deepcopy__" not in vars(FakeTensorMode)


def test_a_split_torchtitan_refuses_is_a_config_error():
    """8 stages of 6 blocks (+ 2 weights) leave stages of 1: 1F1B on 8 ranks is fine, but
    Interleaved1F1B (16 stages) is refused with torchtitan's words."""
    job = TorchtitanJob(
        "llama3", "debugmodel",
        (*_BASE, "--parallelism.pipeline_parallel_degree", "8", *_INTERLEAVED),
        world_size=8,
    )
    with pytest.raises(OomkitError, match="Number of stages \\(16\\) cannot be greater than effective layers \\(8\\)"):
        record_torchtitan_job(job, target=Target.resolve("h100"))


def test_a_wrong_stage_shape_is_caught_by_the_stage(monkeypatch):
    """The shapes given up front are checked against what each stage passes (stage.py
    _validate_stage_tensors): hidden states of the wrong sequence length fail the step."""
    from oomkit.prediction import _torchtitan_pipeline as pipelined

    real = pipelined._stage_shapes

    def wrong(config, parallel_dims, skip_lm_head):
        shapes = real(config, parallel_dims, skip_lm_head)

        def shorter(stage_index, num_stages):
            given = shapes(stage_index, num_stages)
            (out,) = given["output_args"]
            given["output_args"] = (out[:, : out.shape[1] // 2].detach().requires_grad_(),)
            return given

        return shorter

    monkeypatch.setattr(pipelined, "_stage_shapes", wrong)
    job = TorchtitanJob(*TWO_BLOCKS, _BASE + _PP2 + _1F1B + _NO_AC, world_size=2)
    with pytest.raises(OomkitError, match=r"Stage 0 forward outputs\[0\]: shape mismatch"):
        record_torchtitan_job(job, target=Target.resolve("h100"))

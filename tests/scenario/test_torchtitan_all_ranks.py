"""``--all-ranks`` with ``--torchtitan``: each distinct rank of the job, the peak named.

The ranks are picked as the preset route picks them (``scenario/ranks.py`` ``distinct_ranks``:
per pipeline stage its first rank and, where FSDP2 shards, its last), from the job's own
parallel degrees (torchtitan's ``ParallelDims.from_config``). The job: torchtitan 0.3.0's llama3
``debugmodel`` cut to its first 4 blocks (``_torchtitan_four_blocks``: 2 blocks a stage, so that
stage 0's two micro-batches in flight out-weigh stage 1's logits), 4 sequences of 512 tokens,
1F1B over 2 stages, no AC.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

pytest.importorskip("torchtitan")

from _torchtitan_recordings import recorded_job  # noqa: E402

import oomkit  # noqa: E402
from oomkit.core.target import ParallelLayout, Target  # noqa: E402
from oomkit.errors import ConfigError  # noqa: E402
from oomkit.prediction._torchtitan_ranks import job_layout  # noqa: E402
from oomkit.prediction.torchtitan_job import TorchtitanJob  # noqa: E402
from oomkit.scenario.model import Scenario  # noqa: E402

# (module, config) of the job: the debugmodel's first 4 blocks (tests/_torchtitan_four_blocks.py)
_FOUR_BLOCKS = ("_torchtitan_four_blocks", "llama3_debug_four_blocks")
_OVERRIDES = (
    "--parallelism.spmd_backend", "partial_dtensor",
    "--training.local_batch_size", "4",
    "--training.seq_len", "512",
    "--training.disable_cuda_graphs",
    "--parallelism.pipeline_parallel_degree", "2",
    "--parallelism.pipeline_parallel_schedule", "1F1B",
    "activation_checkpoint:none",
)


def _scenario(**parallel: object) -> Scenario:
    return Scenario.model_validate({
        "torchtitan": {"job": ":".join(_FOUR_BLOCKS), "world_size": 2, "overrides": list(_OVERRIDES)},
        "parallel": parallel,
        "target": {"gpu": "h100"},
        "run": {"steps": 2},
    })


def test_all_ranks_is_the_jobs_with_torchtitan():
    """--all-ranks (parallel.all_ranks) lands on the job, as --rank does; no preset layout."""
    scenario = _scenario(all_ranks=True)
    assert scenario.torchtitan is not None and scenario.torchtitan.all_ranks
    assert scenario.parallel is None


def test_a_rank_and_all_ranks_together_are_refused():
    with pytest.raises(ValidationError, match="--rank R and --all-ranks exclude each other"):
        _scenario(all_ranks=True, rank=1)


@pytest.mark.parametrize(
    ("world", "extra", "layout"),
    [
        # PP outermost, then dp_shard: the FSDP degree fills the rest (-1 in the config)
        (4, ("--parallelism.pipeline_parallel_degree", "2"), ParallelLayout(fsdp=2, pp=2)),
        # torchtitan's fsdp mesh is dp_shard x cp: 2 x 2
        (8, ("--parallelism.context_parallel_degree", "2", "--parallelism.tensor_parallel_degree",
             "2"), ParallelLayout(fsdp=4, tp=2)),
        (4, ("--parallelism.data_parallel_replicate_degree", "2"), ParallelLayout(fsdp=2, dp=2)),
    ],
)
def test_the_layout_is_the_jobs_own_degrees(world, extra, layout):
    job = TorchtitanJob(
        "llama3", "debugmodel", ("--training.disable_cuda_graphs", *extra), world_size=world
    )
    assert job_layout(job, Target.resolve("h100")) == layout


def test_degrees_that_do_not_fill_the_world_are_refused():
    job = TorchtitanJob(
        "llama3", "debugmodel",
        ("--parallelism.tensor_parallel_degree", "3", "--parallelism.data_parallel_shard_degree", "1"),
        world_size=4,
    )
    with pytest.raises(ConfigError, match="refused the parallel layout on 4 ranks"):
        job_layout(job, Target.resolve("h100"))


def test_each_stage_is_predicted_and_the_peak_is_named():
    """Both stages of the 1F1B job, each the bytes of its own --rank prediction; stage 0 keeps
    two micro-batches in flight (1F1B's warm-up) and peaks."""
    prediction = oomkit.predict(_scenario(all_ranks=True))
    peaks = {p["rank"]: p for p in prediction.rank_peaks}
    assert sorted(peaks) == [0, 1] and [peaks[r]["stage"] for r in (0, 1)] == [0, 1]
    # rank 1 recorded alone (through ``recorded_job``, once per process for any module that
    # records this job)
    _, _, rank_1 = recorded_job(TorchtitanJob(*_FOUR_BLOCKS, _OVERRIDES, world_size=2, rank=1))
    assert peaks[1]["peak_allocated_bytes"] == rank_1.peak_allocated_bytes
    assert peaks[1]["peak_reserved_bytes"] == rank_1.peak_reserved_bytes
    assert peaks[0]["peak_allocated_bytes"] > peaks[1]["peak_allocated_bytes"]
    assert prediction.peak_allocated_bytes == peaks[0]["peak_allocated_bytes"]
    assert "rank 0 of 2" in prediction.description

"""A torchtitan job's parallel layout, read from its own config, to pick the ranks that differ.

``--all-ranks`` with ``--torchtitan`` predicts each distinct rank of the job
(``scenario/ranks.py`` ``distinct_ranks``: per pipeline stage its first rank and, where FSDP2
shards, its last). The degrees are torchtitan's own: ``ParallelDims.from_config`` (torchtitan/
distributed/parallel_dims.py, which fills ``data_parallel_shard_degree = -1`` from the world
size and checks that the degrees fill it), before any mesh is built. Under context parallel
each CP rank of a stage's first ``dp_shard`` group is recorded too (``job_layout_and_cp``: the
load-balanced ring gives CP ranks different shapes, ``distinct_ranks``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from oomkit.core.target import ParallelLayout
from oomkit.errors import ConfigError
from oomkit.prediction._torchtitan_env import cuda_capability, import_torchtitan
from oomkit.prediction.torchtitan_job import TorchtitanJob, load_job_config

if TYPE_CHECKING:
    from oomkit.core.target import Target

__all__ = ["job_layout", "job_layout_and_cp"]


def job_layout(job: TorchtitanJob, target: Target) -> ParallelLayout:
    """The job's layout as ``ParallelLayout`` degrees, in torchtitan's mesh order (``pp``,
    ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``, outermost first, as ``mesh_shape``).

    FSDP2 shards over torchtitan's ``fsdp`` mesh, ``dp_shard x cp`` (``build_mesh``), so that
    product is the layout's FSDP degree (its last rank holds the shortest shards); CP is then 1.

    Raises:
        ConfigError: the job's config, or degrees that do not fill the world size.
    """
    return job_layout_and_cp(job, target)[0]


def job_layout_and_cp(job: TorchtitanJob, target: Target) -> tuple[ParallelLayout, int]:
    """``job_layout`` and the CP degree folded into its FSDP degree: what
    ``scenario/ranks.py`` ``distinct_ranks`` takes as ``cp_in_fsdp``, so that each CP rank of a
    stage's first ``dp_shard`` group is recorded.

    Raises:
        ConfigError: the job's config, or degrees that do not fill the world size.
    """
    capability = target.gpu.kernel_compute_capability
    config = load_job_config(job, capability=capability)
    parallel_dims = import_torchtitan("torchtitan.distributed.parallel_dims")
    try:
        with cuda_capability(capability):
            dims = parallel_dims.ParallelDims.from_config(config.parallelism, job.world_size)
    except (ValueError, AssertionError) as exc:
        raise ConfigError(
            f"torchtitan refused the parallel layout on {job.world_size} ranks: {exc}. The "
            "product of the parallelism degrees must equal the world size (--world-size)"
        ) from exc
    layout = ParallelLayout(
        fsdp=dims.dp_shard * dims.cp, tp=dims.tp, dp=dims.dp_replicate, pp=dims.pp
    )
    return layout, int(dims.cp)

"""Ranks that differ: pipeline stages, one rank recorded (``--rank R``) or each (``--all-ranks``).

Under pipeline parallel each pp coordinate runs other stages (the first holds the embedding,
the last the norm, LM head and loss), and 1F1B keeps ``pp - stage`` micro-batches in flight
(torch/distributed/pipelining/schedules.py ``Schedule1F1B``), so stage 0 is not always the
peak. The ranks of one stage run the same code on equal TP heads and FSDP2's equally padded
flat shards; only the optimizer states of an FSDP2 rank past the last full chunk are smaller,
so a stage's first and last ranks stand for all of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from oomkit.errors import OomkitError
from oomkit.scenario.workloads import call_builder, preset_step, workload_spec

if TYPE_CHECKING:
    from oomkit.core.gpus import GpuSpec
    from oomkit.core.target import ParallelLayout
    from oomkit.prediction.models.pipeline import PipelineOptions
    from oomkit.prediction.predictor import Prediction
    from oomkit.scenario.model import Scenario
    from oomkit.scenario.sharded import ShardedWorkload

__all__ = [
    "distinct_ranks",
    "peak_of",
    "peak_of_ranks",
    "pipeline_options",
    "pp_rank_of",
    "rank_of",
    "rank_words",
    "staged_workload",
    "with_rank_peaks",
]


def rank_of(scenario: Scenario) -> int:
    """The rank a prediction records: ``parallel.rank``, else 0."""
    parallel = scenario.parallel
    return parallel.rank if parallel is not None and parallel.rank is not None else 0


def rank_words(scenario: Scenario) -> str:
    """What is recorded, for progress lines: ``"rank 3"`` or ``"each distinct rank"``."""
    parallel = scenario.parallel
    if parallel is not None and parallel.all_ranks:
        return "each distinct rank"
    return f"rank {rank_of(scenario)}"


def pp_rank_of(layout: ParallelLayout, rank: int) -> int:
    """``rank``'s pipeline coordinate: ``pp`` is the mesh's outermost dimension
    (``ParallelLayout.mesh_shape``, row-major as ``init_device_mesh`` numbers ranks)."""
    return rank // (layout.world_size // layout.pp)


def distinct_ranks(layout: ParallelLayout, *, cp_in_fsdp: int = 1) -> tuple[int, ...]:
    """The ranks that may differ: per pipeline stage its first rank and, under FSDP, its last
    one (whose flat shards are the shortest where the FSDP degree does not divide a
    parameter's rows: torch/distributed/fsdp/_fully_shard/_fsdp_param.py
    ``_init_sharded_param``, ``torch.chunk``).

    Under context parallel (``--cp``, or a torchtitan job's CP) every CP rank of a stage's
    first ``dp_shard`` group is one more:
    torch's load-balanced ring attention gives each CP rank its own mix of shapes
    (torch/distributed/tensor/experimental/_context_parallel/_attention.py
    ``_templated_ring_attention`` and ``_templated_ring_attention_backward``: at ring step
    ``i > 0`` CP rank ``r`` runs SDPA on its full query and the first half of K/V where
    ``i <= r``, on the second half of its query and the full K/V where ``i > r``), so CP rank
    0 runs only half-query steps, the last only full-query ones, and a middle rank a mix whose
    caching-allocator layout neither end shows (llama3 debugmodel cut to 2 blocks, CP 4: CP
    rank 1 reserves 2 MiB more than ranks 0, 2 and 3 at equal peak allocated,
    tests/prediction/test_torchtitan_cp_ranks.py).

    Args:
        layout: the parallel degrees.
        cp_in_fsdp: the CP degree folded into ``layout.fsdp`` (torchtitan's ``fsdp`` mesh is
            ``dp_shard x cp``: ``oomkit.prediction._torchtitan_ranks.job_layout``); CP sits
            inside that dimension, outside TP, as in torchtitan's mesh order.

    Raises:
        OomkitError: ``cp_in_fsdp`` below 1 or not dividing ``layout.fsdp``.
    """
    if cp_in_fsdp < 1 or layout.fsdp % cp_in_fsdp:
        raise OomkitError(
            f"a CP degree of {cp_in_fsdp} inside an FSDP degree of {layout.fsdp} does not "
            "divide it; torchtitan's fsdp mesh is dp_shard x cp, so give the CP degree that "
            "the job's own parallel degrees name"
        )
    inner = layout.world_size // layout.pp
    ranks: list[int] = []
    for stage in range(layout.pp):
        first = stage * inner
        # (pp, dp, dp_shard, cp, tp) row-major: CP coordinate c of dp_shard 0, TP 0
        # the CP degree is folded into the FSDP one (torchtitan's route) or its own dimension
        # inside FSDP's (the presets' --cp: ParallelLayout.mesh_shape), one of them 1
        ranks.extend(first + cp_rank * layout.tp for cp_rank in range(cp_in_fsdp * layout.cp))
        last = first + inner - 1
        if (layout.fsdp > 1 or layout.cp > 1) and last not in ranks:
            ranks.append(last)
    return tuple(ranks)


def pipeline_options(scenario: Scenario, layout: ParallelLayout) -> PipelineOptions:
    """The scenario's pipeline settings as ``PipelineOptions`` (degree from ``layout``)."""
    from oomkit.prediction.models.pipeline import PipelineOptions

    parallel = scenario.parallel
    assert parallel is not None
    return PipelineOptions(
        layout.pp,
        parallel.pp_schedule or "1f1b",
        parallel.microbatches,
        parallel.stages_per_rank,
    )


def staged_workload(
    scenario: Scenario,
    layout: ParallelLayout,
    batch_size: int | None,
    gpu: GpuSpec,
    *,
    steps: int | None = None,
) -> ShardedWorkload:
    """A Llama preset pipelined (``--pp``) with FSDP2 / TP on the other mesh dimensions, or
    with its sequence split (``--cp``, with FSDP2).

    Raises:
        OomkitError: not a preset, PP with CP, or a setting the builder refuses.
    """
    from oomkit.scenario.sharded import ShardedWorkload

    model = scenario.model
    if model.preset is None:
        raise OomkitError(
            "--pp pipelines a Llama preset (e.g. `oomkit predict llama3-8b --pp 2 --batch 8`); "
            "a file.py:function or --hf model is not split into stages by oomkit"
        )
    if layout.pp > 1 and layout.cp > 1:
        raise OomkitError("--pp with --cp is not modelled yet; use one of them")
    resolved = preset_step(scenario, batch_size, gpu)
    options = resolved.options
    spec = workload_spec("preset", model.preset, options, steps, None)
    pipeline = pipeline_options(scenario, layout) if layout.pp > 1 else None
    workload = ShardedWorkload(lambda mesh: (None, ()), spec, defaults=dict(resolved.defaults))
    name = model.preset

    def build(mesh: Any) -> tuple[Any, ...]:
        from oomkit.prediction.models.context_parallel import build_cp_preset_step
        from oomkit.prediction.models.pipeline import build_pipeline_preset_step

        if layout.cp > 1:
            built = call_builder(lambda n, opts: build_cp_preset_step(n, opts, mesh), name, options)
        else:
            assert pipeline is not None  # layout.pp > 1
            piped = pipeline
            built = call_builder(
                lambda n, opts: build_pipeline_preset_step(n, opts, mesh, piped), name, options
            )
        workload.descriptions.append(built.description)
        return built.step_fn, tuple(built.track)

    workload.build = build
    return workload


def with_rank_peaks(
    scenario: Scenario,
    layout: ParallelLayout,
    predict_rank: Callable[[Scenario], Prediction],
) -> Prediction:
    """Predict each distinct rank of ``layout`` and return the peaking rank's prediction (peak
    reserved, then allocated, then the lowest rank) with every rank's peaks in ``rank_peaks``
    (the verdict names the peak: ``oomkit.prediction.summary.peak_rank_words``).

    Args:
        scenario: the request (``parallel.all_ranks`` set).
        layout: its parallel layout.
        predict_rank: predicts a scenario for the rank its ``parallel.rank`` names.
    """
    parallel = scenario.parallel
    assert parallel is not None

    def one(rank: int) -> Prediction:
        return predict_rank(scenario.model_copy(
            update={"parallel": parallel.model_copy(update={"rank": rank, "all_ranks": False})}
        ))

    return peak_of_ranks(layout, one)


def peak_of_ranks(
    layout: ParallelLayout,
    predict_rank: Callable[[int], Prediction],
    *,
    cp_in_fsdp: int = 1,
) -> Prediction:
    """``predict_rank(rank)`` for each of ``distinct_ranks(layout)``, each on a fresh fake
    group: the peaking rank's prediction (peak reserved, then allocated, then the lowest rank)
    with every rank's peaks in ``rank_peaks``. A torchtitan job's ranks are picked so too
    (``scenario/torchtitan_run.py``, its layout from the job's own parallel degrees, its CP
    degree folded into FSDP as ``cp_in_fsdp``: ``distinct_ranks``)."""
    return peak_of(
        distinct_ranks(layout, cp_in_fsdp=cp_in_fsdp),
        predict_rank,
        stage_of=lambda rank: pp_rank_of(layout, rank),
    )


def peak_of(
    ranks: Iterable[int],
    predict_rank: Callable[[int], Prediction],
    *,
    stage_of: Callable[[int], int | None] = lambda rank: None,
) -> Prediction:
    """``predict_rank(rank)`` for each of ``ranks`` (a torchrun script's are all of them: its
    code may do more on one rank, and only running each tells), each on a fresh fake group: the
    peaking rank's prediction (peak reserved, then allocated, then the lowest rank) with every
    rank's peaks in ``rank_peaks``, each with its pipeline stage (``None``: not a pipeline of
    oomkit's own, as a script's ranks)."""
    from oomkit.prediction.models.pipeline import forget_earlier_meshes

    peaks: list[dict[str, Any]] = []
    predictions: dict[int, Prediction] = {}
    for rank in ranks:
        forget_earlier_meshes()  # a fresh fake group per rank (pipeline.py)
        prediction = predict_rank(rank)
        predictions[rank] = prediction
        peaks.append({
            "rank": rank,
            "stage": stage_of(rank),
            "peak_allocated_bytes": prediction.peak_allocated_bytes,
            "peak_reserved_bytes": prediction.peak_reserved_bytes,
            "fits": prediction.fits,
        })
    top = max(peaks, key=lambda p: (p["peak_reserved_bytes"], p["peak_allocated_bytes"], -p["rank"]))
    return dataclasses.replace(predictions[top["rank"]], rank_peaks=tuple(peaks))

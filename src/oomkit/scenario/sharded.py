"""A scenario with a ``parallel`` layout: rank 0 recorded on a fake process group.

FSDP2, HSDP, TP, DDP and their products are built inside the fake process group and recorded
there (``predict`` and ``fit`` alike).

A preset is sharded as torchtitan shards it (``prediction/models/parallel.py``,
``tensor_parallel.py``) or wrapped in DDP (``data_parallel.py``); a ``file.py:function`` is
called with ``mesh`` / ``world_size`` where it declares them and shards (or wraps) itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from oomkit.errors import OomkitError
from oomkit.prediction.workload import WorkloadSpec
from oomkit.scenario.workloads import (
    call_builder,
    preset_step,
    user_workload_spec,
    workload_spec,
)

if TYPE_CHECKING:
    from oomkit.core.gpus import GpuSpec
    from oomkit.core.target import ParallelLayout, Target
    from oomkit.prediction.tracing.recording import TraceRecording
    from oomkit.scenario.model import Scenario

__all__ = [
    "ShardedWorkload",
    "describe_layout",
    "is_ddp",
    "layout_words",
    "parallel_workload",
    "record_rank_0",
    "tp_notes",
]


@dataclass
class ShardedWorkload:
    """A preset or function to build inside the fake process group, and its record.

    Attributes:
        build: ``build(mesh) -> (step_fn, track[, setup])`` for ``trace_distributed_step``.
        spec: the workload record (the per-rank batch).
        descriptions: filled by ``build`` with the built step's description.
        raised: what a ``file.py:function`` step raised (for ``user_errors``).
        defaults: the defaults chosen for it, in words.
        compile: record its ``torch.compile``d code as compiled (``--compile``).
    """

    build: Callable[[Any], tuple[Any, ...]]
    spec: WorkloadSpec
    descriptions: list[str] = field(default_factory=list)
    raised: list[BaseException] = field(default_factory=list)
    defaults: dict[str, str] = field(default_factory=dict)
    compile: bool = False

    @property
    def description(self) -> str:
        """The built step's description (``""`` before ``build`` ran)."""
        return self.descriptions[0] if self.descriptions else ""


def is_ddp(scenario: Scenario, layout: ParallelLayout) -> bool:
    """``--dp N`` alone is DDP, ``--dp 1`` included (one replica: DDP's own buckets on one GPU);
    ``--dp R`` with ``--fsdp S`` is HSDP: ``fully_shard`` on the 2-D (dp, fsdp) mesh."""
    if layout.fsdp > 1 or layout.tp > 1:
        return False
    parallel = scenario.parallel
    given_dp = parallel is not None and parallel.dp is not None and parallel.fsdp is None
    return layout.dp > 1 or given_dp


def describe_layout(layout: ParallelLayout) -> str:
    """The parallel layout in words, outermost first: ``"FSDP2 4 x TP 2"``; replicas of FSDP2
    shard groups are HSDP's (``"HSDP replicas 2 x FSDP2 4"``), not DDP's."""
    replicas = "DDP" if layout.fsdp == 1 else "HSDP replicas"
    degrees = (
        ("PP", layout.pp), (replicas, layout.dp), ("FSDP2", layout.fsdp), ("CP", layout.cp),
        ("TP", layout.tp),
    )
    parts = [f"{label} {degree}" for label, degree in degrees if degree > 1]
    # All degrees 1 and not DDP: the 1-rank mesh is FSDP2's (mesh_shape's ("fsdp",) dimension).
    return " x ".join(parts) or "FSDP2 1"


def layout_words(scenario: Scenario, layout: ParallelLayout) -> str:
    """The layout in words, outermost first: ``"DDP 2"``, ``"FSDP2 4 x TP 2"``."""
    return f"DDP {layout.dp}" if is_ddp(scenario, layout) else describe_layout(layout)


def tp_notes(layout: ParallelLayout) -> tuple[str, ...]:
    """What a ``--tp`` prediction models and leaves out, for the report's warnings."""
    if layout.tp == 1:
        return ()
    fsdp = (
        f"then FSDP2 over {layout.fsdp} ranks on the other mesh dimension; "
        if layout.fsdp > 1
        else "no FSDP, so bf16-mixed runs under torch.autocast (torchtitan's maybe_enable_amp "
        "would train in fp32 there); "
    )
    return (
        f"tensor parallel: torchtitan's Llama plan over {layout.tp} ranks (colwise q/k/v and "
        "gate/up, rowwise o/down, vocabulary-sharded embedding and LM head, sequence-parallel "
        f"norms, loss parallel), {fsdp}DTensor's all-gathers and reduce-scatters allocate on "
        "the current stream and are waited at once (but those parallel.async_tp's micro-pipeline "
        "pass fuses: its own note)",
    )


def parallel_workload(
    scenario: Scenario,
    layout: ParallelLayout,
    batch_size: int | None,
    gpu: GpuSpec,
    *,
    steps: int | None = None,
) -> ShardedWorkload:
    """The scenario's model under ``layout`` at the per-rank ``batch_size``: wrapped in DDP
    (``--dp`` alone), else sharded (FSDP2, HSDP, TP and their products).

    Raises:
        OomkitError: a Hugging Face model (not sharded yet), a function that takes neither
            ``mesh`` nor ``world_size``, or a preset option it rejects.
    """
    if layout.pp > 1 or layout.cp > 1:  # pipeline stages, context parallel: scenario/ranks.py
        from oomkit.scenario.ranks import staged_workload

        return staged_workload(scenario, layout, batch_size, gpu, steps=steps)
    model = scenario.model
    parallel = scenario.parallel
    if model.function is not None:
        if parallel is not None and (parallel.float8 or parallel.async_tp):
            raise OomkitError(
                f"--float8 and parallel.async_tp convert a preset as torchtitan does; "
                f"{model.function} builds its own model: call torchao's "
                "convert_to_float8_training in it, then drop the flag"
            )
        user = _user_workload(scenario, layout, batch_size, steps)
        user.compile = bool(scenario.step.compile)  # the function's own torch.compile calls
        return user
    if model.preset is None:
        raise OomkitError(
            "--fsdp, --tp and --dp shard a GPT-2 or Llama preset (e.g. `oomkit predict llama-8b "
            "--fsdp 8`) or run a file.py:function that takes `mesh`; --hf models are not "
            "sharded by oomkit yet"
        )
    resolved = preset_step(scenario, batch_size, gpu)
    options = resolved.options
    async_tp = parallel is not None and parallel.async_tp
    if async_tp and not options.compile:
        # Async TP is Inductor's micro-pipeline pass (torchtitan/distributed/compile.py
        # _maybe_enable_async_tp sets torch._inductor.config._micro_pipeline_tp): an eager step
        # never runs it; torchtitan's earlier releases refused it without compile.
        raise OomkitError(
            "parallel.async_tp is Inductor's micro-pipeline pass over compiled blocks: add "
            "--compile (or drop parallel.async_tp)"
        )
    float8 = _float8_options(scenario)
    spec = workload_spec("preset", model.preset, options, steps, None)
    if float8 is not None:  # saved with the prediction, so that explain re-predicts it
        spec = dataclasses.replace(
            spec, float8_recipe=float8.recipe, float8_all_gather=float8.all_gather
        )
    ddp_options = None
    if is_ddp(scenario, layout):
        from oomkit.prediction.models.data_parallel import DdpOptions

        assert parallel is not None
        ddp_options = DdpOptions(parallel.bucket_cap_mb, parallel.gradient_as_bucket_view)
        # Saved with the prediction, so that explain re-predicts the same buckets.
        spec = dataclasses.replace(
            spec,
            ddp_bucket_cap_mb=ddp_options.bucket_cap_mb,
            ddp_gradient_as_bucket_view=ddp_options.gradient_as_bucket_view,
        )
    workload = ShardedWorkload(
        lambda mesh: (None, ()),
        spec,
        defaults=dict(resolved.defaults),
        compile=bool(options.compile),  # each block compiled (models/compiled_blocks.py)
    )
    name = model.preset

    def build(mesh: Any) -> tuple[Any, ...]:
        if ddp_options is not None:
            from oomkit.prediction.models.data_parallel import build_ddp_preset_step

            step = call_builder(
                lambda n, opts: build_ddp_preset_step(n, opts, mesh, ddp_options), name, options
            )
            workload.descriptions.append(step.built.description)
            return step.built.step_fn, tuple(step.built.track), step.setup
        from oomkit.prediction.models.parallel import build_fsdp_preset_step

        built = call_builder(
            lambda n, opts: build_fsdp_preset_step(n, opts, mesh, float8), name, options
        )
        workload.descriptions.append(built.description)
        if async_tp:
            from oomkit.prediction.models.async_tp import with_async_tp

            return with_async_tp(built.step_fn, mesh), tuple(built.track)
        return built.step_fn, tuple(built.track)

    workload.build = build
    return workload


def _float8_options(scenario: Scenario) -> Any:
    """The scenario's ``Float8Options`` (``prediction/models/float8.py``), or None."""
    parallel = scenario.parallel
    if parallel is None or not parallel.float8:
        return None
    from oomkit.prediction.models.float8 import Float8Options

    return Float8Options(
        recipe=parallel.float8_recipe or "rowwise", all_gather=parallel.float8_all_gather
    )


def _user_workload(
    scenario: Scenario, layout: ParallelLayout, batch_size: int | None, steps: int | None
) -> ShardedWorkload:
    """``file.py:function`` under a layout: called with the mesh's device as default device and
    ``mesh`` / ``world_size`` where it declares them; it calls ``fully_shard`` (or wraps its
    model in ``DistributedDataParallel``) itself."""
    from oomkit.scenario.user_function import load_user_step

    target = scenario.model.function
    assert target is not None
    ddp = is_ddp(scenario, layout)
    parallel = scenario.parallel
    if ddp and parallel is not None and (
        parallel.bucket_cap_mb is not None or parallel.gradient_as_bucket_view
    ):
        raise OomkitError(
            f"--bucket-cap-mb and --gradient-as-bucket-view wrap a preset; {target} makes its "
            "own DistributedDataParallel: pass bucket_cap_mb / gradient_as_bucket_view there"
        )
    workload = ShardedWorkload(lambda mesh: (None, ()), WorkloadSpec("function", target))
    step = scenario.step

    def build(mesh: Any) -> tuple[Any, tuple[Any, ...]]:
        import torch

        user = load_user_step(
            target,
            batch_size=batch_size if batch_size is not None else step.batch,
            seq_len=step.seq,
            image_size=step.image_size,
            device=torch.device(mesh.device_type),
            extra={"mesh": mesh, "world_size": mesh.size()},
        )
        if ddp:
            wrapped = [
                m for m in user.track if isinstance(m, torch.nn.parallel.DistributedDataParallel)
            ]
            if not wrapped:
                raise OomkitError(
                    f"--dp: {target} returned no DistributedDataParallel model among the "
                    "objects to track; wrap the model (`model = DistributedDataParallel(model)`) "
                    "and return (step_fn, (model, optimizer, inputs))"
                )
            words = f"DDP over {mesh.size()} replicas, rank 0"
        else:
            from torch.distributed.fsdp import FSDPModule

            modules = [m for m in user.track if isinstance(m, torch.nn.Module)]
            if not any(isinstance(sub, FSDPModule) for m in modules for sub in m.modules()):
                raise OomkitError(
                    f"--fsdp: {target} returned no model sharded with fully_shard among the "
                    "objects to track; take a `mesh` parameter, call fully_shard(block, "
                    "mesh=mesh) per block and on the root, and return (step_fn, (model, "
                    "optimizer, inputs))"
                )
            from oomkit.prediction.models.parallel import fsdp_words  # HSDP on a 2-D mesh

            words = f"{fsdp_words(mesh)}, rank 0"
        workload.raised = user.raised
        workload.spec = user_workload_spec(target, user, steps)
        workload.descriptions.append(f"{user.description}, {words}")
        return user.step_fn, user.track

    workload.build = build
    return workload


def record_rank_0(
    workload: ShardedWorkload,
    layout: ParallelLayout,
    *,
    steps: int,
    target: Target,
    rank: int = 0,
) -> TraceRecording:
    """Rank 0's (or ``rank``'s) recording of ``workload`` on a fake process group of
    ``layout``'s mesh, with what a tensor-parallel recording leaves out among its warnings."""
    from oomkit.prediction.tracing.distributed import trace_distributed_step

    recording = trace_distributed_step(
        workload.build,
        world_size=layout.world_size,
        mesh_shape=layout.mesh_shape,
        steps=steps,
        target=target,
        compile=workload.compile,
        rank=rank,
    )
    return dataclasses.replace(recording, warnings=recording.warnings + tp_notes(layout))

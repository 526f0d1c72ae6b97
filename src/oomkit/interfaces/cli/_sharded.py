"""``--fsdp`` / ``--tp`` / ``--dp`` workloads built in the fake process group, for predict and fit.

A preset or function is built inside the fake process group and ``trace_distributed_step``
records rank 0 of the layout (``predict`` and ``fit`` alike); ``--dp`` (DDP) workloads are built
by ``_data_parallel.py`` on the same ``ShardedWorkload`` record; ``parallel_workload`` picks which.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from oomkit.errors import OomkitError
from oomkit.interfaces.cli._workload import (
    _call_builder,
    _preset_options,
    _refuse_preset_flags,
    _spec,
    user_workload_spec,
)
from oomkit.prediction.workload import WorkloadSpec

if TYPE_CHECKING:
    from oomkit.core.target import ParallelLayout, Target
    from oomkit.prediction.tracing.recording import TraceRecording

__all__ = [
    "ShardedWorkload",
    "build_sharded_workload",
    "layout_words",
    "parallel_workload",
    "record_rank_0",
    "refuse_layout",
]


@dataclass
class ShardedWorkload:
    """A preset or function to build inside the fake process group (``--fsdp``, ``--tp``,
    ``--dp``), and its record.

    Attributes:
        build: ``build(mesh) -> (step_fn, track[, setup])`` for ``trace_distributed_step``.
        spec: the workload record (the per-rank batch).
        descriptions: filled by ``build`` with the built step's description.
        raised: what a ``file.py:function`` step raised (for ``user_errors``).
    """

    build: Callable[[Any], tuple[Any, ...]]
    spec: WorkloadSpec
    descriptions: list[str] = field(default_factory=list)
    raised: list[BaseException] = field(default_factory=list)

    @property
    def description(self) -> str:
        """The built step's description (``""`` before ``build`` ran)."""
        return self.descriptions[0] if self.descriptions else ""


def refuse_layout(args: argparse.Namespace, layout: ParallelLayout, command: str) -> None:
    """What ``predict`` and ``fit`` refuse of a layout before anything is built.

    Raises:
        OomkitError: ``--dp`` with ``--tp`` but no ``--fsdp``; ``--tp`` with ``--hf`` or a
            ``file.py:function``.
    """
    from oomkit.interfaces.cli._tensor_parallel import refuse_tp_target

    if layout.dp > 1 and layout.tp > 1 and layout.fsdp == 1:
        # torchtitan's parallelize_llama refuses DDP on a mesh of more than one dimension.
        raise OomkitError(
            "--dp with --tp alone (DDP replicas of a tensor-parallel model) is not modelled: "
            f"add --fsdp S (HSDP x TP: --dp R --fsdp S --tp N), or {command} --fsdp and/or --tp"
        )
    if layout.tp > 1:
        refuse_tp_target(args, command)


def _is_ddp(args: argparse.Namespace, layout: ParallelLayout) -> bool:
    """``--dp N`` alone is DDP, ``--dp 1`` included (one replica: DDP's own buckets on one GPU);
    ``--dp R`` with ``--fsdp S`` is HSDP: ``fully_shard`` on the 2-D (dp, fsdp) mesh."""
    if layout.fsdp > 1 or layout.tp > 1:
        return False
    return layout.dp > 1 or (args.dp is not None and args.fsdp is None)


def layout_words(args: argparse.Namespace, layout: ParallelLayout) -> str:
    """The layout in words, outermost first: ``"DDP 2"``, ``"FSDP2 4 x TP 2"``."""
    from oomkit.interfaces.cli._tensor_parallel import describe_layout

    return f"DDP {layout.dp}" if _is_ddp(args, layout) else describe_layout(layout)


def parallel_workload(
    args: argparse.Namespace, layout: ParallelLayout, batch_size: int | None
) -> ShardedWorkload:
    """TARGET under ``layout`` at the per-rank ``batch_size``: wrapped in DDP (``--dp`` alone),
    else sharded (FSDP2, HSDP, TP and their products: ``build_sharded_workload``).

    Raises:
        OomkitError: as ``build_sharded_workload`` and ``build_ddp_workload``.
    """
    if _is_ddp(args, layout):
        from oomkit.interfaces.cli._data_parallel import build_ddp_workload

        workload: ShardedWorkload = build_ddp_workload(args, batch_size)
        return workload
    return build_sharded_workload(args, batch_size)


def record_rank_0(
    workload: ShardedWorkload, layout: ParallelLayout, *, steps: int, target: Target
) -> TraceRecording:
    """Rank 0's recording of ``workload`` on a fake process group of ``layout``'s mesh, with
    what a tensor-parallel recording leaves out among its warnings."""
    from oomkit.interfaces.cli._tensor_parallel import tp_notes
    from oomkit.prediction.tracing.distributed import trace_distributed_step

    recording = trace_distributed_step(
        workload.build,
        world_size=layout.world_size,
        mesh_shape=layout.mesh_shape,
        steps=steps,
        target=target,
    )
    return dataclasses.replace(recording, warnings=recording.warnings + tp_notes(layout))


def build_sharded_workload(args: argparse.Namespace, batch_size: int | None) -> ShardedWorkload:
    """The preset TARGET names, to shard with FSDP2 over ``--fsdp`` ranks (batch: per rank), or
    the ``file.py:function`` that shards itself, given ``mesh`` and/or ``world_size``.

    Raises:
        OomkitError: ``--hf`` (not sharded yet), a function that takes neither ``mesh`` nor
            ``world_size``, or a preset option it rejects.
    """
    from oomkit.interfaces.cli._user_function import is_user_target

    if args.hf is not None or args.target is None:
        raise OomkitError(
            "--fsdp shards a GPT-2 or Llama preset (e.g. `oomkit predict llama-8b --fsdp 8`) or "
            "runs a file.py:function that takes `mesh` and calls fully_shard; --hf models are "
            "not sharded by oomkit yet"
        )
    steps = getattr(args, "steps", None)
    if is_user_target(args.target):
        return _sharded_user_workload(args, batch_size, steps)
    from oomkit.prediction.models.parallel import build_fsdp_preset_step

    options = _preset_options(args, batch_size)
    spec = _spec("preset", args.target, options, steps, None)
    workload = ShardedWorkload(lambda mesh: (None, ()), spec)

    def build(mesh: Any) -> tuple[Any, tuple[Any, ...]]:
        built = _call_builder(
            lambda name, opts: build_fsdp_preset_step(name, opts, mesh), args.target, options
        )
        workload.descriptions.append(built.description)
        return built.step_fn, tuple(built.track)

    workload.build = build
    return workload


def _sharded_user_workload(
    args: argparse.Namespace, batch_size: int | None, steps: int | None
) -> ShardedWorkload:
    """``file.py:function`` under ``--fsdp``: called with the mesh's device as default device
    and ``mesh`` / ``world_size`` where it declares them; it calls ``fully_shard`` itself."""
    from oomkit.interfaces.cli._user_function import load_user_step

    _refuse_preset_flags(args)
    workload = ShardedWorkload(lambda mesh: (None, ()), WorkloadSpec("function", args.target))

    def build(mesh: Any) -> tuple[Any, tuple[Any, ...]]:
        import torch

        extra = {"mesh": mesh, "world_size": mesh.size()}
        user = load_user_step(
            args.target,
            batch_size=batch_size,
            seq_len=args.seq,
            image_size=args.image_size,
            device=torch.device(mesh.device_type),
            extra=extra,
        )
        from torch.distributed.fsdp import FSDPModule

        modules = [m for m in user.track if isinstance(m, torch.nn.Module)]
        if not any(isinstance(sub, FSDPModule) for m in modules for sub in m.modules()):
            raise OomkitError(
                f"--fsdp: {args.target} returned no model sharded with fully_shard among the "
                "objects to track; take a `mesh` parameter, call fully_shard(block, mesh=mesh) "
                "per block and on the root, and return (step_fn, (model, optimizer, inputs))"
            )
        workload.raised = user.raised
        workload.spec = user_workload_spec(args.target, user, steps)
        from oomkit.prediction.models.parallel import fsdp_words  # HSDP on a 2-D mesh

        workload.descriptions.append(f"{user.description}, {fsdp_words(mesh)}, rank 0")
        return user.step_fn, user.track

    workload.build = build
    return workload

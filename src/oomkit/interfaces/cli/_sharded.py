"""``--fsdp`` / ``--tp`` workloads: a preset or function built inside the fake process group.

``trace_distributed_step`` records rank 0 of the layout; ``--dp`` (DDP) workloads are built by
``_data_parallel.py`` on the same ``ShardedWorkload`` record.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from oomkit.errors import OomkitError
from oomkit.interfaces.cli._workload import (
    _call_builder,
    _preset_options,
    _refuse_preset_flags,
    _spec,
    user_workload_spec,
)
from oomkit.prediction.workload import WorkloadSpec

__all__ = ["ShardedWorkload", "build_sharded_workload"]


@dataclass
class ShardedWorkload:
    """A preset to build inside the fake process group (``--fsdp``), and its record.

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

"""``predict PRESET --dp N``: the DDP flags and the workload that wraps a preset in DDP."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from oomkit.errors import OomkitError

__all__ = ["add_ddp_flags", "build_ddp_workload", "ddp_bucket_cap_mb"]


def _positive_mib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of MiB above 0, e.g. 25; got {text!r}")
    return value


def add_ddp_flags(parser: argparse.ArgumentParser) -> None:
    """``--bucket-cap-mb MB`` and ``--gradient-as-bucket-view`` (with ``--dp N``)."""
    parser.add_argument(
        "--bucket-cap-mb",
        type=_positive_mib,
        metavar="MB",
        help="--dp: DDP's bucket_cap_mb (default: DDP's 25, with a 1 MiB first bucket; given, "
        "every bucket is capped at MB)",
    )
    parser.add_argument(
        "--gradient-as-bucket-view",
        action="store_true",
        help="--dp: DDP's gradient_as_bucket_view=True (gradients are views of the buckets)",
    )


def ddp_bucket_cap_mb(args: argparse.Namespace) -> float | None:
    """The bucket cap asked for; refuses the DDP flags without ``--dp``."""
    cap = getattr(args, "bucket_cap_mb", None)
    view = getattr(args, "gradient_as_bucket_view", False)
    parallel = getattr(args, "dp", None)
    if (cap is not None or view) and (parallel is None or getattr(args, "fsdp", None)):
        raise OomkitError("--bucket-cap-mb and --gradient-as-bucket-view go with --dp N alone")
    return cap


def build_ddp_workload(args: argparse.Namespace, batch_size: int | None) -> Any:
    """The preset TARGET names, replicated with DDP over ``--dp`` ranks (batch: per rank).

    Returns:
        A ``ShardedWorkload`` whose ``build(mesh)`` returns ``(step_fn, track, setup)``.

    Raises:
        OomkitError: ``--hf`` (not wrapped by oomkit yet).
    """
    from oomkit.interfaces.cli._sharded import ShardedWorkload
    from oomkit.interfaces.cli._user_function import is_user_target
    from oomkit.interfaces.cli._workload import _call_builder, _preset_options, _spec
    from oomkit.prediction.models.data_parallel import DdpOptions, build_ddp_preset_step

    if args.hf is not None or args.target is None:
        raise OomkitError(
            "--dp wraps a built-in preset in DistributedDataParallel (e.g. `oomkit predict "
            "gpt2-124m --dp 8`) or runs a file.py:function that wraps its model in DDP itself; "
            "--hf models are not wrapped yet"
        )
    if is_user_target(args.target):
        return _ddp_user_workload(args, batch_size)
    ddp = DdpOptions(ddp_bucket_cap_mb(args), bool(args.gradient_as_bucket_view))
    options = _preset_options(args, batch_size)
    spec = _spec("preset", args.target, options, getattr(args, "steps", None), None)
    # Saved with the prediction, so that explain re-predicts the same buckets.
    spec = dataclasses.replace(
        spec, ddp_bucket_cap_mb=ddp.bucket_cap_mb, ddp_gradient_as_bucket_view=ddp.gradient_as_bucket_view
    )
    workload = ShardedWorkload(lambda mesh: (None, ()), spec)

    def build(mesh: Any) -> tuple[Any, ...]:
        step = _call_builder(
            lambda name, opts: build_ddp_preset_step(name, opts, mesh, ddp), args.target, options
        )
        workload.descriptions.append(step.built.description)
        return step.built.step_fn, tuple(step.built.track), step.setup

    workload.build = build
    return workload


def _ddp_user_workload(args: argparse.Namespace, batch_size: int | None) -> Any:
    """``file.py:function`` under ``--dp``: called as under ``--fsdp`` (``mesh``,
    ``world_size``, the mesh's device as default device); it wraps its model in
    ``DistributedDataParallel`` itself, whose constructor then runs under the recorder
    (``trace_distributed_step`` defers it to before step 0)."""
    import torch

    from oomkit.interfaces.cli._sharded import ShardedWorkload
    from oomkit.interfaces.cli._user_function import load_user_step
    from oomkit.interfaces.cli._workload import _refuse_preset_flags, user_workload_spec
    from oomkit.prediction.workload import WorkloadSpec

    if ddp_bucket_cap_mb(args) is not None or args.gradient_as_bucket_view:
        raise OomkitError(
            f"--bucket-cap-mb and --gradient-as-bucket-view wrap a preset; {args.target} makes "
            "its own DistributedDataParallel: pass bucket_cap_mb / gradient_as_bucket_view there"
        )
    _refuse_preset_flags(args)
    workload = ShardedWorkload(lambda mesh: (None, ()), WorkloadSpec("function", args.target))

    def build(mesh: Any) -> tuple[Any, tuple[Any, ...]]:
        user = load_user_step(
            args.target,
            batch_size=batch_size,
            seq_len=args.seq,
            image_size=args.image_size,
            device=torch.device(mesh.device_type),
            extra={"mesh": mesh, "world_size": mesh.size()},
        )
        wrapped = [
            m
            for m in user.track
            if isinstance(m, torch.nn.parallel.DistributedDataParallel)
        ]
        if not wrapped:
            raise OomkitError(
                f"--dp: {args.target} returned no DistributedDataParallel model among the objects "
                "to track; wrap the model (`model = DistributedDataParallel(model)`) and return "
                "(step_fn, (model, optimizer, inputs))"
            )
        workload.raised = user.raised
        workload.spec = user_workload_spec(args.target, user, getattr(args, "steps", None))
        workload.descriptions.append(
            f"{user.description}, DDP over {mesh.size()} replicas, rank 0"
        )
        return user.step_fn, user.track

    workload.build = build
    return workload

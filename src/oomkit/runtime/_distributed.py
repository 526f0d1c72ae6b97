"""The few ``torch.distributed`` calls OOM recovery needs: agree on an outcome, average gradients.

Every rank calls :func:`agree` once per attempt, whether or not it ran out of memory, so a rank
that did not OOM never waits in a collective that the failed rank will not join.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["Agreement", "Status", "active_world", "agree", "average_gradients"]


class Status:
    """Outcome codes a rank reports; the all-reduce takes the maximum, so the worst one wins."""

    OK = 0
    OOM = 1  # ran out of memory, can retry with smaller micro-batches
    FATAL = 2  # OOM at the smallest micro-batch, or another exception: every rank gives up


@dataclass(frozen=True)
class Agreement:
    """What all ranks agreed on after one attempt.

    Attributes:
        status: The worst :class:`Status` of any rank.
        micro_batch_size: The smallest micro-batch size any rank proposed.
    """

    status: int
    micro_batch_size: int


def active_world(group: Any = None) -> tuple[int, int] | None:
    """``(rank, world_size)`` when ``torch.distributed`` is initialized with more than one rank.

    Args:
        group: The process group, or ``None`` for the default one.

    Returns:
        ``None`` in a single process (distributed missing, not initialized, or world size 1).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    world_size = dist.get_world_size(group)
    if world_size <= 1:
        return None
    return dist.get_rank(group), world_size


def agree(status: int, micro_batch_size: int, group: Any = None) -> Agreement:
    """All-reduce (MAX) this rank's status and the negated micro-batch size it proposes.

    One collective carries both numbers: MAX of the status is "did anyone fail", MAX of
    ``-size`` is the smallest size proposed, so every rank splits its batch the same way.

    Args:
        status: This rank's :class:`Status`.
        micro_batch_size: The micro-batch size this rank wants for the next attempt.
        group: The process group, or ``None`` for the default one.

    Returns:
        The agreed status and micro-batch size.
    """
    import torch
    import torch.distributed as dist

    # ProcessGroupNCCL only reduces CUDA tensors; gloo and others take CPU tensors.
    device = "cuda" if "nccl" in str(dist.get_backend(group)).lower() else "cpu"
    flags = torch.tensor([status, -micro_batch_size], dtype=torch.int64, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    worst, neg_size = (int(v) for v in flags.tolist())
    return Agreement(status=worst, micro_batch_size=-neg_size)


def average_gradients(parameters: Iterable[Any], group: Any = None) -> None:
    """Average every parameter's ``.grad`` over the ranks, as DDP's default hook does.

    Mirrors ``torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py`` ``allreduce_hook``
    (sum over ranks, divided by the world size). Used after micro-batches ran under
    ``DistributedDataParallel.no_sync()``; every rank must hold gradients for the same parameters,
    as DDP without ``find_unused_parameters`` requires.

    Args:
        parameters: The model's parameters.
        group: The process group, or ``None`` for the default one.
    """
    import torch.distributed as dist

    world_size = dist.get_world_size(group)
    for param in parameters:
        if param.grad is None:
            continue
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=group)
        param.grad.div_(world_size)

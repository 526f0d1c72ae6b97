"""What an allocation is for: the category vocabulary and the rule that infers it.

A storage's category is only known for sure once the step has moved on (a tensor allocated by
``mm`` in backward becomes a gradient when ``AccumulateGrad`` stores it in ``param.grad``; a
tensor allocated in forward becomes an activation when autograd saves it), so the recorder
collects *roles* while the step runs and asks :func:`infer_category` at the end.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, get_args

__all__ = ["Category", "CATEGORIES", "Phase", "PHASES", "Role", "infer_category"]

Category = Literal[
    "parameter",
    "buffer",
    "gradient",
    "optimizer_state",
    "activation",
    "temporary",
    "input",
    "autocast_cache",
    "workspace",
    "allgather_buffer",
    "reduce_scatter_buffer",
    "ddp_bucket",
]
CATEGORIES: tuple[Category, ...] = get_args(Category)

# Where the step was when a storage was allocated.
Phase = Literal["user", "forward", "backward", "optimizer"]
PHASES: tuple[Phase, ...] = get_args(Phase)

# Facts observed about a storage while the step ran.
#   parameter / buffer: it backs a registered nn.Parameter / buffer
#   gradient: it was stored as ``param.grad``
#   optimizer_state: it is a value in ``optimizer.state``
#   input: it existed before tracing, or user code passed it into a root module's forward
#   saved: autograd saved it for backward (a pack hook saw it)
#   escaped: allocated inside a module forward and still alive when the root module returned
#   allgather_buffer: FSDP2's all-gather output or an unsharded parameter filled from it
#   reduce_scatter_buffer: FSDP2's reduce-scatter input (padded unsharded gradients)
#   ddp_bucket: a DDP gradient bucket (the reducer's flat allreduce buffer)
Role = Literal[
    "parameter",
    "buffer",
    "gradient",
    "optimizer_state",
    "input",
    "saved",
    "escaped",
    "allgather_buffer",
    "reduce_scatter_buffer",
    "ddp_bucket",
]

# Most specific first: a parameter that autograd also saves (Linear's weight) is a parameter.
# An unsharded FSDP2 parameter is a view of an all-gather buffer: the buffer it is. A
# reduce-scatter output that becomes the sharded gradient is a gradient. A DDP bucket that the
# gradients are views of (gradient_as_bucket_view=True) is the gradients.
_ROLE_PRECEDENCE: tuple[tuple[Role, Category], ...] = (
    ("allgather_buffer", "allgather_buffer"),
    ("parameter", "parameter"),
    ("buffer", "buffer"),
    ("gradient", "gradient"),
    ("ddp_bucket", "ddp_bucket"),
    ("optimizer_state", "optimizer_state"),
    ("reduce_scatter_buffer", "reduce_scatter_buffer"),
    ("input", "input"),
    ("saved", "activation"),
)


def infer_category(
    roles: Iterable[Role], phase: Phase, explicit: Category | None = None
) -> Category:
    """The category of one storage, from what was observed about it.

    Args:
        roles: facts collected while the step ran (see ``Role``).
        phase: where the step was when the storage was allocated.
        explicit: a category set by an op emulation (``workspace``, ``autocast_cache``); wins.

    Returns:
        ``explicit`` if given; else the first role in precedence order; else ``activation`` for
        a forward allocation that outlived its root module call, and ``temporary`` otherwise
        (freed within the module call, or a backward/optimizer/user scratch tensor).
    """
    if explicit is not None:
        return explicit
    found = set(roles)
    for role, category in _ROLE_PRECEDENCE:
        if role in found:
            return category
    if phase == "forward" and "escaped" in found:
        return "activation"
    return "temporary"

"""Functional collectives as CUDA runs them: ``wait_tensor`` hands back its input, not a copy.

torch/csrc/distributed/c10d/Functional.cpp registers ``_c10d_functional::wait_tensor`` with
``c10d::wait_tensor``, which waits on the work registered for the tensor and returns the same
tensor (torch/csrc/distributed/c10d/FunctionalRegistry.cpp ``wait_tensor``: ``return
tensor;``). Its meta kernel, which a fake run executes, returns ``torch.empty_like(self)``
instead (torch/distributed/_functional_collectives.py ``_wait_tensor_meta``): a new storage
the size of every collective's output, which no GPU allocates. DTensor waits on every
redistribution (sequence-parallel all-gathers, reduce-scatters, all-reduces), so without this
each would be counted twice while both are alive.

DTensor's sharding propagation runs each op once more on fake tensors of the *global* shapes to
derive the output's metadata (torch/distributed/tensor/_sharding_prop.py
``_propagate_tensor_meta_non_cached``: "We must call the tracing in fake tensor mode so that
it avoids materializing memory"); on a GPU that allocates nothing, so it runs unrecorded here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, cast

import torch

from oomkit.prediction.tracing._modes import untraced
from oomkit.prediction.tracing.emulation import EmulationContext, OpEmulation

__all__ = ["COLLECTIVE_EMULATIONS", "sharding_propagation_untraced"]


def _wait_tensor_returns_its_input(ctx: EmulationContext) -> Any:
    """``_c10d_functional.wait_tensor``: the output shares the input's storage, as on CUDA."""
    out = ctx.run()
    source = ctx.args[0] if ctx.args else None
    if isinstance(out, torch.Tensor) and isinstance(source, torch.Tensor):
        # set_ points the output at the input's storage before the engine sees the output,
        # so the meta kernel's empty_like storage is never recorded.
        cast(Any, out).set_(source)
    return out


COLLECTIVE_EMULATIONS: dict[str, OpEmulation] = {
    "_c10d_functional.wait_tensor.default": _wait_tensor_returns_its_input,
}


@contextlib.contextmanager
def sharding_propagation_untraced() -> Iterator[None]:
    """While open, DTensor's shape propagation on global fake tensors is not recorded."""
    try:
        from torch.distributed.tensor._sharding_prop import ShardingPropagator
    except ImportError:  # pragma: no cover - torch without DTensor
        yield
        return
    original = ShardingPropagator.__dict__.get("_propagate_tensor_meta_non_cached")
    if original is None:  # pragma: no cover - another DTensor layout: recorded as before
        yield
        return

    def propagate(self: Any, op_schema: Any) -> Any:
        with untraced():
            return original(self, op_schema)

    setattr(ShardingPropagator, "_propagate_tensor_meta_non_cached", propagate)  # noqa: B010
    try:
        yield
    finally:
        setattr(ShardingPropagator, "_propagate_tensor_meta_non_cached", original)  # noqa: B010

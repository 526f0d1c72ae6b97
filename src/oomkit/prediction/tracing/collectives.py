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

An asynchronous collective's work completes with its output, as NCCL's does: ProcessGroupNCCL.cpp
``collective()`` keeps the outputs in ``WorkNCCL::outputs_`` ("Store references to outputs to be
used by WorkNCCL::result") and ``getFuture()`` completes with them, so code reads
``dist.all_reduce(t, async_op=True).get_future().wait()[0]``. The fake backend's work completes
with nothing (torch/csrc/distributed/c10d/FakeProcessGroup.hpp ``FakeWork``); while
:func:`async_collectives_complete_with_outputs` is open, each single-output collective's work is
one that completes with ``[output]`` (``_create_work_from_future``, as c10d makes for a future).

The fake group stands for NCCL: while :func:`nccl_said_available` is open,
``torch.distributed.is_nccl_available()`` answers as a CUDA build does (True; a CPU wheel's is
False), so code that picks its backend by it (``"nccl" if dist.is_nccl_available() else
"gloo"``), DDP's ``bf16_compress_hook`` check and Inductor's micro-pipeline TP pass take their
CUDA path. Only the package's name is answered: torch's own c10d module keeps its answer, since
there it guards ``ProcessGroupNCCL``, a class a CPU build lacks.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch

from oomkit.prediction.tracing._modes import untraced
from oomkit.prediction.tracing.emulation import EmulationContext, OpEmulation

__all__ = [
    "COLLECTIVE_EMULATIONS",
    "async_collectives_complete_with_outputs",
    "nccl_said_available",
    "sharding_propagation_untraced",
]


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


# torch.distributed's collectives whose NCCL work holds one output, and that output's parameter
# (distributed_c10d.py signatures: each is also the first positional argument).
_OUTPUT_PARAMETER = {
    "all_reduce": "tensor",
    "broadcast": "tensor",
    "reduce": "tensor",
    "all_gather_into_tensor": "output_tensor",
    "reduce_scatter_tensor": "output",
    "all_to_all_single": "output",
}


def _completing(original: Callable[..., Any], parameter: str) -> Callable[..., Any]:
    @functools.wraps(original)
    def collective(*args: Any, **kwargs: Any) -> Any:
        work = original(*args, **kwargs)
        if work is None:  # async_op=False: no work, as with NCCL
            return None
        output = args[0] if args else kwargs[parameter]
        work.wait()
        future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        future.set_result([output])
        c10d: Any = torch._C._distributed_c10d
        return c10d._create_work_from_future(future)

    return collective


@contextlib.contextmanager
def async_collectives_complete_with_outputs() -> Iterator[None]:
    """While open, ``dist.all_reduce(t, async_op=True)`` and the other single-output
    collectives return a work whose future (and ``result()``) is ``[output]`` (module doc)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    with contextlib.ExitStack() as stack:
        for module in (dist, distributed_c10d):
            for name, parameter in _OUTPUT_PARAMETER.items():
                original = getattr(module, name, None)
                if original is None:  # pragma: no cover - a torch without this collective
                    continue
                setattr(module, name, _completing(original, parameter))
                stack.callback(setattr, module, name, original)
        yield


@contextlib.contextmanager
def nccl_said_available() -> Iterator[None]:
    """While open, ``torch.distributed.is_nccl_available()`` is True (module docstring)."""
    import torch.distributed as dist

    original = dist.is_nccl_available
    dist.is_nccl_available = lambda: True
    try:
        yield
    finally:
        dist.is_nccl_available = original

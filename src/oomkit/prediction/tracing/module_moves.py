"""``Module.to("cuda")`` as on a GPU, while CUDA tensors land on meta (``cuda_device.py``).

- Shared parameters stay shared (nanoGPT ties ``wte`` to ``lm_head``). CUDA keeps them through
  ``param.data = moved`` (torch/nn/modules/module.py ``_apply``: CPU and CUDA tensors have
  compatible shallow-copy types); CPU and meta do not, so ``_apply`` would make one new
  ``Parameter`` per module and double the tied weight, its gradient and its optimizer state.
  While open, a move converts each tensor once and puts the one result back wherever the tensor
  was; and an optimizer built before the move (which CUDA's in-place ``param.data`` swap keeps
  pointing at the moved parameters) is pointed at the new ones, its state with them. A move
  that changes nothing (``model.to("cuda")`` of a model already there) leaves the module as it
  is, as CUDA's ``param.data = param`` does; torch's ``_apply`` would swap a FakeTensor
  parameter for itself, which fails.
- A bare index is a CUDA device: ``model.to(0)``, ``model.to(local_rank)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["module_moves_keep_sharing", "module_to_index_is_cuda"]


@contextlib.contextmanager
def module_moves_keep_sharing() -> Iterator[None]:
    """``Module._apply`` converts a shared tensor once and re-ties it where it was, and the
    optimizers built meanwhile follow a replaced parameter (module docstring)."""
    import weakref

    original = torch.nn.Module._apply
    original_init = torch.optim.Optimizer.__init__
    optimizers: weakref.WeakSet[Any] = weakref.WeakSet()
    depth = [0]

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        optimizers.add(self)

    def _apply(self: torch.nn.Module, fn: Any, recurse: bool = True) -> torch.nn.Module:
        if depth[0]:
            return original(self, fn, recurse)
        before = [
            (module, slots, name, tensor)
            for module in self.modules()
            for slots in (module._parameters, module._buffers)
            for name, tensor in slots.items()
            if tensor is not None
        ]
        # id -> (the tensor, kept alive so its id stays its own; what fn made of it)
        converted: dict[int, tuple[Any, Any]] = {}

        def once(tensor: Any) -> Any:
            hit = converted.get(id(tensor))
            if hit is None:
                hit = converted[id(tensor)] = (tensor, fn(tensor))
            return hit[1]

        held = [t for *_, t in before] + [
            t.grad for *_, t in before if isinstance(t, torch.nn.Parameter) and t.grad is not None
        ]
        if all(once(tensor) is tensor for tensor in held):
            # Nothing moves (model.to("cuda") of a model already there): torch would still swap
            # each FakeTensor parameter for itself (module.py _apply), which fails on the fake
            # device of a distributed recording.
            return self
        depth[0] += 1
        try:
            result = original(self, once, recurse)
        finally:
            depth[0] -= 1
        first: dict[int, Any] = {}
        moved: dict[int, tuple[Any, Any]] = {}
        for _module, slots, name, tensor in before:
            if id(tensor) in first:
                slots[name] = first[id(tensor)]
            else:
                first[id(tensor)] = now = slots.get(name)
                if now is not tensor and isinstance(tensor, torch.nn.Parameter):
                    moved[id(tensor)] = (tensor, now)
        if moved:
            _repoint_optimizers(optimizers, moved)
        return result

    torch.nn.Module._apply = _apply  # type: ignore[method-assign]
    torch.optim.Optimizer.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module._apply = original  # type: ignore[method-assign]
        torch.optim.Optimizer.__init__ = original_init  # type: ignore[method-assign]


def _repoint_optimizers(optimizers: Any, moved: dict[int, tuple[Any, Any]]) -> None:
    """Optimizers holding a parameter that a move replaced hold its replacement instead."""
    for optimizer in list(optimizers):
        for group in optimizer.param_groups:
            group["params"] = [
                moved[id(p)][1] if id(p) in moved and moved[id(p)][0] is p else p
                for p in group["params"]
            ]
        for old, new in moved.values():
            if old in optimizer.state:
                optimizer.state[new] = optimizer.state.pop(old)


@contextlib.contextmanager
def module_to_index_is_cuda() -> Iterator[None]:
    """``Module.to(0)`` / ``Module.to(device=0)`` / ``.to(local_rank)``: a bare index is CUDA's,
    as for a tensor (``cuda_device.is_cuda``; c10/core/Device.cpp). ``Module.to`` parses it with
    ``torch._C._nn._parse_to``, which asks the current accelerator for an index alone; the CPU
    build has none ("Cannot access accelerator device"), so the index is named ``cuda:N`` first."""
    nn = torch._C._nn
    original = nn._parse_to

    def parse_to(*args: Any, **kwargs: Any) -> Any:
        args = tuple(_as_cuda(a) if i == 0 else a for i, a in enumerate(args))
        if "device" in kwargs:
            kwargs["device"] = _as_cuda(kwargs["device"])
        return original(*args, **kwargs)

    nn._parse_to = parse_to
    try:
        yield
    finally:
        nn._parse_to = original


def _as_cuda(device: Any) -> Any:
    """An index alone as ``cuda:N``; anything else as it is."""
    if isinstance(device, int) and not isinstance(device, bool):
        return f"cuda:{device}"
    return device

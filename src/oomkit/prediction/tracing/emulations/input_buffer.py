"""Autograd's gradient accumulation, in place on CUDA, out of place under the tracer.

When two gradients reach the same input of an autograd node (a residual stream, a hidden state
read by the q, k and v projections, a weight used twice), the engine sums them into the node's
input buffer (torch/csrc/autograd/input_buffer.cpp ``accumulate``, read at pytorch/pytorch
002ca67). With grad mode off, it adds the incoming gradient in place into the buffered one
when it holds the last reference to it (``can_accumulate_inplace(old_var)``: not
``isTensorSubclassLike``, not a zero or nested tensor, non-overlapping and dense, tensor and
storage use counts one): ``old_var.add_(var)``; otherwise ``old_var + var`` (the incoming one is
a target only when the buffered one is sparse). The tracer always sees the last branch, because ATen's
``isTensorSubclassLike`` is true for every meta tensor and for every tensor while a dispatch
mode is active (aten/src/ATen/TensorSubclassLikeUtils.h; the same guard as the formulas in
``inplace_backward``). So each accumulation recorded a new gradient-sized buffer that CUDA never
allocates: measured on an H200 (``validation/h200-torch2.11.0.json``), Llama 1B in bf16
recorded 160 more allocations a step than the GPU made, one of them a third 1 GiB embedding
gradient, and predicted 5.4% more reserved memory than the GPU held.

The hook below does what CUDA does for the engine's own ``add``: it is the engine's when grad
mode is off, an autograd node is running (``torch._C._current_autograd_node``) and the op came
straight from the C++ engine (no Python frame between it and ``_engine_run_backward``: an
``a + b`` in a tensor hook or a Python ``Function.backward`` stays out of place), with two
same-shaped tensors of one dtype and no ``alpha``. The last-reference test compares each
tensor's use counts, as the dispatcher hands them to a mode, with those of a gradient the engine
is known to hold alone: measured once per process on a two-path graph in a thread of its own
(no mode of the step's there). Where that cannot be measured (a torch without
``Tensor._use_count``), the hook leaves meta's out-of-place add. A C++ backward formula whose
own last op adds two same-shaped temporaries (``atan2``'s, say) looks the same and would be
made in place: one temporary fewer than CUDA makes, for formulas that common models do not run.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch

from oomkit.prediction.tracing.emulations.inplace_adds import composite_add
from oomkit.prediction.tracing.reduce_config import non_overlapping_and_dense

if TYPE_CHECKING:
    from oomkit.prediction.tracing.emulation import EmulationContext, EmulationRegistry

__all__ = ["ACCUMULATE_OP", "accumulates_in_place", "register_input_buffer"]

ACCUMULATE_OP = "aten.add.Tensor"
_aten = torch.ops.aten

# Frames between the engine and the hook: the tracer's modes and its engine's run_op, and
# torch's own dispatch wrappers (the _disable_dynamo wrapper of every __torch_dispatch__,
# OpOverload calls between stacked modes). Any other frame is Python code that called the op.
_OOMKIT_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
_TRACER_FRAMES = frozenset({"__torch_dispatch__", "run_op"})
_TORCH_DIR = os.path.dirname(torch.__file__)
_DISPATCH_FILES = tuple(
    os.path.join(_TORCH_DIR, *parts)
    for parts in (("_compile.py",), ("_ops.py",), ("utils", "_python_dispatch.py"))
)
_DYNAMO_DIR = os.path.join(_TORCH_DIR, "_dynamo") + os.sep
# torch/autograd/graph.py _engine_run_backward (torch >= 2.3), torch/autograd/__init__.py
# backward / grad (before): where Python hands a backward to the C++ engine.
_ENGINE_FILES = (
    os.path.join(_TORCH_DIR, "autograd", "graph.py"),
    os.path.join(_TORCH_DIR, "autograd", "__init__.py"),
)


def _use_counts(tensor: torch.Tensor) -> tuple[int, int]:
    """The tensor's and its storage's reference counts as this module reads them."""
    use_count = tensor._use_count  # type: ignore[attr-defined]  # torch's own, not in stubs
    return use_count(), torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


@functools.cache
def _engine_only_counts() -> tuple[int, int] | None:
    """The use counts a mode sees on a gradient that only the engine's input buffer holds.

    Measured on meta in a fresh thread (dispatch and function modes are thread-local, so none
    of the step's run there): ``x * 2`` read by ``sin`` and ``cos``, whose two gradients the
    engine sums with both held only by it. ``None`` when torch cannot say.
    """
    if not hasattr(torch.Tensor, "_use_count") or not hasattr(torch._C, "_storage_Use_Count"):
        return None
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list[tuple[int, int]] = []

    class Probe(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func is _aten.add.Tensor and not torch.is_grad_enabled():
                seen.append(_use_counts(args[0]))
                seen.append(_use_counts(args[1]))
            return func(*args, **(kwargs or {}))

    def probe() -> None:
        x = torch.empty(4, 4, device="meta", requires_grad=True)
        with Probe():
            a = x * 2
            (a.sin() + a.cos()).sum().backward()

    thread = threading.Thread(target=probe, name="oomkit-accumulate-probe")
    thread.start()
    thread.join()
    if len(seen) != 2 or seen[0] != seen[1]:
        return None
    return seen[0]


def _from_engine() -> bool:
    """Whether the op being emulated was called by the C++ autograd engine itself."""
    frame: FrameType | None = sys._getframe(3)  # past this, accumulates_in_place and the hook
    while frame is not None:
        code = frame.f_code
        filename = code.co_filename
        if (
            (filename.startswith(_OOMKIT_DIR) and code.co_name in _TRACER_FRAMES)
            or filename.startswith(_DYNAMO_DIR)
            or filename in _DISPATCH_FILES
        ):
            frame = frame.f_back
            continue
        return filename in _ENGINE_FILES
    return False


def _last_reference(tensor: torch.Tensor, engine_only: tuple[int, int]) -> bool:
    # input_buffer.cpp can_accumulate_inplace, for a plain CUDA tensor (not subclass-like).
    return (
        not tensor._is_zerotensor()
        and not tensor.is_nested
        and non_overlapping_and_dense(tensor.shape, tensor.stride())
        and _use_counts(tensor) == engine_only
    )


def accumulates_in_place(ctx: EmulationContext) -> torch.Tensor | None:
    """The tensor CUDA's engine would add into for this call, ``None`` for out of place."""
    if torch.is_grad_enabled() or torch._C._current_autograd_node() is None:
        return None
    if len(ctx.args) != 2 or ctx.kwargs:
        return None
    old, new = ctx.args
    if not isinstance(old, torch.Tensor) or not isinstance(new, torch.Tensor) or old is new:
        return None
    if old.shape != new.shape or old.dtype != new.dtype or old.device != new.device:
        return None
    engine_only = _engine_only_counts()
    if engine_only is None or not _from_engine():
        return None
    # accumulate(): old_var.add_(var) when it can; a dense incoming gradient is never the
    # target (var.add_(old_var) is the sparse old_var branch only).
    return old if _last_reference(old, engine_only) else None


def _hook(ctx: EmulationContext) -> Any:
    # aten.add.Tensor has one hook: SDPA's math path and linear add in place on CUDA
    # (inplace_adds.py), the engine accumulates gradients in place (here).
    out = composite_add(ctx)
    if out is not None:
        return out
    target = accumulates_in_place(ctx)
    if target is None:
        return ctx.run()
    return _aten.add_.Tensor(target, ctx.args[1])


def register_input_buffer(registry: EmulationRegistry) -> None:
    """Add the accumulation hook (``aten.add.Tensor``)."""
    registry.register(ACCUMULATE_OP)(_hook)

"""``torch.func``'s ``grad``, ``vjp``, ``jacrev`` and ``hessian`` under the recorder.

The recorder notes the tensors autograd saves for backward with a pair of saved-tensor hooks
(``recorder.py``), open while the step runs. ``torch.func``'s transforms refuse to run while any
such hooks are open: each runs inside ``torch.autograd.graph.disable_saved_tensors_hooks``
(torch/_functorch/vmap.py ``doesnt_support_saved_tensors_hooks``), which raises when the stack
of default hooks is not empty ("torch.func.{grad, vjp, jacrev, hessian} don't yet support saved
tensor hooks"), so a per-sample-gradient step (``vmap(grad(loss))``) could not be recorded.

While :func:`func_transforms_allowed` is open, ``disable_saved_tensors_hooks`` takes the
recorder's own pair off the stack for its duration (when it is the innermost pair) and puts it
back after, so the transform runs as it does without oomkit. Hooks of the user's own (a
``save_on_cpu`` around the call) stay, and torch refuses them as it would on the GPU.

Where it may differ: tensors saved inside the transform are not noted as saved for backward, so
the breakdown counts them as temporaries; their allocations and frees are recorded as any.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["func_transforms_allowed"]


@contextlib.contextmanager
def func_transforms_allowed(pack: Callable[..., Any], unpack: Callable[..., Any]) -> Iterator[None]:
    """While open, ``disable_saved_tensors_hooks`` sets the recorder's ``pack`` / ``unpack``
    pair aside while it is open (module docstring)."""
    graph = torch.autograd.graph
    own = graph.disable_saved_tensors_hooks
    autograd = torch._C._autograd

    @contextlib.contextmanager
    def disabled(error_message: str) -> Iterator[None]:
        top = autograd._top_saved_tensors_default_hooks(False)
        ours = top is not None and top[0] == pack and top[1] == unpack  # bound methods: ==
        if ours:
            autograd._pop_saved_tensors_default_hooks()
        try:
            with own(error_message):
                yield
        finally:
            if ours:
                autograd._push_saved_tensors_default_hooks(pack, unpack)

    graph.disable_saved_tensors_hooks = disabled
    try:
        yield
    finally:
        graph.disable_saved_tensors_hooks = own

"""Which module's backward is running: autograd hooks that bracket each module call's backward.

Forward hooks see a module start and end; backward has no module hooks of its own, so, as
torch/utils/module_tracker.py and torch/distributed/_tools/mod_tracker.py do, each module call
that runs with grad enabled leaves two markers in the graph:

- *enter*: a hook on each output that requires grad; the first one to fire (the gradient of an
  output is ready, so the module's last op is about to run backward) enters the call;
- *leave*: a hook on each input that requires grad; when all that fire in this backward have
  fired (the gradients of its inputs are complete) the call is left.

Unlike those trackers this one keeps the active calls as a *chain*: every call knows its forward
lineage (the call ids from its root call down to itself), and the chain only ever holds calls
nested in one another, ordered by depth. That makes the innermost call well defined even though
hooks on one tensor fire in registration order (an inner module's output hook before its
parent's) and some calls are never left (a first layer, whose inputs do not require grad):

- entering a call drops the calls that are neither its ancestors nor its descendants (their
  backward is over: backward runs the graph in reverse order), then inserts it by depth;
- leaving a call drops it and its descendants;
- at the end of each backward (an engine callback) the calls it entered are dropped.

A call that is never left (its inputs need no gradient) would otherwise claim whatever backward
runs after its own, such as the gradient of a tensor the user computed before calling the
model. So :meth:`BackwardModules.current` also asks autograd which node is running: every node
has a ``sequence_nr`` taken from a per-thread counter when forward created it
(torch/csrc/autograd/function.h), and a node numbered below a call's first number was created
before that call started, so it is not part of that call's backward.

The hooks hold only the small ``BackwardCall`` records and the tracker, never the module or a
tensor, so they create no reference cycle through the autograd graph (a cycle would keep saved
activations alive until ``gc`` and change when the recorder sees them freed), and they return
``None``, so gradients are untouched.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_leaves

__all__ = ["BackwardCall", "BackwardModules"]

_NO_TASK = -1  # torch._C._current_graph_task_id() outside backward


class BackwardCall:
    """One forward module call as seen by backward: its path and where it nests."""

    __slots__ = (
        "path",
        "lineage",
        "depth",
        "first_seq",
        "leave_hooks",
        "entered_task",
        "left_task",
        "left",
    )

    def __init__(self, path: str, lineage: tuple[int, ...]) -> None:
        self.path = path
        self.lineage = lineage  # call ids from the root call to this one
        self.depth = len(lineage)
        # The sequence_nr the first autograd node made inside this call will get (the counter
        # of this thread; meta tensors run backward on the thread that calls it, as CPU does).
        self.first_seq: int = torch._C._autograd._get_sequence_nr()
        self.leave_hooks = 0  # input hooks registered; the call is left when all have fired
        self.entered_task = _NO_TASK  # graph task that last entered it
        self.left_task = _NO_TASK  # graph task counting its input hooks ...
        self.left = 0  # ... and how many have fired in it

    def nests_with(self, other: BackwardCall) -> bool:
        """Whether one of the two calls ran inside the other (or they are the same call)."""
        outer, inner = (self, other) if self.depth <= other.depth else (other, self)
        return inner.lineage[outer.depth - 1] == outer.lineage[-1]

    def contains(self, other: BackwardCall) -> bool:
        """Whether ``other`` is this call or ran inside it."""
        return other.depth >= self.depth and other.lineage[self.depth - 1] == self.lineage[-1]


class BackwardModules:
    """The chain of module calls whose backward is running, innermost last."""

    def __init__(self) -> None:
        self.chain: list[BackwardCall] = []
        self._callback_tasks: set[int] = set()
        self._active = True

    def close(self) -> None:
        """Stop: hooks still attached to live tensors do nothing from now on."""
        self._active = False
        self.chain.clear()

    def clear(self) -> None:
        """Forget all calls (a new forward or an optimizer step starts outside backward)."""
        self.chain.clear()

    @property
    def current(self) -> BackwardCall | None:
        """The innermost call whose backward is running, if any (call it inside backward)."""
        chain = self.chain
        if not chain:
            return None
        node = torch._C._current_autograd_node()
        if node is None:
            return chain[-1]
        # AccumulateGrad nodes carry UINT64_MAX (function.h): they belong to the current call.
        seq = node._sequence_nr()
        for call in reversed(chain):
            if call.first_seq <= seq:
                return call
        return None

    def watch_inputs(self, call: BackwardCall, args: Any) -> None:
        """Leave ``call`` once the gradients of all its inputs that require grad are ready."""
        for leaf in tree_leaves(args):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                call.leave_hooks += 1
                leaf.register_hook(_Hook(self, call, enter=False))

    def watch_outputs(self, call: BackwardCall, output: Any) -> None:
        """Enter ``call`` once the gradient of any of its outputs that require grad is ready."""
        hook = None
        for leaf in tree_leaves(output):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                if hook is None:
                    hook = _Hook(self, call, enter=True)
                leaf.register_hook(hook)

    # ------------------------------------------------------------------ hook targets

    def _enter(self, call: BackwardCall) -> None:
        task = torch._C._current_graph_task_id()
        # "any" semantics: the first output gradient enters; a call already left in this
        # backward (a module returning its input: both hooks sit on one tensor) stays left.
        if call.entered_task == task or (call.left_task == task and call.left >= call.leave_hooks):
            return
        call.entered_task = task
        self._queue_end_callback(task)
        chain = [c for c in self.chain if c.nests_with(call)]
        at = len(chain)
        while at and chain[at - 1].depth > call.depth:
            at -= 1
        if not (at and chain[at - 1] is call):
            chain.insert(at, call)
        self.chain = chain

    def _leave(self, call: BackwardCall) -> None:
        task = torch._C._current_graph_task_id()
        if call.left_task != task:
            call.left_task = task
            call.left = 0
        call.left += 1
        if call.left == call.leave_hooks:
            # Its sub-calls' backward is over too (some never see their inputs' gradients).
            self.chain = [c for c in self.chain if not call.contains(c)]

    def _queue_end_callback(self, task: int) -> None:
        # Engine::queue_callback (torch/csrc/autograd/engine.cpp) runs it when this graph task
        # finishes; a reentrant backward (reentrant checkpoint) is its own task with its own end.
        if task in self._callback_tasks:
            return
        self._callback_tasks.add(task)

        def end_of_backward() -> None:
            self._callback_tasks.discard(task)
            self.chain = [c for c in self.chain if c.entered_task != task]

        torch.autograd.Variable._execution_engine.queue_callback(end_of_backward)


class _Hook:
    """A tensor hook that enters or leaves one call; returns ``None`` (the gradient is kept)."""

    __slots__ = ("modules", "call", "enter")

    def __init__(self, modules: BackwardModules, call: BackwardCall, *, enter: bool) -> None:
        self.modules = modules
        self.call = call
        self.enter = enter

    def __call__(self, grad: torch.Tensor) -> None:
        modules = self.modules
        if not modules._active:
            return
        if self.enter:
            modules._enter(self.call)
        else:
            modules._leave(self.call)

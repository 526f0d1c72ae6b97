"""The saved RNG states of a compiled checkpoint, in the order AOTAutograd's runtime reads them.

When a compiled region's activation checkpoint recomputes a seeded op (SDPA, dropout) in
backward, the partitioner saves the generator's state for the recompute
(torch/_functorch/partitioners.py ``functionalize_rng_ops``). On CUDA it takes the graph-safe
path (``apply_graphsafe_rng_functionalization``: the states are graph inputs, none is saved);
on any other device, the fake process group's ``cpu`` included, it wraps the op in
``run_and_save_rng_state``, inserts each state among the forward's outputs just before the
saved sizes, and adds a backward placeholder for it just before the tangents.

Both places follow the opaque objects saved for backward (the ``DeviceMesh`` that the DTensor
ops of a tensor-parallel block need in the recompute), while AOTAutograd reads the saved
outputs as tensors, then opaque objects, then sizes
(torch/_functorch/_aot_autograd/schemas.py ``ViewAndMutationMeta``'s
``tensors_saved_for_backwards_*_slice`` and ``opaque_objects_saved_for_backwards_slice``) and
calls the backward with saved tensors, then opaque objects, then gradients
(runtime_wrappers.py, the generated backward's ``all_args``). So a compiled tensor-parallel
block whose checkpoint recomputes SDPA failed on the fake group only
(``_AutogradSavedState.save_from_forward``: "expected all tensors_saved_with_vc_check to be
Tensors"), as a GPU never does. :func:`rng_states_before_opaque_objects` moves each saved state
before the saved opaque objects in both graphs, where the runtime reads tensors: the same
values saved, so the same memory (the state is host memory: ``fake_storages.detach_saved``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch.fx

__all__ = ["rng_states_before_opaque_objects"]

# partitioners.py functionalize_rng_ops names the backward's state placeholders so.
_BACKWARD_STATE_PREFIX = "rng_state_output_"


def _is_opaque(node: Any) -> bool:
    from torch._functorch._aot_autograd.graph_compile import is_opaque_node

    return bool(is_opaque_node(node))


def _reorder_forward(
    fw_module: torch.fx.GraphModule, states: set[torch.fx.Node], num_sym_nodes: int
) -> bool:
    """Put the states before the saved opaque objects that end the saved values."""
    output = next(iter(fw_module.graph.find_nodes(op="output")))
    outputs = list(output.args[0])
    rest = [n for n in outputs if n not in states]
    moved = [n for n in outputs if n in states]
    start = end = len(rest) - num_sym_nodes
    while start > 0 and _is_opaque(rest[start - 1]):
        start -= 1
    if not moved or start == end:
        return False
    output.args = (tuple(rest[:start] + moved + rest[start:]),)
    return True


def _reorder_backward(bw_module: torch.fx.GraphModule) -> None:
    """Put the state placeholders before the saved opaque objects just ahead of them."""
    placeholders = list(bw_module.graph.find_nodes(op="placeholder"))
    first_state = next(
        (i for i, n in enumerate(placeholders) if n.name.startswith(_BACKWARD_STATE_PREFIX)), None
    )
    if first_state is None:
        return
    start = first_state
    while start > 0 and _is_opaque(placeholders[start - 1]):
        start -= 1
    if start == first_state:
        return
    anchor = placeholders[start]
    for node in placeholders[first_state:]:
        if node.name.startswith(_BACKWARD_STATE_PREFIX):
            anchor.prepend(node)


@contextlib.contextmanager
def rng_states_before_opaque_objects() -> Iterator[None]:
    """While open, ``functionalize_rng_ops`` leaves the saved RNG states among saved tensors.

    Nothing moves where no opaque object is saved (the states already follow the tensors).
    """
    from torch._functorch import partitioners
    from torch._prims.rng_prims import run_and_save_rng_state

    original = partitioners.functionalize_rng_ops

    def functionalize_rng_ops(
        joint_module: Any, fw_module: Any, bw_module: Any, num_sym_nodes: int
    ) -> Any:
        fw_module, bw_module = original(joint_module, fw_module, bw_module, num_sym_nodes)
        # The states: element 0 of each run_and_save_rng_state (partitioners.py, Step 2).
        states = {
            user
            for node in fw_module.graph.nodes
            if node.op == "call_function" and node.target is run_and_save_rng_state
            for user in node.users
            if user.args[1:] == (0,)
        }
        if _reorder_forward(fw_module, states, num_sym_nodes):
            _reorder_backward(bw_module)
            fw_module.recompile()
            bw_module.recompile()
        return fw_module, bw_module

    partitioners.functionalize_rng_ops = functionalize_rng_ops
    try:
        yield
    finally:
        partitioners.functionalize_rng_ops = original

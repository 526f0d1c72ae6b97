"""A compiled checkpoint's saved RNG state moves before the saved opaque objects, in both graphs."""

from __future__ import annotations

import torch
import torch.fx

from oomkit.prediction.tracing.compile_rng_order import _reorder_backward, _reorder_forward
from oomkit.prediction.tracing.distributed import fake_process_group


def _forward(mesh) -> tuple[torch.fx.GraphModule, torch.fx.Node]:
    """Outputs as partitioners.py functionalize_rng_ops leaves them: the user output, a mesh
    the block returns, two saved tensors, the saved mesh, then the RNG state."""
    graph = torch.fx.Graph()
    names = ("out", "mesh_out", "saved_a", "saved_b", "saved_mesh", "state")
    nodes = []
    for name in names:
        node = graph.placeholder(name)
        node.meta["val"] = mesh if "mesh" in name else torch.empty(2, device="meta")
        nodes.append(node)
    graph.output(tuple(nodes))
    return torch.fx.GraphModule(torch.nn.Module(), graph), nodes[-1]


def _backward(mesh) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    for name in ("saved_a", "saved_b", "saved_mesh", "rng_state_output_0", "tangents_1"):
        node = graph.placeholder(name)
        node.meta["val"] = mesh if "mesh" in name else torch.empty(2, device="meta")
    graph.output(())
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_the_state_joins_the_saved_tensors_in_both_graphs():
    """Forward: the state goes before the saved mesh (not before the mesh the block returns,
    a user output); backward: its placeholder goes before the saved mesh's, in the order the
    runtime passes saved tensors, then opaque objects, then gradients."""
    with fake_process_group(1) as mesh:
        forward, state = _forward(mesh)
        assert _reorder_forward(forward, {state}, num_sym_nodes=0)
        output = next(iter(forward.graph.find_nodes(op="output")))
        assert [n.name for n in output.args[0]] == [
            "out", "mesh_out", "saved_a", "saved_b", "state", "saved_mesh",
        ]
        backward = _backward(mesh)
        _reorder_backward(backward)
        assert [n.name for n in backward.graph.find_nodes(op="placeholder")] == [
            "saved_a", "saved_b", "rng_state_output_0", "saved_mesh", "tangents_1",
        ]


def test_nothing_moves_without_a_saved_opaque_object():
    """Saved tensors only (FSDP2, no TP): the state already follows them."""
    with fake_process_group(1):
        graph = torch.fx.Graph()
        nodes = []
        for name in ("out", "saved_a", "state"):
            node = graph.placeholder(name)
            node.meta["val"] = torch.empty(2, device="meta")
            nodes.append(node)
        graph.output(tuple(nodes))
        forward = torch.fx.GraphModule(torch.nn.Module(), graph)
        assert not _reorder_forward(forward, {nodes[-1]}, num_sym_nodes=0)

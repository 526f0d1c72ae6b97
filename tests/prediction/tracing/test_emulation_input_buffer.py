"""Autograd's gradient accumulation: in place on CUDA where the engine holds the last reference
(torch/csrc/autograd/input_buffer.cpp accumulate), out of place where it does not.

The tracer runs under a dispatch mode over meta tensors, so ATen's isTensorSubclassLike is true
and the engine always takes ``old_var + var``; the input_buffer emulation makes the CUDA choice.
On an H200 (validation/h200-torch2.11.0.json) the engine added Llama 1B's tied embedding
gradient in place in bf16 and out of place in fp32; the recordings now do the same
(tests/prediction/test_h200_ground_truth.py).
"""

from __future__ import annotations

import torch

from oomkit.prediction.tracing import EmulationRegistry, trace_step
from oomkit.prediction.tracing.emulation import DEFAULT_EMULATIONS
from oomkit.prediction.tracing.emulations import ACCUMULATE_OP

N = 1024
MAT_BYTES = N * N * 4  # one fp32 [N, N] tensor: 4 MiB


def _backward_adds(recording) -> list[int]:
    return [
        e.size for e in recording.events
        if e.action == "alloc" and dict(e.tags).get("op") == "aten.add.Tensor"
        and dict(e.tags).get("phase") == "backward"
    ]


def _leaf() -> torch.Tensor:
    return torch.randn(N, N, device="meta", requires_grad=True)


def test_two_paths_accumulate_into_the_first_gradient():
    """a = x * 2 read by sin and cos: the second gradient is added into the first, no buffer."""

    def step(x):
        a = x * 2
        (a.sin() + a.cos()).sum().backward()
        x.grad = None

    assert _backward_adds(trace_step(step, _leaf())) == []
    # What meta alone records (the emulation left out): a third gradient-sized buffer.
    without = EmulationRegistry(
        {name: hook for name, hook in DEFAULT_EMULATIONS.items() if name != ACCUMULATE_OP}
    )
    assert _backward_adds(trace_step(step, _leaf(), emulations=without)) == [MAT_BYTES]


def test_the_same_gradient_twice_is_added_out_of_place():
    """a + a: AddBackward gives both inputs one tensor, which the engine does not own alone."""

    def step(x):
        a = x * 2
        (a + a).sum().backward()
        x.grad = None

    assert _backward_adds(trace_step(step, _leaf())) == [MAT_BYTES]


def test_an_add_in_a_python_hook_stays_out_of_place():
    """A tensor hook's ``g + ones`` is Python code, not the engine's accumulation."""

    def step(x):
        a = x * 2
        a.register_hook(lambda g: g + torch.ones_like(g))
        a.sin().sum().backward()
        x.grad = None

    assert _backward_adds(trace_step(step, _leaf())) == [MAT_BYTES]


def test_create_graph_accumulates_out_of_place():
    """With grad mode on in backward (create_graph=True) the engine adds out of place on CUDA."""

    def step(x):
        a = x * 2
        (a.sin() + a.cos()).sum().backward(create_graph=True)
        x.grad = None

    assert _backward_adds(trace_step(step, _leaf())) == [MAT_BYTES]

"""torch.func's grad / vjp under the recorder (func_transforms.py): they had refused to run
("torch.func.{grad, vjp, jacrev, hessian} don't yet support saved tensor hooks"), since the
recorder's own saved-tensor hooks were open."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call, grad, vjp, vmap

from oomkit.core.target import Target
from oomkit.prediction.tracing.step_runner import trace_step

MiB = 2**20


def test_per_sample_gradients_are_recorded():
    """vmap(grad(loss)) over 16 samples of a 256 x 256 linear layer: one 16 x 256 x 256 fp32
    gradient (4 MiB) comes out, as on the GPU; the recorder's hooks are back after."""
    with torch.device("meta"):
        model = torch.nn.Linear(256, 256, bias=False)
    params = {k: v.detach() for k, v in model.named_parameters()}
    shapes: list[tuple[int, ...]] = []

    def loss(p, x):
        return functional_call(model, p, (x,)).pow(2).sum()

    def step():
        xs = torch.randn(16, 4, 256, device="meta")
        shapes.append(tuple(vmap(grad(loss), in_dims=(None, 0))(params, xs)["weight"].shape))

    before = torch._C._autograd._top_saved_tensors_default_hooks(False)
    recording = trace_step(step, steps=1, target=Target.resolve("h100"))
    assert shapes == [(16, 256, 256)]
    assert 4 * MiB in [e.size for e in recording.events if e.action == "alloc"]
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) == before


def test_the_user_s_own_hooks_are_refused_as_torch_refuses_them():
    """A save_on_cpu around torch.func.vjp: torch refuses it on the GPU too."""

    def step():
        x = torch.randn(8, device="meta")
        with torch.autograd.graph.save_on_cpu():
            vjp(torch.sin, x)

    with pytest.raises(Exception, match="don't yet support saved tensor hooks"):
        trace_step(step, steps=1, target=Target.resolve("h100"))

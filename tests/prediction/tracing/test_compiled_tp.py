"""What compiling under tensor parallel and activation checkpointing needs, rule by rule.

- A checkpointed region's SDPA is in a subgraph of dynamo's graph (the
  ``tag_activation_checkpoint`` body): it is pointed at the fused kernel CUDA picks, as the
  top-level one is (``compile_backend._fused_sdpa_in``).
- AOTAutograd traces with ``FunctionalTensor``s: one wrapping a fake tensor that stands for
  CUDA memory stands for it too (``fake_storages.stands_for_cuda``).
- ``_c10d_functional.wait_tensor`` hands back its input: in Inductor's plan it is a view of the
  collective's output, whose buffer lives until the wait's last reader (``compile_plan``).
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives  # noqa: F401 - registers _c10d_functional
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

from oomkit.prediction.tracing.compile_plan import WAITS_RETURNING_INPUT, plan_graph
from oomkit.prediction.tracing.fake_storages import mark_host, stands_for_cuda
from oomkit.prediction.tracing.step_runner import trace_step

_functional = torch.ops._c10d_functional


def _node(graph, target, args, val):
    node = graph.call_function(target, args)
    node.meta["val"] = val
    return node


def _gather_wait_mm_graph() -> torch.fx.GraphModule:
    """x (4 x 8 fp32) -> all_gather over 2 ranks (8 x 8) -> wait -> mm with w -> relu -> out."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(4, 8, device="meta")
    w = graph.placeholder("w")
    w.meta["val"] = torch.empty(8, 8, device="meta")
    gathered = _node(
        graph, _functional.all_gather_into_tensor.default, (x, 2, "0"),
        torch.empty(8, 8, device="meta"),
    )
    waited = _node(graph, _functional.wait_tensor.default, (gathered,), torch.empty(8, 8, device="meta"))
    product = _node(graph, torch.ops.aten.mm.default, (waited, w), torch.empty(8, 8, device="meta"))
    relu = _node(graph, torch.ops.aten.relu.default, (product,), torch.empty(8, 8, device="meta"))
    summed = _node(graph, torch.ops.aten.sum.default, (relu,), torch.empty((), device="meta"))
    graph.output((summed,))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_wait_tensor_is_a_view_of_the_collective_s_output():
    """The wait makes no buffer: it aliases the all-gather's 256-byte buffer, which is read
    last by the mm after the wait (node 4), not by the wait itself (node 3)."""
    gm = _gather_wait_mm_graph()
    plan = plan_graph(gm)
    assert "_c10d_functional.wait_tensor.default" in WAITS_RETURNING_INPUT
    assert plan.kinds["wait_tensor_default"] == "view"
    assert plan.bases["wait_tensor_default"] == plan.bases["all_gather_into_tensor_default"]
    assert ("wait_tensor_default", 0) not in plan.buffers
    gathered = plan.buffers[("all_gather_into_tensor_default", 0)]
    assert (gathered.nbytes, gathered.made_at, gathered.last_use) == (8 * 8 * 4, 2, 4)
    # mm's output (256 bytes) is made while the gathered buffer is still read: no reuse of it.
    assert plan.buffers[("mm_default", 0)].reuses is None


def test_a_functional_tensor_stands_for_what_it_wraps():
    """A FunctionalTensor over a device fake tensor stands for CUDA; over a host one, not."""
    with FakeTensorMode():
        device = torch.empty(2, 3)
        host = torch.empty(2, 3)
    mark_host(host)
    with FunctionalTensorMode():
        wrapped_device = FunctionalTensor.to_functional(device)
        wrapped_host = FunctionalTensor.to_functional(host)
    assert isinstance(wrapped_device, FunctionalTensor)
    assert (stands_for_cuda(wrapped_device), stands_for_cuda(wrapped_host)) == (True, False)


class _CheckpointedAttention(torch.nn.Module):
    """q, k, v projections and SDPA inside a non-reentrant checkpoint (as a checkpointed block)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(64, 3 * 64, bias=False)

    def _attend(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(1, 128, 3, 2, 32).permute(2, 0, 3, 1, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self._attend, x, use_reentrant=False)


def test_sdpa_in_a_checkpointed_compiled_region_is_cuda_s_kernel():
    """Compiled, the checkpointed SDPA (bf16, head dim 32, on an H100) runs as the fused
    kernel CUDA picks, forward and backward, never as the composite's CPU or math path."""
    from oomkit.core.target import Target

    def build():
        model = torch.nn.Sequential(_CheckpointedAttention()).to(device="meta", dtype=torch.bfloat16)
        model.compile(fullgraph=True)
        x = torch.empty(1, 128, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)

        def step():
            # torchtitan's apply_compile settings (a checkpointed region under compile).
            with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
                model(x).sum().backward()

        return step

    step = build()
    recording = trace_step(step, target=Target.resolve("h100"), compile=True)
    ops = {dict(e.tags).get("op") for e in recording.events if e.action == "alloc"}
    attention = sorted(op for op in ops if op and "scaled_dot_product" in op)
    assert attention == [
        "aten._scaled_dot_product_cudnn_attention.default",
        "aten._scaled_dot_product_cudnn_attention_backward.default",
    ]

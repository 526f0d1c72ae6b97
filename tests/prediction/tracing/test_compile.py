"""torch.compile recorded GPU-free: Inductor's buffers emulated on AOTAutograd graphs."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from oomkit.prediction.models.gpt2 import GPT2, GPT2Shape
from oomkit.prediction.tracing.compile_plan import plan_graph
from oomkit.prediction.tracing.read_report import COMPILED
from oomkit.prediction.tracing.step_runner import trace_step


def _graph(fn, *args):
    return make_fx(fn)(*args)


def test_pointwise_chain_allocates_one_output():
    """relu(x * 2 + 1) is one fused kernel: one 4 KiB buffer, not three."""
    x = torch.empty(1024, device="meta")
    plan = plan_graph(_graph(lambda t: torch.relu(t * 2 + 1), x))
    assert sorted(plan.materialised) == ["relu"]
    assert plan.allocated_bytes() == 4096


def test_dead_buffer_of_same_size_is_reused():
    """relu (an mm input, so a buffer) is written in place of the dead mm output, and the next
    mm of that size reuses it from the pool: two allocations, not four."""
    x = torch.empty(64, 64, device="meta")

    def fn(a):
        b = torch.mm(a, a)
        c = torch.mm(torch.relu(b), a)
        return torch.mm(c, a)

    plan = plan_graph(_graph(fn, x))
    assert plan.buffers[("relu", 0)].reuses == ("mm", 0)
    assert plan.buffers[("relu", 0)].in_place
    assert plan.buffers[("mm_2", 0)].reuses == ("relu", 0)
    assert plan.allocated_bytes() == 2 * 64 * 64 * 4


def _gpt2_step():
    with torch.device("meta"):
        model = GPT2(GPT2Shape(hidden=128, layers=2, heads=4, vocab=512, positions=256))
        ids = torch.randint(0, 512, (8, 256))
        optimizer = torch.optim.AdamW(model.parameters())
    compiled = torch.compile(model)

    def step(*_tracked):
        logits = compiled(ids)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, 512), ids.view(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, (model, optimizer, ids)


def test_compiled_gpt2_step_is_below_eager_and_says_how():
    """A compiled GPT-2-tiny train step predicts less than eager, and says what is emulated."""
    step, tracked = _gpt2_step()
    eager = trace_step(step, *tracked)
    step, tracked = _gpt2_step()
    compiled = trace_step(step, *tracked, compile=True)
    assert compiled.peak_allocated_bytes() < eager.peak_allocated_bytes()
    assert any(COMPILED in w for w in compiled.warnings)
    assert COMPILED in compiled.assumptions["torch.compile"]
    assert not any("traced eagerly" in w for w in compiled.warnings)

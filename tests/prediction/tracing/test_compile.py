"""torch.compile recorded GPU-free: Inductor's buffers emulated on AOTAutograd graphs."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from oomkit.core.target import Target
from oomkit.prediction import predict_recording
from oomkit.prediction.models import StepOptions
from oomkit.prediction.models.gpt2 import GPT2, GPT2Shape
from oomkit.prediction.summary import COMPILED_RECORDED, verdict_line
from oomkit.prediction.tracing.compile_plan import plan_graph
from oomkit.prediction.tracing.read_report import COMPILED, COMPILED_WARNING
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


def test_pooled_buffer_is_not_held_across_the_peak():
    """A dead buffer is not kept for a later allocation if holding it would raise the graph's
    peak (wrapper.py should_reuse_buffer): the later mm gets a fresh buffer."""
    x = torch.empty(64, 64, device="meta")
    y = torch.empty(256, 256, device="meta")

    def fn(a, b):
        small = torch.mm(a, a)
        small_sum = small.sum()
        big = torch.mm(b, b)
        big_sum = big.sum()
        return small_sum, big_sum, torch.mm(a, a)

    plan = plan_graph(_graph(fn, x, y))
    assert plan.buffers[("mm", 0)].last_use < plan.buffers[("mm_1", 0)].made_at
    assert plan.buffers[("mm_2", 0)].reuses is None
    assert plan.allocated_bytes() == 2 * 64 * 64 * 4 + 256 * 256 * 4 + 2 * 4


def _gpt2_step():
    with torch.device("meta"):
        model = GPT2(GPT2Shape(hidden=128, layers=1, heads=4, vocab=512, positions=256))
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
    verdict = verdict_line(predict_recording(compiled, target=Target.resolve("h100")))
    assert verdict.endswith(" (torch.compile: compiled, Inductor fusion emulated)")


def test_the_report_and_the_recorder_name_a_compiled_recording_alike():
    """The torch-free verdict finds the recorder's own warning for a compiled recording."""
    assert COMPILED_RECORDED == COMPILED_WARNING


def test_compile_refuses_generate_mode():
    """A generate step would recompile per token: StepOptions refuses compile there."""
    with pytest.raises(ValueError, match="compile applies to mode 'train' and 'inference'"):
        StepOptions(mode="generate", compile=True)


def _mlp():
    with torch.device("meta"):
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)
        )
        x = torch.randn(32, 64)
    return model, x


def _partitioner_saved_bytes(model, x):
    """Bytes of the non-input tensors the real min-cut partitioner saves for backward."""
    import functools

    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    graphs = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return make_boxed_func(gm)

    backend = aot_autograd(
        fw_compiler=keep,
        bw_compiler=keep,
        decompositions=select_decomp_table(),
        partition_fn=functools.partial(min_cut_rematerialization_partition, compiler="inductor"),
    )
    torch._dynamo.reset()
    try:
        torch.compile(model, backend=backend)(x).sum().backward()
    finally:
        torch._dynamo.reset()
    model.zero_grad(set_to_none=True)
    output = next(n for n in graphs[0].graph.nodes if n.op == "output")
    saved = output.args[0][1:]  # after the one user output
    return sum(
        n.meta["val"].untyped_storage().nbytes() for n in saved if n.op != "placeholder"
    ), len(saved)


def test_saved_for_backward_is_what_the_partitioner_saves():
    """The compiled forward's saved activations are exactly the real partitioner's choice."""
    model, x = _mlp()
    expected_bytes, saved_count = _partitioner_saved_bytes(model, x)
    # The first Linear's output and the GELU output (32 x 256 fp32 each); x and the weight
    # are inputs, already counted.
    assert (expected_bytes, saved_count) == (2 * 32 * 256 * 4, 4)
    compiled = torch.compile(model)

    def step(*_tracked):
        compiled(x).sum().backward()

    recording = trace_step(step, model, x, compile=True)
    saved_in_forward = sum(
        event.size
        for event in recording.events
        if event.action == "alloc"
        and dict(event.tags).get("phase") == "forward"
        and dict(event.tags).get("saved_for_backward") == "true"
    )
    assert saved_in_forward == expected_bytes


def test_a_graph_the_plan_cannot_handle_is_recorded_eagerly_and_said(monkeypatch):
    """If planning a graph fails, it runs eagerly under the recorder and a warning says why."""
    import oomkit.prediction.tracing.compile_backend as backend

    def refuse(gm):
        raise NotImplementedError("no plan for this graph")

    monkeypatch.setattr(backend, "plan_graph", refuse)
    model, x = _mlp()
    compiled = torch.compile(model)

    def step(*_tracked):
        compiled(x).sum().backward()

    recording = trace_step(step, model, x, compile=True)
    (warning,) = [w for w in recording.warnings if "could not be compiled" in w]
    assert "2 captured graph(s)" in warning and "no plan for this graph" in warning
    # Run as captured: GELU's decomposition allocates its intermediates (erf, add, mul...).
    ops = {dict(e.tags).get("op") for e in recording.events if e.action == "alloc"}
    assert {"aten.erf.default", "aten.mul.Tensor"} <= ops

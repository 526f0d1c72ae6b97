"""A compiled region called with changing shapes: dynamo's automatic dynamic shapes, kept."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from oomkit.prediction.tracing.compile_backend import DYNAMIC_SHAPES
from oomkit.prediction.tracing.compile_plan import plan_graph
from oomkit.prediction.tracing.compiled import RECOMPILE_LIMIT
from oomkit.prediction.tracing.step_runner import trace_step

LENGTHS = (16, 32, 64, 128)


def _over_lengths(lengths=LENGTHS, *, static_dim=False, **compile_options):
    """A step that runs one compiled Linear block over sequences of each length, and backward."""
    with torch.device("meta"):
        linear = torch.nn.Linear(64, 64)
    compiled = torch.compile(lambda x: torch.relu(linear(x) * 2).sum(), **compile_options)

    def step(*_tracked):
        for length in lengths:
            with torch.device("meta"):
                x = torch.randn(8, length, 64, requires_grad=True)
            if static_dim:
                torch._dynamo.mark_static(x, 1)
            compiled(x).backward()

    return trace_step(step, linear, compile=True)


def _addmm_bytes(recording):
    return [
        e.size
        for e in recording.events
        if e.action == "alloc" and dict(e.tags).get("op") == "aten.addmm.default" and e.size < 1 << 20
    ]


def test_a_second_length_recompiles_once_with_the_length_symbolic():
    """As dynamo does by default (config.py automatic_dynamic_shapes): the first length compiles
    static, the second recompiles with the length symbolic, and the later lengths run that
    graph (2 forward and 2 backward graphs, not 4 of each), each at its own size."""
    recording = _over_lengths()
    assumption = recording.assumptions["torch.compile"]
    assert f"(2 backward, 2 forward, 2 {DYNAMIC_SHAPES})" in assumption
    # The Linear's output (8 x length x 64 floats), made by the compiled forward at every length.
    assert _addmm_bytes(recording) == [8 * length * 64 * 4 for length in LENGTHS]


@pytest.mark.parametrize(
    "options", [{"dynamic": False}, {"static_dim": True}], ids=["dynamic=False", "mark_static"]
)
def test_static_shapes_asked_for_recompile_per_length(options):
    """torch.compile(dynamic=False) (automatic_dynamic_shapes off) or mark_static on the length
    keeps every length static: one forward and one backward graph per length."""
    recording = _over_lengths(**options)
    assumption = recording.assumptions["torch.compile"]
    assert "(4 backward, 4 forward)" in assumption
    assert DYNAMIC_SHAPES not in assumption
    assert _addmm_bytes(recording) == [8 * length * 64 * 4 for length in LENGTHS]


def _two_products(x, y, w1, w2):
    a = torch.mm(x, w1)
    a_sum = a.sum()
    b = torch.mm(y, w2)  # 16 x 128 floats: as many bytes as a (32 x 64)
    return a_sum, b.sum()


def _plan(tracing_mode):
    x, y = torch.empty(32, 64, device="meta"), torch.empty(16, 128, device="meta")
    w1, w2 = torch.empty(64, 64, device="meta"), torch.empty(128, 128, device="meta")
    return plan_graph(make_fx(_two_products, tracing_mode=tracing_mode)(x, y, w1, w2))


def test_buffers_of_equal_bytes_but_different_symbolic_sizes_are_not_reused():
    """wrapper.py buffer_reuse_key compares symbolic sizes: static, b (8 KiB) takes a's dead
    buffer; with the sizes symbolic (4*s0*s1 vs 4*s2*s3, equal hints) it gets its own."""
    static = _plan("real")
    assert static.buffers[("mm_1", 0)].reuses == ("mm", 0)
    assert static.allocated_bytes() == 8192 + 2 * 4
    assert not static.symbolic
    dynamic = _plan("symbolic")
    assert dynamic.symbolic
    assert dynamic.buffers[("mm", 0)].nbytes == dynamic.buffers[("mm_1", 0)].nbytes == 8192
    assert dynamic.buffers[("mm", 0)].size_expr != dynamic.buffers[("mm_1", 0)].size_expr
    assert dynamic.buffers[("mm_1", 0)].reuses is None
    assert dynamic.allocated_bytes() == 2 * 8192 + 2 * 4


def test_sizes_computed_in_a_dynamic_graph_are_not_kernels(monkeypatch):
    """8 * s0 (a view's size in the forward) is evaluated by the wrapper: no kernel, no buffer."""
    import oomkit.prediction.tracing.compile_backend as backend

    plans = []
    original = backend.plan_graph
    monkeypatch.setattr(backend, "plan_graph", lambda gm: plans.append(original(gm)) or plans[-1])
    _over_lengths((16, 32))
    (plan,) = [p for p in plans if p.symbolic and "addmm" in p.materialised]
    sizes = [name for name, kind in plan.kinds.items() if kind == "size"]
    assert sizes and not set(sizes) & plan.materialised
    assert sorted(plan.materialised) == ["addmm", "le", "sum_1"]


def test_a_function_past_the_recompile_limit_runs_eagerly_and_is_counted():
    """dynamic=False over ten lengths: dynamo compiles eight (recompile_limit) and runs the
    function eagerly from then on, as on a GPU; the assumption counts the function."""
    lengths = tuple(range(16, 96, 8))  # ten distinct lengths
    recording = _over_lengths(lengths, dynamic=False)
    assumption = recording.assumptions["torch.compile"]
    assert f"(8 backward, 8 forward, 1 {RECOMPILE_LIMIT})" in assumption
    # Every length still ran its Linear, the last two eagerly.
    assert _addmm_bytes(recording) == [8 * length * 64 * 4 for length in lengths]

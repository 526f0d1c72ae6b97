"""The per-op emulation registry."""

from __future__ import annotations

import pytest
import torch

from oomkit.prediction.tracing import DEFAULT_EMULATIONS, EmulationRegistry, Tracer


def test_default_registry_holds_the_builtin_emulations():
    """SDPA (forward, the efficient kernel's forward, 2 backwards, 2 cuDNN), 11 cuBLAS ops
    (float8's _scaled_mm among them), embedding (forward, backward), 2 batch norm, dropout (its
    function and native_dropout), 12 ops of backward formulas' in-place branches, the engine's
    gradient accumulation (aten.add.Tensor), pow with a number base, Tensor.__setitem__, 8
    reductions (sum and mean, each with and without dims; amax, amin, max() and min()), 2 softmax ops (_safe_softmax and the
    softmax backward), F.linear (its bias added in place), the layer norm and its backward,
    _foreach_norm, F.rms_norm with the fused op and its backward, 2 convolution ops, 4 RNN
    functions and _grouped_mm (its fp32 / fp16 fallback)."""
    assert len(DEFAULT_EMULATIONS) == 62
    assert "aten._grouped_mm.default" in DEFAULT_EMULATIONS
    assert "aten.native_layer_norm_backward.default" in DEFAULT_EMULATIONS
    assert "torch.nn.functional.linear" in DEFAULT_EMULATIONS
    assert {"aten._safe_softmax.default", "aten._softmax_backward_data.default"} <= set(
        DEFAULT_EMULATIONS
    )
    assert {"aten.sum.default", "aten.sum.dim_IntList", "aten.mean.default", "aten.mean.dim"} <= set(
        DEFAULT_EMULATIONS
    )
    assert "aten.pow.Scalar" in DEFAULT_EMULATIONS
    assert "aten._foreach_norm.Scalar" in DEFAULT_EMULATIONS
    assert {"torch.nn.functional.rms_norm", "aten._fused_rms_norm.default",
            "aten._fused_rms_norm_backward.default"} <= set(DEFAULT_EMULATIONS)
    assert "torch.Tensor.__setitem__" in DEFAULT_EMULATIONS
    assert "aten.add.Tensor" in DEFAULT_EMULATIONS
    assert "aten._scaled_mm.default" in DEFAULT_EMULATIONS
    assert "aten.convolution_backward.default" in DEFAULT_EMULATIONS
    assert "torch._VF.lstm" in DEFAULT_EMULATIONS
    assert "aten.scatter_add.default" in DEFAULT_EMULATIONS
    assert "aten.native_batch_norm.default" in DEFAULT_EMULATIONS
    assert "torch.nn.functional.dropout" in DEFAULT_EMULATIONS
    assert "torch.nn.functional.scaled_dot_product_attention" in DEFAULT_EMULATIONS
    assert "aten.mm.default" in DEFAULT_EMULATIONS
    assert "aten.embedding_dense_backward.default" in DEFAULT_EMULATIONS


def test_hook_adds_a_workspace_around_the_op():
    """A hook keyed by overload name can wrap the meta op with a synthetic workspace."""
    registry = EmulationRegistry()

    @registry.register("aten.mm.default")
    def mm_with_workspace(ctx):
        workspace = ctx.allocate(1 << 20, "workspace")
        out = ctx.run()
        ctx.free(workspace)
        return out

    a = torch.randn(8, 8, device="meta")
    with Tracer(emulations=registry) as tracer:
        tracer.track(a)
        out = a @ a
    summary = [
        (e.action, e.size, dict(e.tags).get("category"))
        for e in tracer.recording.events
        if e.action != "free_completed"
    ]
    assert summary == [
        ("alloc", 256, "input"),
        ("alloc", 1 << 20, "workspace"),
        ("free_requested", 1 << 20, "workspace"),
        ("alloc", 256, "temporary"),
    ]
    assert not any("aten.mm.default" in w for w in tracer.recording.warnings)
    del out


def test_registering_twice_is_refused():
    """One hook per op per registry."""
    registry = EmulationRegistry()
    registry.register("aten.mm.default")(lambda ctx: ctx.run())
    with pytest.raises(ValueError, match="already has an emulation hook"):
        registry.register("aten.mm.default")(lambda ctx: ctx.run())


def test_a_watched_python_function_is_counted_and_hooked_once_per_call():
    """F.dropout, run from the function mode, asks the other function modes on the stack
    (handle_torch_function); the one that runs it calls reach_backward's wrapper, which enters
    the mode again: that second entry runs the function without its hook (each call was
    counted twice, and a hook that runs the function ran twice)."""
    from oomkit.prediction.tracing import trace_step

    def step(model):
        x = torch.randn(4, 8, device="cuda")
        for _ in range(3):
            torch.nn.functional.dropout(x, 0.1)

    unhooked = trace_step(step, torch.nn.Identity(), emulations=EmulationRegistry())
    assert unhooked.warnings[0].startswith("torch.nn.functional.dropout ran 3 time(s)")
    calls = []
    registry = EmulationRegistry()

    @registry.register("torch.nn.functional.dropout")
    def counted(ctx):
        calls.append(ctx.op_name)
        return ctx.run()

    trace_step(step, torch.nn.Identity(), emulations=registry)
    assert len(calls) == 3

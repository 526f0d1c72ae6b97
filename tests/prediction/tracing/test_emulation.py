"""The per-op emulation registry."""

from __future__ import annotations

import pytest
import torch

from oomkit.prediction.tracing import DEFAULT_EMULATIONS, EmulationRegistry, Tracer


def test_default_registry_holds_the_builtin_emulations():
    """SDPA (forward, the efficient kernel's forward, 2 backwards, 2 cuDNN), 11 cuBLAS ops
    (float8's _scaled_mm among them), embedding (forward, backward), 2 batch norm, dropout (its
    function and native_dropout), 12 ops of backward formulas' in-place branches, the engine's
    gradient accumulation (aten.add.Tensor), pow with a number base, Tensor.__setitem__, 4
    reductions (sum and mean, each with and without dims), 2 softmax ops (_safe_softmax and the
    softmax backward), F.linear (its bias added in place), the layer norm backward,
    _foreach_norm, 2 convolution ops and 4 RNN functions."""
    assert len(DEFAULT_EMULATIONS) == 53
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

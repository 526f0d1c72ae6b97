"""Tests for where a predicted OOM happens: the phase, and for optimizer state its parameter."""

from __future__ import annotations

import pytest

from oomkit.core.gpus import GpuSpec
from oomkit.prediction.predictor import OomPoint
from oomkit.prediction.summary import oom_phase, oom_place, verdict_line

torch = pytest.importorskip("torch")
import oomkit  # noqa: E402

MiB = 2**20


def _point(**fields):
    base = dict(event_index=0, step=1, op=None, module=None, category=None, requested_bytes=1,
                message="")
    return OomPoint(**(base | fields))


@pytest.mark.parametrize(
    ("fields", "phase", "place"),
    [
        (
            dict(phase="optimizer", category="optimizer_state", module="layers.7.mlp.gate_proj",
                 parameter="layers.7.mlp.gate_proj.weight", optimizer="AdamW",
                 op="aten.zeros_like.default"),
            "optimizer state creation",
            "in optimizer.step(): AdamW state for layers.7.mlp.gate_proj.weight "
            "(aten.zeros_like.default)",
        ),
        (
            dict(phase="optimizer", category="temporary", module=None, optimizer=None,
                 op="aten._foreach_add.List"),
            "optimizer step",
            "in optimizer.step() (aten._foreach_add.List)",
        ),
        (
            dict(phase="backward", category="gradient", module="h.3.attn",
                 parameter="h.3.attn.c_attn.weight", op="aten.mm.default"),
            "backward",
            "in the backward pass in h.3.attn: the gradient of h.3.attn.c_attn.weight "
            "(aten.mm.default)",
        ),
        (
            dict(phase="user", category="temporary", op="aten._log_softmax.default"),
            "loss",
            "in the loss (aten._log_softmax.default)",
        ),
        (
            dict(phase="forward", category="activation", module="CrossEntropyLoss",
                 op="aten._to_copy.default"),
            "loss",
            "in the loss in CrossEntropyLoss (aten._to_copy.default)",
        ),
        (
            dict(phase="forward", category="activation", module="h.0.mlp", op="aten.mm.default"),
            "forward",
            "in the forward pass in h.0.mlp (aten.mm.default)",
        ),
        (dict(module="h.0", op="aten.mm.default"), None, "in h.0 (aten.mm.default)"),
    ],
)
def test_phase_and_place_name_what_ran_out(fields, phase, place):
    """Each phase the tracer tags is named; optimizer state names its optimizer and parameter."""
    point = _point(**fields)
    assert oom_phase(point) == phase
    assert oom_place(point) == place


def _linear_step():
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4096, 4096, bias=False))
        opt = torch.optim.AdamW(model.parameters(), foreach=True)
        x = torch.randn(8, 4096)

    def step(model, opt, x):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, model, opt, x


@pytest.mark.parametrize(
    ("usable_mib", "verdict"),
    [
        # The weight, its gradient and each Adam state are 64 MiB (4096 x 4096 fp32); with
        # 200 MiB usable AdamW's first step cannot make exp_avg (adam.py _init_group zeros_like).
        (
            200,
            "would OOM at step 1 in optimizer.step(): AdamW state for 0.weight "
            "(aten.zeros_like.default) requesting 64.00 MiB on tiny",
        ),
        # With 150 MiB the weight's gradient (mm in backward) is what does not fit.
        (
            150,
            "would OOM at step 1 in the backward pass in 0: the gradient of 0.weight "
            "(aten.mm.default) requesting 64.00 MiB on tiny",
        ),
        # With 350 MiB the states fit and foreach AdamW's whole-group sqrt temporary does not.
        (
            350,
            "would OOM at step 1 in optimizer.step() (aten._foreach_sqrt.default) requesting "
            "64.00 MiB on tiny",
        ),
    ],
)
def test_the_verdict_names_the_phase_and_the_parameter(usable_mib, verdict):
    """A real traced step: the verdict says optimizer.step() with AdamW and the parameter for
    state creation, the backward pass with the gradient's parameter, and not a forward op."""
    step, model, opt, x = _linear_step()
    gpu = GpuSpec("tiny", (usable_mib + 20) * MiB, 20 * MiB)
    p = oomkit.predict(step, model, opt, x, gpu=gpu, steps=1)
    assert p.oom is not None
    assert verdict_line(p).startswith(verdict + ": the step needs about 386.00 MiB reserved")
    if usable_mib == 200:
        assert (p.oom.phase, p.oom.category) == ("optimizer", "optimizer_state")
        assert (p.oom.parameter, p.oom.optimizer) == ("0.weight", "AdamW")

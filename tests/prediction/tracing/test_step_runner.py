"""trace_step and oomkit.predict run the step on meta, refuse CPU models and empty recordings,
and trace compiled code eagerly, saying so."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import oomkit  # noqa: E402
from oomkit.core.target import Target  # noqa: E402
from oomkit.errors import EmptyRecordingError, UserCodeError  # noqa: E402
from oomkit.interfaces.reports.prediction import COMPILED_EAGERLY, verdict_line  # noqa: E402
from oomkit.prediction import predict_recording  # noqa: E402
from oomkit.prediction.tracing import trace_step  # noqa: E402
from oomkit.prediction.tracing.read_report import (  # noqa: E402
    COMPILED_EAGERLY as RECORDED_COMPILED_EAGERLY,
)


def test_predict_runs_a_step_that_names_no_device_on_meta():
    """Tensors made without device= in the step land on meta: the same bytes as device='meta'."""

    def implicit():
        model = torch.nn.Linear(256, 256)
        model(torch.randn(64, 256)).sum().backward()

    def explicit():
        model = torch.nn.Linear(256, 256, device="meta")
        model(torch.randn(64, 256, device="meta")).sum().backward()

    got = oomkit.predict(implicit, steps=1)
    want = oomkit.predict(explicit, steps=1)
    assert got.peak_allocated_bytes == want.peak_allocated_bytes > 0
    assert not any("no device allocations" in w for w in got.warnings)


def test_predict_refuses_a_model_left_on_the_cpu():
    """A CPU model would train on the CPU, for real: refused before any step runs."""
    ran = []
    model = torch.nn.Linear(4, 4)

    def step(model):
        ran.append(1)
        model(torch.randn(2, 4, device="cpu"))

    # predict's own check (the module's parameters) refuses it first, with what to do.
    with pytest.raises(UserCodeError, match="a Linear passed to oomkit.predict .* on the CPU"):
        oomkit.predict(step, model)
    assert ran == []
    # trace_step alone (no module check there) refuses it as an empty recording, still unrun.
    with pytest.raises(EmptyRecordingError, match=r"2 parameter\(s\) passed in \(80 bytes\) are on cpu"):
        trace_step(step, model, require_allocations=True)
    assert ran == []


def test_predict_refuses_a_step_that_allocates_nothing_on_meta_after_one_step():
    """A step whose tensors are all on the CPU records nothing: refused after its first run."""
    ran = []

    def step():
        ran.append(1)
        torch.ones(3, device="cpu") * 2

    with pytest.raises(EmptyRecordingError, match="the step allocated nothing on the meta device"):
        oomkit.predict(step, steps=3)
    assert ran == [1]


def test_trace_step_still_records_an_empty_step_when_not_asked_to_refuse():
    """trace_step (the recorder's API) records what it is given, even nothing."""
    assert trace_step(lambda: None).events == ()


def test_compiled_code_is_traced_eagerly_and_said_so():
    """A torch.compile'd module records eager bytes, with a warning and a verdict mark."""

    def fresh():
        with torch.device("meta"):
            model = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.GELU())
            return model, torch.randn(32, 128)

    def step(model, x):
        model(x).sum().backward()

    eager = predict_recording(trace_step(step, *fresh()), target=Target.resolve("h100"))
    model, x = fresh()
    traced = trace_step(step, torch.compile(model), x)  # torch's hook warning: silenced
    got = predict_recording(traced, target=Target.resolve("h100"))
    assert got.peak_allocated_bytes == eager.peak_allocated_bytes
    (warning,) = [w for w in got.warnings if w.startswith(COMPILED_EAGERLY)]
    assert "compiled code was entered 1 time(s)" in warning
    assert "test_step_runner.py:" in warning
    assert verdict_line(got).endswith(" (torch.compile traced eagerly)")
    assert not verdict_line(eager).endswith("(torch.compile traced eagerly)")


def test_the_report_and_the_recorder_name_compiled_code_alike():
    """The torch-free report marks the verdict by the recorder's own warning text."""
    assert COMPILED_EAGERLY == RECORDED_COMPILED_EAGERLY

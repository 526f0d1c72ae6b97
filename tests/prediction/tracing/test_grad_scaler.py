"""A disabled GradScaler made before the recording is counted and named in the warnings;
one made while CUDA is emulated is recorded (test_script_run.py) and not warned about."""

from __future__ import annotations

import warnings

import torch

from oomkit.prediction.tracing import trace_step


def _two_steps(scaler_of):
    """Two traced steps of a Linear through ``scaler_of()``'s scale, step and update."""
    with torch.device("meta"):
        model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(model, optimizer, x):
        scaler = scaler_of()
        scaler.scale(model(x).sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()

    return trace_step(step, model, optimizer, torch.randn(2, 4, device="meta"), steps=2)


def test_grad_scaler_step_is_warned_about_with_its_count():
    """A scaler made in this session without CUDA (torch disables it), two steps: one warning
    that names it, says it stepped twice and what a GPU's would hold."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no CUDA here: the scaler disables itself
        scaler = torch.amp.GradScaler("cuda")
    recording = _two_steps(lambda: scaler)
    assert len(recording.warnings) == 1
    assert recording.warnings[0].startswith("a disabled torch.amp.GradScaler stepped 2 time(s)")
    assert "make it in the builder or the step" in recording.warnings[0]


def test_a_scaler_made_in_the_step_is_recorded_without_a_warning():
    """Made inside the recording (CUDA emulated), the scaler is enabled: its float32 scale and
    int32 growth tracker are allocated at its first scale(), and nothing is warned."""
    made = {}
    recording = _two_steps(lambda: made.setdefault("scaler", torch.amp.GradScaler("cuda")))
    assert recording.warnings == ()
    fulls = [e.size for e in recording.step_events(0)
             if e.action == "alloc" and dict(e.tags).get("op") == "aten.full.default"]
    assert fulls == [4, 4, 4]  # scale, growth tracker, found_inf


def test_grad_scaler_step_is_restored_after_tracing():
    """The wrappers are removed when the tracer exits."""
    init, step = torch.amp.GradScaler.__init__, torch.amp.GradScaler.step
    trace_step(lambda: None)
    assert (torch.amp.GradScaler.__init__, torch.amp.GradScaler.step) == (init, step)

"""A GradScaler in traced code is counted and named in the warnings."""

from __future__ import annotations

import warnings

import torch

from oomkit.prediction.tracing import trace_step


def test_grad_scaler_step_is_warned_about_with_its_count():
    """Two steps through GradScaler.step: one warning that names it and says it ran twice."""
    with torch.device("meta"):
        model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no CUDA here: the scaler disables itself
        scaler = torch.amp.GradScaler("cuda")

    def step(model, optimizer, x):
        scaler.scale(model(x).sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()

    x = torch.randn(2, 4, device="meta")
    recording = trace_step(step, model, optimizer, x, steps=2)
    assert len(recording.warnings) == 1
    assert recording.warnings[0].startswith("torch.amp.GradScaler.step ran 2 time(s)")
    assert "skips" in recording.warnings[0]


def test_grad_scaler_step_is_restored_after_tracing():
    """The counting wrapper is removed when the tracer exits."""
    original = torch.amp.GradScaler.step
    trace_step(lambda: None)
    assert torch.amp.GradScaler.step is original

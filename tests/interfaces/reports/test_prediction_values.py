"""The terminal report shows answered tensor values on their own lines, and compiled code in the
verdict."""

from __future__ import annotations

import dataclasses
import io

import pytest

pytest.importorskip("torch")

from rich.console import Console  # noqa: E402

from oomkit.core.target import Target
from oomkit.interfaces.reports.prediction import (  # noqa: E402
    COMPILED_EAGERLY,
    kernels_line,
    render_prediction,
    verdict_line,
)
from oomkit.prediction import predict_recording  # noqa: E402
from oomkit.prediction.tracing import trace_step  # noqa: E402


def _prediction(**changes):
    import torch

    with torch.device("meta"):
        model = torch.nn.Linear(8, 8)
        x = torch.randn(4, 8)
    recording = trace_step(lambda m, x: m(x).sum().backward(), model, x)
    return dataclasses.replace(
        predict_recording(recording, target=Target.resolve("h100")), **changes
    )


def test_answered_values_get_their_own_lines_not_the_kernels_line():
    """'read at ...' assumptions print as 'assumed:' lines; the kernels line keeps cuDNN."""
    p = _prediction(
        assumptions={
            "cuDNN": "9.20.0",
            "read at masking_utils.py:292 in _ignore_causal_mask_sdpa": "bool() = True, [x]",
        },
        kernel_choices={"SDPA flash_attention": 2},
    )
    out = io.StringIO()
    render_prediction(p, Console(file=out, width=200, color_system=None))
    text = out.getvalue()
    assert (
        "assumed: read at masking_utils.py:292 in _ignore_causal_mask_sdpa: bool() = True, [x]"
        in text
    )
    assert "read at" not in kernels_line(p)
    assert "cuDNN 9.20.0" in kernels_line(p)


def test_the_verdict_says_when_compiled_code_was_traced_eagerly():
    """A compile warning in the prediction marks the verdict line."""
    plain = _prediction()
    compiled = _prediction(warnings=(f"{COMPILED_EAGERLY}: compiled code was entered 1 time(s)",))
    assert verdict_line(compiled) == verdict_line(plain) + " (torch.compile traced eagerly)"

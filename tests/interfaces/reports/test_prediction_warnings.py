"""Tests for the prediction report's warnings: benign notes on one info line, the verdict last."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from oomkit.core.gpus import GpuSpec
from oomkit.core.target import Target
from oomkit.core.trace import TraceEvent

pytest.importorskip("torch")
from oomkit.interfaces.reports.prediction import render_prediction, split_warnings  # noqa: E402
from oomkit.prediction import predict_recording  # noqa: E402
from oomkit.prediction.tracing import TraceRecording  # noqa: E402

MiB = 2**20
CUDNN_FWD = (
    "aten._scaled_dot_product_cudnn_attention.default ran 96 time(s); its CUDA memory is emulated "
    "except any workspace the cuDNN attention engine asks for (sized by cuDNN at run time), which "
    "is not included"
)
CUDNN_BWD = CUDNN_FWD.replace("attention.default", "attention_backward.default")
LOGGED = (
    "trainer.py:2400 in _inner_training_loop: .item() read a tensor value that oomkit cannot know "
    "on the meta device (2 time(s)); it got a stand-in (printed as nan; 1.0, finite, as a "
    "number), which was only printed, logged or passed on, never used as a size, a loop bound or "
    "a condition. If it matters, state it"
)
REAL = "3 ops were not traced: their memory is missing"


def test_benign_warnings_merge_into_one_info_line():
    """The two cuDNN notes and a logged .item() become one info line with counts; a warning
    the user can act on stays a warning, in order."""
    actionable, info = split_warnings([CUDNN_FWD, REAL, CUDNN_BWD, LOGGED])
    assert actionable == [REAL]
    assert info == (
        "cuDNN attention workspaces are sized by cuDNN at run time and not included (2 notes); "
        "tensor values read only for logging got stand-ins"
    )
    assert split_warnings([REAL]) == ([REAL], "")
    # The forward and backward ops in one note, as the recorder groups them.
    both = CUDNN_FWD.replace(
        "ran 96 time(s); its",
        "ran 96 time(s), aten._scaled_dot_product_cudnn_attention_backward.default ran 96 "
        "time(s); their",
    )
    assert split_warnings([both, REAL]) == (
        [REAL],
        "cuDNN attention workspaces are sized by cuDNN at run time and not included",
    )


def test_the_verdict_is_the_last_line():
    """Warnings and the info line come before the verdict, which ends the report."""
    events = (TraceEvent("alloc", 1, 3 * MiB, tags=(("category", "activation"),)),)
    recording = TraceRecording(events=events, warnings=(CUDNN_FWD, REAL), step_starts=(0,))
    p = predict_recording(recording, target=Target.resolve(GpuSpec("test GPU", 2**30, 100 * MiB)))
    out = io.StringIO()
    render_prediction(p, Console(file=out, width=300, color_system=None))
    lines = out.getvalue().splitlines()
    assert lines[-3:] == [
        f"warning: {REAL}",
        "info: cuDNN attention workspaces are sized by cuDNN at run time and not included",
        "fits on test GPU: peak reserved 20.00 MiB of 924.00 MiB usable, 904.00 MiB headroom",
    ]


def test_prediction_json_carries_the_measured_remedies():
    """prediction_to_json(remedies=...) saves each with fits and the peak it needs; without
    remedies there is no key."""
    from oomkit.diagnose.measured_remedy import MeasuredRemedy
    from oomkit.interfaces.reports.prediction import prediction_to_json

    events = (TraceEvent("alloc", 1, 3 * MiB, tags=(("category", "activation"),)),)
    p = predict_recording(TraceRecording(events=events, step_starts=(0,)),
                          target=Target.resolve(GpuSpec("test GPU", 2**30, 100 * MiB)))
    assert "remedies" not in prediction_to_json(p)
    remedy = MeasuredRemedy("pure bf16", 5 * MiB, "high", "", "why", estimate=False, fits=True,
                            peak_reserved_bytes=15 * MiB, flag="--precision bf16")
    saved = prediction_to_json(p, remedies=[remedy])["remedies"]
    assert [(r["title"], r["fits"], r["peak_reserved_bytes"], r["flag"]) for r in saved] == [
        ("pure bf16", True, 15 * MiB, "--precision bf16")
    ]


def test_remedies_print_just_before_the_verdict():
    """render_prediction(remedies=...) prints the remedy block, then the verdict last."""
    from oomkit.diagnose.measured_remedy import MeasuredRemedy

    events = (TraceEvent("alloc", 1, 3 * MiB, tags=(("category", "activation"),)),)
    p = predict_recording(TraceRecording(events=events, step_starts=(0,)),
                          target=Target.resolve(GpuSpec("test GPU", 2**30, 100 * MiB)))
    remedy = MeasuredRemedy("pure bf16", 5 * MiB, "high", "", "why", estimate=False, fits=True,
                            peak_reserved_bytes=15 * MiB, flag="--precision bf16")
    out = io.StringIO()
    render_prediction(p, Console(file=out, width=300, color_system=None), remedies=[remedy])
    assert out.getvalue().splitlines()[-3:] == [
        "What would make it fit (measured by re-predicting the step):",
        "  1. pure bf16 (--precision bf16) — needs 15.00 MiB reserved, fits, saves 5.00 MiB",
        "fits on test GPU: peak reserved 20.00 MiB of 924.00 MiB usable, 904.00 MiB headroom",
    ]

"""An autocast("cuda") built once and reused (nanoGPT's ``ctx``) is never a silent fp32 step."""

from __future__ import annotations

import json
import textwrap
import warnings

import pytest

torch = pytest.importorskip("torch")

from oomkit.core.target import Target  # noqa: E402
from oomkit.interfaces.cli import main  # noqa: E402
from oomkit.prediction import predict_recording  # noqa: E402
from oomkit.prediction.tracing import cuda_autocast_construction, trace_step  # noqa: E402

DISABLED = "torch.autocast('cuda') was entered"


def _disabled_autocast():
    """What torch builds without a GPU (and without oomkit's construction emulation)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "CUDA is not available ... Disabling autocast"
        return torch.amp.autocast(device_type="cuda", dtype=torch.bfloat16)


def _model_and_input():
    with torch.device("meta"):
        model = torch.nn.Sequential(
            torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)
        )
        x = torch.randn(8192, 256)
    return model, x


def _record(make_ctx):
    """Peak allocated bytes, and warnings, of one training step run under ``make_ctx()``."""
    model, x = _model_and_input()
    ctx = make_ctx()

    def step(model, x):
        with ctx:
            loss = model(x).float().square().mean()
        loss.backward()

    recording = trace_step(step, model, x, steps=1)
    return predict_recording(recording, target=Target.resolve("h100")).peak_allocated_bytes, recording.warnings


def _fp32_peak():
    return _record(lambda: torch.autocast("cpu", enabled=False))[0]


def test_construction_builds_cuda_autocast_enabled_and_restores():
    """Under the construction emulation autocast('cuda') is enabled; after it, torch's own rule."""
    with cuda_autocast_construction(), cuda_autocast_construction():  # nesting is a no-op
        ctx = torch.amp.autocast(device_type="cuda", dtype=torch.bfloat16)
        off = torch.autocast("cuda", enabled=False)
    assert (ctx._enabled, ctx.fast_dtype, off._enabled) == (True, torch.bfloat16, False)
    assert _disabled_autocast()._enabled is False


def test_a_reused_autocast_built_under_construction_records_the_bf16_step():
    """ctx built before the trace (in a builder) records what ctx built inside the step does."""
    inside_peak, inside_warnings = _record(lambda: _LazyAutocast())
    with cuda_autocast_construction():
        reused_peak, reused_warnings = _record(
            lambda: torch.amp.autocast(device_type="cuda", dtype=torch.bfloat16)
        )
    assert reused_peak == inside_peak
    assert reused_peak < _fp32_peak()
    assert not any(DISABLED in w for w in (*inside_warnings, *reused_warnings))


def test_an_autocast_disabled_for_want_of_cuda_is_warned_about():
    """Built outside any emulation, torch disabled it: fp32 is recorded, and the report says so."""
    peak, recorded_warnings = _record(_disabled_autocast)
    assert peak == _fp32_peak()
    (warning,) = [w for w in recorded_warnings if DISABLED in w]
    assert warning.startswith("torch.autocast('cuda') was entered 1 time(s) disabled")
    assert "cuda_autocast_construction()" in warning


def test_enabled_false_on_purpose_is_not_warned_about():
    """autocast('cuda', enabled=False) built under the emulation is the user's choice: silent."""
    with cuda_autocast_construction():
        peak, recorded_warnings = _record(lambda: torch.autocast("cuda", enabled=False))
    assert peak == _fp32_peak()
    assert not any(DISABLED in w for w in recorded_warnings)


class _LazyAutocast:
    """Builds the autocast when entered, i.e. inside the step (the reference)."""

    def __enter__(self):
        self._ctx = torch.amp.autocast(device_type="cuda", dtype=torch.bfloat16)
        return self._ctx.__enter__()

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


NANOGPT_STYLE = """
import torch

# nanoGPT's train.py builds the autocast context once, at module level, and reuses it.
ctx = torch.amp.autocast(device_type="cuda", dtype=torch.bfloat16)

def build(batch_size, reuse_module_ctx=True):
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)
    )
    x = torch.randn(batch_size, 256)
    builder_ctx = torch.autocast("cuda", dtype=torch.bfloat16)

    def step():
        with (ctx if reuse_module_ctx else builder_ctx):
            loss = model(x).float().square().mean()
        loss.backward()

    return step, (model, x)

def build_reference(batch_size):
    return build(batch_size, reuse_module_ctx=False)
"""


def test_cli_runs_the_file_and_builder_as_on_cuda(tmp_path, capsys):
    """A module-level and a builder-made autocast both predict the bf16 step, with no warning."""
    path = tmp_path / "nanogpt_style.py"
    path.write_text(textwrap.dedent(NANOGPT_STYLE))
    results = []
    for function in ("build", "build_reference"):
        argv = ["predict", f"{path}:{function}", "--batch", "8192", "--steps", "1", "--json"]
        assert main(argv) == 0
        results.append(json.loads(capsys.readouterr().out))
    module_ctx, builder_ctx = results
    assert module_ctx["peak_allocated_bytes"] == builder_ctx["peak_allocated_bytes"]
    assert module_ctx["peak_allocated_bytes"] < _fp32_peak()
    assert not any(DISABLED in w for r in results for w in r["warnings"])

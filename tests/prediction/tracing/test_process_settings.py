"""A builder's memory fraction and allocator settings hold for its steps (process_settings.py)."""

from __future__ import annotations

import json
import textwrap

import pytest

from oomkit.core.target import Target
from oomkit.interfaces.cli import main
from oomkit.prediction.predictor import predict
from oomkit.scenario.user_function import load_user_step

MiB = 2**20
H100 = Target.resolve("h100")

BUILDER = """
import torch

AT_IMPORT

def build(batch_size=8):
    IN_BUILDER
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                                torch.nn.Linear(4096, 1024)).cuda()
    opt = torch.optim.AdamW(model.parameters())

    def step():
        IN_STEP
        x = torch.randn(batch_size, 128, 1024, device="cuda")
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    return step, (model, opt)
"""

FRACTION = "torch.cuda.set_per_process_memory_fraction(0.001)"
EXPANDABLE = 'torch.cuda.memory._set_allocator_settings("expandable_segments:True")'


def _predict(tmp_path, *, at_import="", in_builder="", in_step="", batch_size=8):
    source = (
        BUILDER.replace("AT_IMPORT", at_import)
        .replace("IN_BUILDER", in_builder or "pass")
        .replace("IN_STEP", in_step or "pass")
    )
    (tmp_path / "build.py").write_text(textwrap.dedent(source))
    user = load_user_step(f"{tmp_path / 'build.py'}:build", batch_size=batch_size, gpu=H100.gpu)
    return predict(user.step_fn, track=user.track, steps=2, target=H100)


def _facts(prediction):
    return (
        prediction.usable_bytes,
        prediction.fits,
        prediction.peak_reserved_bytes,
        prediction.peak_allocated_bytes,
    )


@pytest.mark.parametrize("where", ["at_import", "in_builder"])
@pytest.mark.parametrize("call", [FRACTION, EXPANDABLE])
def test_a_call_before_the_steps_holds_as_if_made_at_the_first_step(tmp_path, where, call):
    """set_per_process_memory_fraction and _set_allocator_settings made by the file or the
    builder hold for the steps, as in the process on the GPU: the prediction is the one of the
    same call made at the step's start. They had gone to an allocator no recording read (the
    whole GPU usable, the target's settings)."""
    before = _predict(tmp_path, **{where: call})
    in_step = _predict(tmp_path, in_step=call)
    assert _facts(before) == _facts(in_step)
    plain = _predict(tmp_path)
    assert _facts(before) != _facts(plain)
    if call == FRACTION:
        # allowed_memory_maximum: 0.1% of the H100's 85,028,896,768 bytes, rounded
        # (setMemoryFraction: round(f * totalGlobalMem)), less than the step needs.
        assert before.usable_bytes == 85_028_897
        assert not before.fits and plain.fits


def test_each_recording_of_the_built_step_gets_the_calls(tmp_path):
    """The step function predicted twice: both recordings hold the builder's fraction."""
    source = BUILDER.replace("AT_IMPORT", "").replace("IN_BUILDER", FRACTION)
    (tmp_path / "build.py").write_text(textwrap.dedent(source.replace("IN_STEP", "pass")))
    user = load_user_step(f"{tmp_path / 'build.py'}:build", batch_size=8, gpu=H100.gpu)
    first = predict(user.step_fn, track=user.track, steps=1, target=H100)
    second = predict(user.step_fn, track=user.track, steps=1, target=H100)
    assert first.usable_bytes == second.usable_bytes == 85_028_897


@pytest.mark.parametrize("where", ["IN_BUILDER", "IN_STEP"])
def test_fit_keeps_the_margin_under_the_process_s_fraction(tmp_path, capsys, where):
    """fit of a builder, or of a step, that limits its process to 5% of an H100: the answer's
    usable memory is that limit, and the margin stays free below it (the margin had come off
    the GPU's usable memory only, so the answer left less than the margin under the limit)."""
    fraction = "torch.cuda.set_per_process_memory_fraction(0.05)"
    source = BUILDER.replace("AT_IMPORT", "").replace(where, fraction)
    source = source.replace("IN_BUILDER", "pass").replace("IN_STEP", "pass")
    (tmp_path / "build.py").write_text(textwrap.dedent(source))
    code = main(["fit", f"{tmp_path / 'build.py'}:build", "--gpu", "h100", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0, out
    limit = 4_251_444_838  # round(0.05 * 85,028,896,768)
    assert out["usable_bytes"] == limit
    assert out["headroom_bytes"] == limit - out["peak_reserved_bytes"]
    assert out["headroom_bytes"] >= out["margin_bytes"] > 0
    nxt = _predict(tmp_path, in_builder=fraction, batch_size=out["first_failing_batch"])
    assert nxt.required_bytes + out["margin_bytes"] > limit

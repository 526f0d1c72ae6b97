"""Reads of tensor values in a traced step: stand-ins for logged values, errors for deciding ones."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from oomkit.core.target import Target  # noqa: E402
from oomkit.errors import ConfigError, DataDependentValueError  # noqa: E402
from oomkit.prediction import predict_recording  # noqa: E402
from oomkit.prediction.tracing import StandIn, trace_step  # noqa: E402
from oomkit.prediction.tracing.stand_ins import STAND_IN_VALUE  # noqa: E402
from oomkit.prediction.tracing.value_reads import parse_stated_values  # noqa: E402

HERE = Path(__file__).name  # how --value names a line
SHOWN = os.path.relpath(__file__)  # how messages show it (relative to the working directory)


def _line_of(fn, text):
    """The line number of the first source line of ``fn`` containing ``text``."""
    import inspect

    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


def _model():
    with torch.device("meta"):
        model = torch.nn.Linear(64, 64)
        x = torch.randn(32, 64)
    return model, x


def _peak(recording):
    return predict_recording(recording, target=Target.resolve("h100")).peak_allocated_bytes


def test_a_logged_item_gets_a_stand_in_and_is_listed_with_its_line():
    """loss.item() only formatted and printed: same bytes as without it, one warning naming it."""
    model, x = _model()
    seen = []

    def logged(model, x):
        loss = model(x).square().mean()
        loss.backward()
        lossf = loss.item() * 2.0  # arithmetic keeps the stand-in
        seen.append((lossf, f"{lossf:.3f}", f"{loss:.2f}", float(loss)))

    def plain(model, x):
        model(x).square().mean().backward()

    with_read = trace_step(logged, model, x, steps=2)
    without = trace_step(plain, *_model(), steps=2)
    assert _peak(with_read) == _peak(without)
    lossf, text, formatted, as_float = seen[0]
    # Shown as nan, finite as a number (math.isfinite holds, as the finite-values assumption).
    assert isinstance(lossf, StandIn) and math.isfinite(lossf) and str(lossf) == "nan"
    assert (text, formatted) == ("nan", "nan")
    assert as_float == STAND_IN_VALUE and not isinstance(as_float, StandIn)  # Python's float()
    line = _line_of(logged, "lossf = loss.item()")
    read = [w for w in with_read.warnings if f"{SHOWN}:{line} in logged" in w]
    assert len(read) == 1
    assert "Tensor.item() read a tensor value that oomkit cannot know" in read[0]
    assert "(2 time(s)); it got a stand-in (printed as nan; 1.0, finite, as a number)" in read[0]
    assert f"--value {HERE}:{line}=NUMBER" in read[0]
    (by_float,) = [w for w in with_read.warnings if "float() read" in w]
    assert "cannot tell whether it decided a size or a branch" in by_float


def test_a_read_that_sizes_a_tensor_is_an_error_naming_both_lines():
    """n = int(x.sum().item()) then torch.zeros(n): refused at the use, naming the read."""
    model, x = _model()

    def sized(model, x):
        n = x.sum().item()
        torch.zeros(int(n))

    line = _line_of(sized, "n = x.sum().item()")
    use = _line_of(sized, "torch.zeros(int(n))")
    with pytest.raises(DataDependentValueError) as raised:
        trace_step(sized, model, x)
    message = str(raised.value)
    assert message.startswith(f"{SHOWN}:{use} in sized: a tensor value read at {SHOWN}:{line}")
    assert "used as an integer (a size, an index or a loop bound)" in message
    assert f"--value {HERE}:{line}=NUMBER" in message


@pytest.mark.parametrize(
    ("use", "what"),
    [
        (lambda v: range(v), "an integer"),
        (lambda v: v > 0, "a comparison"),
        (lambda v: bool(v), "a condition"),
    ],
)
def test_a_stand_in_refuses_every_deciding_use(use, what):
    """A stand-in used as a loop bound, in a comparison or as a condition raises."""
    model, x = _model()

    def step(model, x):
        use(model(x).sum().item())

    with pytest.raises(DataDependentValueError, match=f"is used as {what}"):
        trace_step(step, model, x)


def test_bool_of_an_unknown_tensor_is_refused_at_once():
    """if loss > 0: (bool of an unknown tensor) is a branch: an error naming the line."""
    model, x = _model()

    def branch(model, x):
        if model(x).sum() > 0:
            pass

    line = _line_of(branch, "if model(x).sum() > 0:")
    where = re.escape(f"{SHOWN}:{line} in branch: bool()")
    with pytest.raises(DataDependentValueError, match=f"^{where}"):
        trace_step(branch, model, x)


def test_a_stated_value_sizes_the_step_as_a_hand_written_size_does():
    """values={'file:line': 1000} gives the same bytes as torch.zeros(1000) written out."""
    model, x = _model()

    def sized(model, x):
        n = int(x.sum().item())
        y = torch.zeros(n, 64)
        (model(x).sum() + y.sum()).backward()

    def fixed(model, x):
        y = torch.zeros(1000, 64)
        (model(x).sum() + y.sum()).backward()

    line = _line_of(sized, "n = int(x.sum().item())")
    stated = trace_step(sized, model, x, values={f"{HERE}:{line}": 1000})
    reference = trace_step(fixed, *_model())
    assert _peak(stated) == _peak(reference)
    assert stated.assumptions[f"read at {HERE}:{line} in sized"] == (
        "Tensor.item() = 1000.0, as stated (--value / values=); 1 time(s)"
    )


def test_a_stated_value_never_read_is_warned_about():
    """A stated FILE:LINE that no read used is a warning, not silence."""
    model, x = _model()
    recording = trace_step(lambda m, x: m(x), model, x, values={"train.py:7": 3})
    assert any(w.startswith("the value stated for train.py:7 was never used") for w in recording.warnings)


@pytest.mark.parametrize(
    ("values", "match"),
    [({"train.py": 3}, "named FILE:LINE"), ({"train.py:0": 3}, "named FILE:LINE"),
     ({"train.py:4": "x"}, "must be a number"), ({"train.py:4": True}, "must be a number")],
)
def test_malformed_stated_values_are_refused(values, match):
    """A key that is not FILE:LINE, or a value that is not a number, is a ConfigError."""
    with pytest.raises(ConfigError, match=match):
        parse_stated_values(values)


def test_tolist_of_an_unknown_tensor_gives_stand_ins_shaped_like_it():
    """tolist() of an unknown 2x3 tensor: a 2x3 list of stand-ins, listed as a read."""
    model, x = _model()
    got = []

    def step(model, x):
        got.append(model(x)[:2, :3].tolist())

    recording = trace_step(step, model, x)
    assert [len(row) for row in got[0]] == [3, 3]
    assert all(isinstance(v, StandIn) for row in got[0] for v in row)
    assert any("Tensor.tolist() read a tensor value" in w for w in recording.warnings)

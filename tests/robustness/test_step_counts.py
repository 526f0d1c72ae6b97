"""Every Python entry point that records steps takes a whole number from 1 to
``MAX_RECORDED_STEPS`` and refuses anything else with a ``ConfigError`` before any work.

The CLI and ``Scenario`` had the bound; the Python forms had none: ``oomkit.predict(step_fn,
x, steps=10**8)`` recorded for days, ``steps=True`` ran one step, ``steps=2.5`` ended in a
``TypeError`` from ``range``, and ``ScriptSpec`` or ``max_batch_size`` took any count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import oomkit
from oomkit.core.trace.step_count import MAX_RECORDED_STEPS, check_step_count
from oomkit.errors import ConfigError


def _never_called(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("the step count is checked before any user code runs")


def _entry_points() -> dict[str, Callable[[Any], object]]:
    from oomkit.prediction.tracing.distributed import trace_distributed_step
    from oomkit.prediction.tracing.script_run import ScriptSpec
    from oomkit.prediction.tracing.step_runner import trace_step

    return {
        "oomkit.predict": lambda n: oomkit.predict(_never_called, torch.empty(4, device="meta"), steps=n),
        "trace_step": lambda n: trace_step(_never_called, steps=n),
        "trace_distributed_step": lambda n: trace_distributed_step(_never_called, world_size=2, steps=n),
        "ScriptSpec": lambda n: ScriptSpec("train.py", steps=n),
        "max_batch_size": lambda n: oomkit.max_batch_size(_never_called, steps=n),
        "smallest_gpu": lambda n: oomkit.smallest_gpu(_never_called, 8, steps=n),
    }


ENTRY_POINTS = _entry_points()

BAD_COUNTS = st.one_of(
    st.integers(max_value=0),
    st.integers(min_value=MAX_RECORDED_STEPS + 1),
    st.booleans(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.none(),
)


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
@settings(max_examples=40, deadline=None)
@given(steps=BAD_COUNTS)
def test_a_bad_step_count_is_refused_before_any_work(name, steps):
    with pytest.raises(ConfigError, match=r"steps") as raised:
        ENTRY_POINTS[name](steps)
    message = str(raised.value)
    assert "Example:" in message
    if isinstance(steps, int) and not isinstance(steps, bool) and steps > MAX_RECORDED_STEPS:
        assert f"give at most {MAX_RECORDED_STEPS:,}" in message
    else:
        assert f"got {steps!r}" in message


@given(steps=st.integers(min_value=1, max_value=MAX_RECORDED_STEPS))
def test_a_count_within_the_bound_is_taken_as_is(steps):
    assert check_step_count(steps, "x") == steps


def test_the_bound_is_the_scenarios():
    """The CLI's --steps and the Python forms refuse at the same count."""
    with pytest.raises(ValueError, match="past 1,000"):
        oomkit.Scenario.model_validate({"model": {"preset": "gpt2-124m"}, "run": {"steps": 1001}})
    oomkit.Scenario.model_validate({"model": {"preset": "gpt2-124m"}, "run": {"steps": 1000}})
    assert MAX_RECORDED_STEPS == 1_000


def test_a_step_function_records_the_steps_it_is_given():
    """A count within the bound is recorded as given (steps=True had recorded one step)."""

    def step(x: torch.Tensor) -> torch.Tensor:
        return (x * 2).sum()

    prediction = oomkit.predict(step, torch.empty(1024, device="meta"), steps=2)
    assert prediction.steps == 2 and len(prediction.step_starts) == 2

"""The Python API refuses a bad argument with an ``OomkitError`` (a ``ConfigError``, still a
``ValueError`` for code that caught one), before any work, and says what to write instead.

These had raised a plain ``ValueError``, so ``except oomkit.OomkitError`` missed them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import oomkit
from oomkit.errors import ConfigError


def _never_built(batch_size: int) -> Any:
    raise AssertionError("the arguments are checked before the step is built")


def _cases() -> list[tuple[str, Callable[[], object], str]]:
    from oomkit.core.trace.delayed_frees import delayed_frees
    from oomkit.plan.batch_probe import check_positive, resolve_margin
    from oomkit.prediction.models.lora_options import LoraOptions
    from oomkit.prediction.models.options import StepOptions
    from oomkit.prediction.tracing.step_runner import trace_step
    from oomkit.runtime.resilient import split_batch

    return [
        ("Monitor every", lambda: oomkit.Monitor(every=0), "every must be a positive int"),
        ("Monitor log_path", lambda: oomkit.Monitor(log_path="mem-{step}.jsonl"),
         "log_path 'mem-{step}.jsonl': a template may name {rank} and {pid} only (KeyError"),
        ("resilient reduction", lambda: oomkit.resilient(lambda b: b, loss_reduction="max"),
         'loss_reduction must be "mean" or "sum"'),
        ("resilient micro-batch", lambda: oomkit.resilient(lambda b: b, micro_batch_size=0),
         "micro_batch_size must be >= 1 or None"),
        ("split_batch", lambda: split_batch([1, 2], 0), "micro_batch_size must be >= 1"),
        ("find_batch_size start", lambda: oomkit.find_batch_size(_never_built, start=0),
         "start must be >= 1"),
        ("max_batch_size steps", lambda: oomkit.max_batch_size(_never_built, steps=0),
         "steps must be a whole number of at least 1"),
        ("max_batch_size grid", lambda: oomkit.max_batch_size(
            _never_built, multiple_of=3, power_of_two=True), "power_of_two sizes are never"),
        ("check_positive", lambda: check_positive("batch_size", True, "x"),
         "batch_size must be a whole number of at least 1; got True"),
        ("resolve_margin", lambda: resolve_margin(-1, 2**30), "margin_bytes must be a whole"),
        ("trace_step steps", lambda: trace_step(lambda: None, steps=0),
         "steps must be a whole number of at least 1"),
        ("LoraOptions r", lambda: LoraOptions(r=0), "LoraOptions.r must be a positive integer"),
        ("StepOptions impl", lambda: StepOptions(optimizer="sgd", optimizer_impl="fused"),
         "optimizer_impl 'fused' applies to adamw, adam only"),
        ("delayed_frees lag", lambda: delayed_frees([], [], set(), -1), "lag_allocations must be at least 0"),
    ]


CASES = _cases()


@pytest.mark.parametrize(("name", "call", "words"), CASES, ids=[c[0] for c in CASES])
def test_a_bad_argument_is_an_oomkit_error(name, call, words):
    with pytest.raises(ConfigError) as raised:
        call()
    assert isinstance(raised.value, oomkit.OomkitError) and isinstance(raised.value, ValueError)
    assert words in str(raised.value)


@settings(max_examples=80, deadline=None)
@given(template=st.text(alphabet="{}rankpid0.:!x/", max_size=12))
def test_any_log_path_template_is_taken_or_refused_at_once(template):
    """A Monitor's log template is formatted when it is made: a bad one is a ConfigError there
    (it had been a KeyError or ValueError at the start of the GPU run), a good one is kept."""
    try:
        template.format(rank=0, pid=0)
    except (KeyError, IndexError, ValueError, AttributeError, TypeError):
        with pytest.raises(ConfigError, match="a template may name {rank} and {pid} only"):
            oomkit.Monitor(log_path=template or "x")
    else:
        oomkit.Monitor(log_path=template or "x")

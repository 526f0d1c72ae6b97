"""A step function that handles its own out-of-memory errors, from Python: its handler found
and the prediction says it did not run (batch_finders.catches_out_of_memory)."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest

torch = pytest.importorskip("torch")

import oomkit  # noqa: E402
from oomkit.prediction.tracing.batch_finders import catches_out_of_memory  # noqa: E402

HANDLERS = '''
import torch


def halving(model, x):
    batch = x.shape[0]
    while True:
        try:
            model(x[:batch]).sum().backward()
            return
        except torch.OutOfMemoryError:
            batch //= 2


def by_text(model, x):
    try:
        model(x).sum().backward()
    except RuntimeError as error:
        if "out of memory" in str(error):
            return
        raise


def plain(model, x):
    model(x).sum().backward()


def calling_a_helper(model, x):
    halving(model, x)


def making_a_closure():
    def step(model, x):
        return halving_closure(model, x)

    halving_closure = halving
    return step
'''


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    path = tmp_path_factory.mktemp("handlers") / "handlers.py"
    path.write_text(textwrap.dedent(HANDLERS))
    spec = importlib.util.spec_from_file_location("handlers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("name", "line"),
    [("halving", 11), ("by_text", 19), ("plain", None), ("calling_a_helper", 11)],
)
def test_the_handler_s_line_is_found(steps, name, line):
    """The `except torch.OutOfMemoryError` line, the "out of memory" check, through a helper of
    the same file called by name; a step without one has none."""
    site = catches_out_of_memory(getattr(steps, name))
    if line is None:
        assert site is None
    else:
        assert site.endswith(f"handlers.py:{line}")


def test_through_a_closure(steps):
    assert catches_out_of_memory(steps.making_a_closure()).endswith("handlers.py:11")


def _model_and_input():
    with torch.device("meta"):
        return torch.nn.Linear(4096, 4096), torch.randn(65536, 4096)


def test_a_step_that_does_not_fit_and_handles_ooms_says_its_handler_did_not_run(steps):
    """On a 1 GiB GPU the step does not fit: the warning names the handler's line and what to
    predict instead; the same step without a handler gets no such warning, nor one that fits."""
    model, x = _model_and_input()
    prediction = oomkit.predict(steps.halving, model, x, gpu="1GiB", steps=1)
    assert not prediction.fits
    said = [w for w in prediction.warnings if w.startswith("the step handles out-of-memory")]
    assert len(said) == 1 and "handlers.py:11" in said[0]
    assert "oomkit.predict('train.py:build')" in said[0]
    plain = oomkit.predict(steps.plain, model, x, gpu="1GiB", steps=1)
    assert not plain.fits
    assert not any(w.startswith("the step handles") for w in plain.warnings)
    fits = oomkit.predict(steps.halving, model, x, gpu="h100", steps=1)
    assert fits.fits and not any(w.startswith("the step handles") for w in fits.warnings)

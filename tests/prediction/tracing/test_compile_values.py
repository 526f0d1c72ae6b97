"""Values in a compiled step: tensors made from Python data, and values computed by compiled graphs."""

from __future__ import annotations

import functools

import pytest
import torch

from oomkit.errors import DataDependentValueError
from oomkit.prediction.tracing.step_runner import trace_step

# 12 floats: more than Inductor inlines, so the compiled graph holds a 48-byte device constant.
_DATA = [float(i) for i in range(12)]

# Every way torch builds a tensor from Python data on the step's device (all take the device by
# keyword only: torch/csrc/utils/tensor_new.cpp's parsers).
_FROM_DATA = {
    "torch.tensor": lambda t: torch.tensor(_DATA, device=t.device),
    "torch.as_tensor": lambda t: torch.as_tensor(_DATA, device=t.device),
    "torch.as_tensor dtype": lambda t: torch.as_tensor(
        _DATA, dtype=torch.float32, device=torch.device("meta")
    ),
    "torch.as_tensor data=": lambda t: torch.as_tensor(data=_DATA, device="meta"),
    "torch.asarray": lambda t: torch.asarray(_DATA, device=t.device),
    "Tensor.new_tensor": lambda t: t.new_tensor(_DATA),
}


def _recorded(form):
    """The events (not their stack frames) of a compiled step that scales by a data tensor."""
    make = _FROM_DATA[form] if isinstance(form, str) else form
    with torch.device("meta"):
        x = torch.randn(4, 12, requires_grad=True)
    compiled = torch.compile(lambda t: (t * 2) * make(t))

    def step(*_tracked):
        compiled(x).sum().backward()

    recording = trace_step(step, x, compile=True)
    return [(e.action, e.address, e.size, e.stream, e.tags) for e in recording.events]


@functools.cache
def _as_torch_tensor():
    return _recorded("torch.tensor")


def test_torch_tensor_on_meta_in_compiled_code_is_a_held_constant():
    """The reference: torch.tensor(data, device=meta) is traced as made on the CPU and moved, so
    the compiled graph holds its 48-byte device copy and saves a 48-byte copy for backward."""
    allocs = [(size, dict(tags).get("op")) for action, _, size, _, tags in _as_torch_tensor()
              if action == "alloc"]  # fmt: skip
    assert (48, "torch.compile constant") in allocs
    assert (48, "prims.device_put.default") in allocs


@pytest.mark.parametrize("form", [form for form in _FROM_DATA if form != "torch.tensor"])
def test_every_constructor_from_data_records_as_torch_tensor(form):
    """as_tensor, asarray and new_tensor build from data like torch.tensor (tensor_new.cpp
    internal_new_from_data): recorded compiled, event for event the same."""
    assert _recorded(form) == _as_torch_tensor()


def test_a_positional_device_is_torchs_own_type_error():
    """torch takes the device by keyword only: as_tensor(data, "meta") fails in a recorded
    compiled step with torch's own TypeError, as it does on a GPU (nothing to rewrite)."""
    with pytest.raises(TypeError, match=r"as_tensor\(\) takes 1 positional argument but 2"):
        _recorded(lambda t: torch.as_tensor(_DATA, t.device))


@pytest.mark.parametrize("form", sorted(_FROM_DATA))
def test_the_values_of_a_tensor_from_data_are_known_eagerly(form):
    """Each constructor's values are the data's: a size read from one is answered (66 = sum),
    and the assumption names the constructor."""
    seen = []

    def step(*_tracked):
        with torch.device("meta"):
            anchor = torch.empty(12)
        total = _FROM_DATA[form](anchor).sum()
        seen.append(torch.empty(int(total), device="meta").shape[0])

    recording = trace_step(step)
    assert seen == [66]
    (read,) = [v for k, v in recording.assumptions.items() if k.startswith("read at")]
    origin = form.split(" ")[0]
    assert read.startswith(f"int() = 66, computed from the values your tensors were created with ({origin})")


def _count_rows(mask):
    return mask.sum(dim=1).max()


def _sized_by_a_compiled_count(make_mask):
    """A step whose buffer is sized by a count a compiled function computes from a 4 x 8 mask."""
    compiled = torch.compile(_count_rows)

    def step(*_tracked):
        with torch.device("meta"):
            mask = make_mask(4, 8)
        n = compiled(mask)
        return torch.empty(int(n), 16, device="meta")

    return step


def test_a_value_computed_by_a_compiled_graph_is_followed():
    """A compiled function's result made from known values (torch.ones) is known: the eager
    code's int() of it is answered (8), and the buffer it sizes is recorded at 8 x 16 floats."""
    recording = trace_step(_sized_by_a_compiled_count(torch.ones), compile=True)
    sizes = [e.size for e in recording.events if e.action == "alloc"]
    assert 8 * 16 * 4 in sizes
    (read,) = [v for k, v in recording.assumptions.items() if k.startswith("read at")]
    assert read.startswith("int() = 8, computed from the values your tensors were created with")


def test_a_value_through_a_compiled_training_graph_is_followed():
    """In a training step the compiled forward's second output (a count) is followed too."""

    def loss_and_count(x, mask):
        return (x * mask).sum(), mask.sum()

    compiled = torch.compile(loss_and_count)
    seen = []

    def step(*_tracked):
        with torch.device("meta"):
            x = torch.randn(4, 8, requires_grad=True)
            mask = torch.ones(4, 8)
        loss, count = compiled(x, mask)
        loss.backward()
        seen.append(int(count))

    recording = trace_step(step, compile=True)
    assert seen == [32]
    assert "1 backward, 1 forward" in recording.assumptions["torch.compile"]


def test_an_unknown_value_from_a_compiled_graph_says_how_to_state_it():
    """A compiled result made from random values is unknown: using it as a size is refused
    with the line to state it at (--value / values=), not guessed."""
    step = _sized_by_a_compiled_count(torch.randn)
    with pytest.raises(DataDependentValueError, match=r"--value test_compile_values\.py:\d+=NUMBER"):
        trace_step(step, compile=True)

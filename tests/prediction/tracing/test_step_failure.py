"""A failing step names the user's line and the library's, with advice that fits the failure."""

from __future__ import annotations

import importlib.util
import os
import textwrap

import pytest

torch = pytest.importorskip("torch")

from oomkit.errors import DataDependentValueError, UnsupportedOpError  # noqa: E402
from oomkit.prediction.tracing import trace_step  # noqa: E402
from oomkit.prediction.tracing.stand_ins import shown_path  # noqa: E402
from oomkit.prediction.tracing.step_failure import failure_text  # noqa: E402

SHOWN = os.path.relpath(__file__)


def _meta_input():
    with torch.device("meta"):
        return torch.randn(4, 8)


def _line(text):
    with open(__file__) as source:
        return next(i for i, line in enumerate(source, 1) if text in line)


def test_a_device_move_is_said_to_be_one():
    """.cpu().numpy() inside the step: 'a device move', the user's line, what works instead."""

    def step(x):
        x.cpu().numpy()  # moves to host

    with pytest.raises(UnsupportedOpError) as raised:
        trace_step(step, _meta_input())
    message = str(raised.value)
    assert message.startswith(
        f"the step failed at {SHOWN}:{_line('x.cpu().numpy()  # moves')} in step: "
    )
    assert "a device move that reads values (TypeError: can't convert meta" in message
    assert ".to('cuda') and .cpu() work" in message
    assert ".item()" not in message.split("To log a value")[0]


@pytest.mark.parametrize("module_first", [True, False])
def test_a_model_built_on_the_cpu_is_named_as_such(module_first):
    """A step closing over a model built on the CPU (the natural first try of the Python
    API): the failure says a CPU tensor met the traced GPU's and how to build it, not that
    the op reads values. It had said "its result depends on tensor values"."""
    model = torch.nn.Linear(8, 8)

    def step(x):
        (model(x) if module_first else x + model.weight[0]).sum()  # uses the CPU model

    with pytest.raises(UnsupportedOpError) as raised:
        trace_step(step, _meta_input())
    message = str(raised.value)
    assert message.startswith(f"the step failed at {SHOWN}:{_line('# uses the CPU model')} in step")
    assert "a tensor on the CPU met the step's tensors, which are on the traced GPU" in message
    assert "with torch.device('meta'):" in message
    assert "depends on tensor values" not in message


def test_a_data_dependent_op_in_user_code_is_the_users_to_move():
    """x[x > 0] in the step: the user's line, no library frame, advice to move it out."""

    def step(x):
        x[x > 0].sum()  # boolean mask

    with pytest.raises(UnsupportedOpError) as raised:
        trace_step(step, _meta_input())
    message = str(raised.value)
    assert message.startswith(f"the step failed at {SHOWN}:{_line('x[x > 0].sum()')} in step: ")
    assert "(inside" not in message
    assert "Move data-dependent code" in message


def test_an_op_refusing_its_arguments_is_the_step_s_own_error_not_a_value_read():
    """A matmul of mismatched shapes fails in its meta kernel as on CUDA: the message says so
    and asks for a fix in the step. It had said the op's result depended on tensor values."""

    def step(x):
        x @ torch.empty(9, 3, device="meta")  # mismatched shapes

    with pytest.raises(UnsupportedOpError) as raised:
        trace_step(step, _meta_input())
    message = str(raised.value)
    assert message.startswith("the step raised RuntimeError: a and b must have same reduction dim")
    assert message.endswith(
        f"at {SHOWN}:{_line('# mismatched shapes')} in step, in aten.mm.default: the op refused "
        "its arguments, which it checks on the meta device as on the GPU (shapes, dtypes, "
        "sizes), so a GPU run would raise it too. Fix it in the step"
    )
    assert "depends on tensor values" not in message


def test_a_fake_tensor_s_data_dependent_refusal_is_still_a_value_read():
    """Under a fake process group a boolean mask raises DynamicOutputShapeException (a
    RuntimeError subclass whose message does not name the meta device): it is a value read,
    not the step's own argument error."""
    from torch._subclasses.fake_tensor import DynamicOutputShapeException

    text = failure_text(DynamicOutputShapeException(torch.ops.aten.nonzero.default), "aten.index.Tensor")
    assert "aten.index.Tensor cannot run on the meta device (DynamicOutputShapeException" in text
    assert "its result depends on tensor values" in text


def test_missing_weights_of_from_pretrained_say_what_to_do():
    """transformers' "no file named model.safetensors" from from_pretrained: the message says
    the weights must be on the machine and how to predict the config alone (--hf DIR); the same
    OSError from elsewhere gets no such advice."""
    source = "def load():\n    raise OSError('Error no file named model.safetensors, found in directory x.')\n"
    for filename, advised in (("/site-packages/transformers/modeling_utils.py", True), ("/elsewhere/io.py", False)):
        namespace: dict[str, object] = {}
        exec(compile(source, filename, "exec"), namespace)
        try:
            namespace["load"]()  # type: ignore[operator]
        except OSError as exc:
            text = failure_text(exc)
        assert text.startswith("the step raised OSError: Error no file named model.safetensors")
        assert ("`oomkit predict --hf DIR`" in text) == advised


def _fake_library(tmp_path):
    """A module installed under site-packages: library code, not the user's."""
    folder = tmp_path / "site-packages" / "fakelib"
    folder.mkdir(parents=True)
    path = folder / "reads.py"
    path.write_text(
        textwrap.dedent(
            """
            def positives(x):
                return x[x > 0]

            def scaled(x):
                return x * x.abs().max().item()

            def size_of(x):
                return int(x.sum().item())
            """
        )
    )
    spec = importlib.util.spec_from_file_location("fakelib_reads", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, path


def test_a_data_dependent_op_inside_a_library_names_both_lines(tmp_path):
    """Inside a library: the user's line, then 'inside' the library's, advice not to move it."""
    lib, path = _fake_library(tmp_path)

    def step(x):
        lib.positives(x)  # calls the library

    with pytest.raises(UnsupportedOpError) as raised:
        trace_step(step, _meta_input())
    message = str(raised.value)
    user = f"{SHOWN}:{_line('lib.positives(x)  # calls')} in step"
    assert message.startswith(f"the step failed at {user} (inside {shown_path(str(path))}:3 ")
    assert "inside a library, not yours to move" in message


def test_a_logged_item_inside_a_library_gets_a_stand_in_and_names_the_caller(tmp_path):
    """.item() in a library used as a multiplier only: a stand-in, listed with the user's line."""
    lib, path = _fake_library(tmp_path)

    def step(x):
        lib.scaled(x)  # the library reads a value

    recording = trace_step(step, _meta_input())
    (warning,) = [w for w in recording.warnings if "Tensor.item() read" in w]
    caller = f"{SHOWN}:{_line('lib.scaled(x)  # the library')} in step"
    assert warning.startswith(f"{shown_path(str(path))}:6 in scaled (called from {caller})")


def test_a_deciding_item_inside_a_library_is_refused_with_library_advice(tmp_path):
    """int(x.sum().item()) in a library: refused, advice to state it by the library's line."""
    lib, _ = _fake_library(tmp_path)

    with pytest.raises(DataDependentValueError) as raised:
        trace_step(lambda x: lib.size_of(x), _meta_input())
    message = str(raised.value)
    assert "The read is inside a library, not yours to move" in message
    assert "--value reads.py:9=NUMBER" in message


@pytest.mark.parametrize(
    ("raise_it", "said"),
    [
        ("assert steps % world == 0", "AssertionError (assert steps % world == 0)"),
        ("raise ValueError()", "ValueError (raise ValueError())"),
        ("raise ValueError('   ')", "ValueError (raise ValueError('   '))"),
        ("raise KeyError('batch')", "KeyError: 'batch'"),
    ],
)
def test_an_exception_without_a_message_is_said_by_its_line(tmp_path, raise_it, said):
    """A bare assert had read "the step raised AssertionError:, at ..."; now the line that
    raised it stands for the message, as Python's traceback shows it."""
    path = tmp_path / "user_step.py"
    path.write_text(f"def step(steps=3, world=2):\n    {raise_it}\n")
    spec = importlib.util.spec_from_file_location("user_step", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        module.step()
    except Exception as exc:
        text = failure_text(exc)
    assert text.startswith(f"the step raised {said}, at ")
    assert "user_step.py:2 in step" in text

"""The recorder's dispatch modes disable dynamo only while a dynamo frame is active.

``DynamoAwareDispatchMode`` (``_modes.py``) runs its ``__torch_dispatch__`` as written while
the thread has no eval-frame callback (eager code: every op of an eager recording), and
through torch's own ``torch._disable_dynamo`` wrapper while one is installed (a compiled
function running), so that dynamo never traces the mode's code, as torch's
``TorchDispatchMode.__init_subclass__`` arranges for every other mode.
"""

from __future__ import annotations

import contextlib
import sys
import warnings

import pytest
import torch
from torch._C._dynamo.eval_frame import get_eval_frame_callback

from oomkit.prediction.tracing._modes import DynamoAwareDispatchMode, OpDispatchMode
from oomkit.prediction.tracing.compiled import _recorder_never_compiled
from oomkit.prediction.tracing.values import KnownValues


class _Seen(DynamoAwareDispatchMode):
    """Notes, for each aten op, who called the method and the callback it ran under."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str, object]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        caller = sys._getframe(1).f_code.co_name
        self.calls.append((str(func), caller, get_eval_frame_callback()))
        return func(*args, **(kwargs or {}))


def test_eager_ops_run_the_method_as_written():
    x = torch.ones(3)
    with _Seen() as seen:
        torch.add(x, 1)
    assert seen.calls == [("aten.add.Tensor", "dispatch", None)]


def _plus_one_compiled(*contexts):
    """``x + 1`` through a compiled function (backend ``eager``) while ``_Seen`` is on the
    stack, inside ``contexts``: what the mode saw."""
    torch._dynamo.reset()

    @torch.compile(backend="eager")
    def plus_one(x):
        return x + 1

    x = torch.ones(3)
    try:
        with contextlib.ExitStack() as stack:
            for context in contexts:
                stack.enter_context(context)
            with _Seen() as seen:
                out = plus_one(x)
    finally:
        torch._dynamo.reset()
    assert out.tolist() == [2.0, 2.0, 2.0]
    return seen.calls


@pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace")
def test_under_a_compiled_function_the_method_runs_with_dynamo_disabled():
    """dynamo skips compiling a frame while this mode is on the stack (it does not ignore
    compile internals), but its callback stays installed for the frame's ops: each goes
    through torch's disable wrapper (``_fn``), and the method runs with no callback. (dynamo
    is offered the wrapper's own frame, cannot trace its first call, a C builtin, and warns.)"""
    assert _plus_one_compiled() == [("aten.add.Tensor", "_fn", None)]


def test_in_a_compiled_recording_the_recorders_frames_are_never_offered_to_dynamo():
    """In a compiled recording the recorder's code, the wrapper's included, runs with the
    callback off (``_recorder_never_compiled``: a SKIP strategy per code object), so the
    method runs as written, with no callback, and dynamo traces none of it (no warning)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        calls = _plus_one_compiled(_recorder_never_compiled())
    assert calls == [("aten.add.Tensor", "dispatch", None)]
    assert [str(w.message) for w in caught if "Dynamo" in str(w.message)] == []


def test_the_recorders_modes_are_torch_dispatch_modes_without_torchs_own_wrapper():
    """torch's ``__init_subclass__`` asks ``_should_skip_dynamo`` before wrapping: the modes
    answer False and hold this module's wrapper, which keeps the method's name."""
    for mode in (OpDispatchMode, KnownValues):
        assert issubclass(mode, torch.utils._python_dispatch.TorchDispatchMode)
        assert mode._should_skip_dynamo() is False
        method = mode.__dict__["__torch_dispatch__"]
        assert method.__name__ == "__torch_dispatch__"
        assert method.__code__.co_name == "dispatch"

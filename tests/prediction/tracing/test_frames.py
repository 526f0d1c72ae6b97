"""Finding the user's frame: a held frame answers for the frames above it, with the same result."""

from __future__ import annotations

import functools
import sys
import types

import pytest

from oomkit.core.trace import Frame
from oomkit.prediction.tracing.frames import UserFrameFinder

HERE = __file__


def _library_call(finder: UserFrameFinder):
    """Stands for torch/oomkit code between the user's line and the allocation."""
    return finder.find()


def _finder() -> UserFrameFinder:
    # Only this test module's helpers named _library* count as library code: a prefix that
    # matches nothing real, and a code-object verdict set by hand for the helpers.
    finder = UserFrameFinder(prefixes=("/nonexistent-library/",))
    finder._is_user[_library_call.__code__] = False
    finder._is_user[_library_holder.__code__] = False
    return finder


def _library_holder(finder: UserFrameFinder, calls: list):
    """Stands for trace_step: enters the tracer (holds its own frame), then runs the step."""
    finder.hold(sys._getframe())
    try:
        results = []
        for call in calls:  # a loop, not a comprehension: no frame of its own
            results.append(call())
        return results
    finally:
        finder.hold(None)


def test_held_walk_finds_the_same_user_frame_and_line():
    """Under a held library frame the user frame above it is found as by the full walk, and a
    user frame below it with its current line."""
    finder = _finder()
    plain = _library_call(_finder())  # this test function's frame, by the full walk
    assert plain[0].filename == HERE and plain[0].name == (
        "test_held_walk_finds_the_same_user_frame_and_line"
    )

    def user_step():
        first = _library_call(finder)
        second = _library_call(finder)
        return first, second

    held_above = _library_holder(finder, [functools.partial(_library_call, finder)])[0]
    step = _library_holder(finder, [user_step])[0]
    # Above the held frame: this test function at the line that called _library_holder.
    assert held_above[0].name == plain[0].name and held_above[0].filename == HERE
    assert held_above[0].line > plain[0].line
    # Below it, a user frame: its own lines, one apart.
    assert [f[0].name for f in step] == ["user_step", "user_step"]
    assert step[1][0].line == step[0][0].line + 1
    assert finder._held is None  # let go when the holder returned


def test_a_generator_frame_is_not_held():
    """A generator's frame may resume under other callers, so holding it walks the full stack."""
    finder = _finder()

    def gen():
        finder.hold(sys._getframe())
        yield
        yield _library_call(finder)

    g = gen()
    next(g)
    found = next(g)
    assert finder._held is None
    assert found[0].name == "gen"


def test_a_code_object_with_an_unhashable_constant_is_walked_not_raised():
    """A frame running bytecode with a dict constant (as dynamo's transformed code can hold)
    cannot be a cache key; the walk still judges it (before: TypeError unhashable 'dict')."""
    finder = UserFrameFinder(prefixes=("/nonexistent-library/",))

    def probe():
        return finder.find()

    code = probe.__code__
    odd = code.replace(co_consts=(*code.co_consts, {"a": 1}))
    with pytest.raises(TypeError, match="unhashable"):
        hash(odd)
    run = types.FunctionType(odd, probe.__globals__, "probe", None, probe.__closure__)
    assert run() == run() == (Frame(HERE, code.co_firstlineno + 1, "probe"),)

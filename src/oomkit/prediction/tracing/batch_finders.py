"""Scripts that find their batch by catching out-of-memory errors, noticed.

accelerate's ``find_executable_batch_size`` (accelerate/utils/memory.py; the Hugging Face
Trainer's ``auto_find_batch_size=True`` calls it through transformers/trainer_utils.py) runs
the training function at a starting batch and, when it raises an out-of-memory error
(``should_reduce_batch_size``), empties the cache and runs it again at a smaller batch (0.9x by
default). ``record_script(ooms=True)`` raises the out-of-memory errors the GPU would, so the
finder retries as it would there; while open, ``batch_finders_noticed`` notes each starting
batch, for the prediction to say what happened.

Lightning's ``Tuner`` (lightning/pytorch/tuner/tuning.py) searches by trial runs:
``scale_batch_size`` fits a few steps per batch (doubling or bisecting, catching the
out-of-memory errors), ``lr_find`` a number of steps per learning rate, then restores the
trainer's state from the checkpoint it saved (``skipped_saves.py`` gives it back). Their
optimizer steps are not the script's training steps: while one runs (``in_trials``), the
recording counts none of them toward ``--steps``; what they allocate stays in the recording,
as the allocator keeps what they cached on the GPU.
"""

from __future__ import annotations

import contextlib
import dis
import functools
import types
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from oomkit.prediction.tracing.import_hooks import patched_on_import
from oomkit.prediction.tracing.stand_ins import shown_path

__all__ = [
    "batch_finder_note",
    "batch_finders_noticed",
    "catches_out_of_memory",
    "in_trials",
    "tuner_note",
]

# Where accelerate defines it and where its users import it from (accelerate.utils re-exports).
_MODULES = ("accelerate.utils.memory", "accelerate.utils")
_NAME = "find_executable_batch_size"
# Where Lightning defines its Tuner (the unified package and the older name), and its searches.
_TUNER_MODULES = ("lightning.pytorch.tuner.tuning", "pytorch_lightning.tuner.tuning")
_TUNER_SEARCHES = ("scale_batch_size", "lr_find")
# How many of the Tuner's searches are open (nested: lr_find inside a search is counted once).
_TRIALS_OPEN = [0]


def in_trials() -> bool:
    """Whether a Lightning Tuner search is running its trials."""
    return _TRIALS_OPEN[0] > 0


def _trials_apart(searches: list[str]) -> Callable[[ModuleType], Callable[[], None]]:
    def patch(module: ModuleType) -> Callable[[], None]:
        tuner = getattr(module, "Tuner", None)
        if tuner is None:
            return lambda: None
        originals = {name: tuner.__dict__[name] for name in _TUNER_SEARCHES if name in tuner.__dict__}

        def apart(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(original)
            def searching(*args: Any, **kwargs: Any) -> Any:
                searches.append(name)
                _TRIALS_OPEN[0] += 1
                try:
                    return original(*args, **kwargs)
                finally:
                    _TRIALS_OPEN[0] -= 1

            return searching

        for name, original in originals.items():
            setattr(tuner, name, apart(name, original))

        def restore() -> None:
            for name, original in originals.items():
                setattr(tuner, name, original)

        return restore

    return patch


def _noting(starts: list[int]) -> Callable[[ModuleType], Callable[[], None]]:
    def patch(module: ModuleType) -> Callable[[], None]:
        original = getattr(module, _NAME, None)
        if original is None:
            return lambda: None

        @functools.wraps(original)
        def noted(function: Any = None, starting_batch_size: int = 128, *args: Any,
                  **kwargs: Any) -> Any:
            if function is not None:  # the decorator applied (not its partial)
                starts.append(int(starting_batch_size))
            return original(function, starting_batch_size, *args, **kwargs)

        setattr(module, _NAME, noted)
        return lambda: setattr(module, _NAME, original)

    return patch


@contextlib.contextmanager
def batch_finders_noticed(starts: list[int], searches: list[str] | None = None) -> Iterator[None]:
    """While open, each ``find_executable_batch_size`` applied appends its starting batch to
    ``starts``, and each Lightning Tuner search its name to ``searches``, its trials kept
    apart from the recorded steps (``in_trials``); each library is patched when the script
    imports it."""
    with contextlib.ExitStack() as stack:
        for name in _MODULES:
            stack.enter_context(patched_on_import(name, _noting(starts)))
        for name in _TUNER_MODULES:
            stack.enter_context(patched_on_import(name, _trials_apart([] if searches is None else searches)))
        yield


def tuner_note(searches: list[str], caught: int) -> str | None:
    """What the prediction says of Lightning Tuner searches the script ran, and of the
    out-of-memory errors they caught (``caught``); ``None``: none ran."""
    if not searches:
        return None
    names = ", ".join(f"Tuner.{name}" for name in dict.fromkeys(searches))
    said = (
        f"; it caught {caught} out-of-memory error(s), raised where a trial did not fit as on "
        "the GPU, and went on at a smaller batch, as it would there"
        if caught
        else ""
    )
    return (
        f"Lightning's {names} ran its trial steps before the recorded ones (they are not "
        f"counted among the steps recorded){said}. What the trials allocated is in the "
        "recording, as the allocator keeps what they cached on the GPU"
    )


def batch_finder_note(starts: list[int], script: str, caught: int) -> str | None:
    """What the prediction says of a script whose batch finder ran and of the out-of-memory
    errors it caught (``caught``, raised by ``record_script(ooms=True)``); ``None``: no
    finder ran, or its starting batch fitted."""
    if not starts:
        return None
    batch = starts[-1]
    if caught:
        return (
            f"the script finds its batch by catching out-of-memory errors (accelerate's "
            f"find_executable_batch_size, the Hugging Face Trainer's auto_find_batch_size), "
            f"starting at {batch}: it caught {caught}, raised as the GPU would, and went on at "
            f"a smaller batch, as it would there. `oomkit fit {script} -- ARGS` finds the "
            "largest batch that fits without the retries"
        )
    return None


# What names an out-of-memory handler: torch's exception (torch.OutOfMemoryError,
# torch.cuda.OutOfMemoryError) or the message text a `except RuntimeError` checks for.
_OOM_NAMES = frozenset({"OutOfMemoryError"})
_OOM_TEXT = "out of memory"
# How far from the step function the code it calls is looked through: its closures' functions
# and theirs, a bounded walk (a step's own helpers, not the libraries it calls).
_SCAN_DEPTH = 3


def catches_out_of_memory(step_fn: Any) -> str | None:
    """``"train.py:12"`` where the step function (or a function nested in it, closed over by
    it, or of its own file called by name) names ``OutOfMemoryError`` or "out of memory": a
    handler that goes on after an OOM (a smaller batch, a skipped step); ``None`` where its
    own code names neither (a library's handler is not looked for)."""
    seen: set[int] = set()
    todo: list[tuple[Any, int]] = [(step_fn, 0)]
    while todo:
        value, depth = todo.pop()
        code = _code_of(value)
        if code is None or id(code) in seen or depth > _SCAN_DEPTH:
            continue
        seen.add(id(code))
        found = _site(code)
        if found is not None:
            return found
        for cell in getattr(value, "__closure__", None) or ():
            with contextlib.suppress(ValueError):  # an empty cell
                todo.append((cell.cell_contents, depth + 1))
        todo.extend((helper, depth + 1) for helper in _own_helpers(value, code))
    return None


def _own_helpers(value: Any, code: types.CodeType) -> list[Any]:
    """The functions of the step's own file that ``code`` calls by a global name."""
    namespace = getattr(getattr(value, "__func__", value), "__globals__", None)
    if not isinstance(namespace, dict):
        return []
    names = {i.argval for i in dis.get_instructions(code) if i.opname == "LOAD_GLOBAL"}
    helpers = [namespace.get(name) for name in names]
    return [h for h in helpers if (c := _code_of(h)) is not None and c.co_filename == code.co_filename]


def _code_of(value: Any) -> types.CodeType | None:
    value = getattr(value, "__func__", value)  # a bound method's function
    value = getattr(value, "__wrapped__", value)  # functools.wraps
    code = getattr(value, "__code__", None)
    return code if isinstance(code, types.CodeType) else None


def _site(code: types.CodeType) -> str | None:
    """Where ``code`` (or a code object nested in it) names an out-of-memory error."""
    line = code.co_firstlineno
    for instruction in dis.get_instructions(code):
        # The line: positions from Python 3.11, starts_line (an int) before.
        positions = getattr(instruction, "positions", None)
        start = getattr(instruction, "starts_line", None)
        if positions is not None and positions.lineno is not None:
            line = positions.lineno
        elif isinstance(start, int) and not isinstance(start, bool):
            line = start
        argval = instruction.argval
        if (argval in _OOM_NAMES and instruction.opname.startswith("LOAD")) or (
            isinstance(argval, str) and _OOM_TEXT in argval.lower()
        ):
            return f"{shown_path(code.co_filename)}:{line}"
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found = _site(const)
            if found is not None:
                return found
    return None

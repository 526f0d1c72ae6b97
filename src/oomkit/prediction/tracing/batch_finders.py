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
import functools
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from oomkit.prediction.tracing.import_hooks import patched_on_import

__all__ = ["batch_finder_note", "batch_finders_noticed", "in_trials", "tuner_note"]

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

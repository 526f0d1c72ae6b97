"""Scripts that find their batch by catching out-of-memory errors, noticed.

accelerate's ``find_executable_batch_size`` (accelerate/utils/memory.py; the Hugging Face
Trainer's ``auto_find_batch_size=True`` calls it through transformers/trainer_utils.py) runs
the training function at a starting batch and, when it raises an out-of-memory error
(``should_reduce_batch_size``), empties the cache and runs it again at a smaller batch (0.9x by
default). ``record_script(ooms=True)`` raises the out-of-memory errors the GPU would, so the
finder retries as it would there; while open, ``batch_finders_noticed`` notes each starting
batch, for the prediction to say what happened.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from oomkit.prediction.tracing.import_hooks import patched_on_import

__all__ = ["batch_finder_note", "batch_finders_noticed"]

# Where accelerate defines it and where its users import it from (accelerate.utils re-exports).
_MODULES = ("accelerate.utils.memory", "accelerate.utils")
_NAME = "find_executable_batch_size"


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
def batch_finders_noticed(starts: list[int]) -> Iterator[None]:
    """While open, each ``find_executable_batch_size`` applied appends its starting batch to
    ``starts`` (accelerate is patched when the script imports it)."""
    with contextlib.ExitStack() as stack:
        for name in _MODULES:
            stack.enter_context(patched_on_import(name, _noting(starts)))
        yield


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

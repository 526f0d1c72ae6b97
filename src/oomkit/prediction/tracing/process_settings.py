"""The allocator calls a builder makes before its steps, made again in each recording of them.

A builder (``file.py:function``) and its file run before a recording starts, where
``torch.cuda.set_per_process_memory_fraction(f)`` and
``torch.cuda.memory._set_allocator_settings(s)`` had gone to an allocator no recording reads: a
builder that capped its process at a quarter of the GPU was predicted, and fitted, on the whole
GPU. On the GPU both hold for the rest of the process, its steps included (the fraction is the
caching allocator's ``allowed_memory_maximum``, the settings its live ``AllocatorConfig``:
c10/cuda/CUDACachingAllocator.cpp ``setMemoryFraction``, c10/core/AllocatorConfig.cpp
``setAllocatorSettings``).

While :func:`settings_kept` is open (around the builder and its file's import), those calls are
checked as torch checks them and kept, in order; :func:`made_again` makes them again at the start
of each recording of a step, before the step's own first request, so the report's replay applies
them as it applies a step's own calls (``step_memory.StepMemory``).

Where it may differ: the objects the builder returns to be tracked are recorded as allocated
before the step starts, so before these calls; on the GPU a model built after
``_set_allocator_settings("expandable_segments:True")`` lies in expandable segments, here in
the segments the target's settings give (the fraction limits the peak the same either way).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

from oomkit.prediction.tracing.cuda_device import counting_allocations, recording_memory
from oomkit.prediction.tracing.step_memory import StepMemory

__all__ = ["KEPT_CALLS", "made_again", "settings_kept"]

# The log entries of the calls that hold for the process (StepMemory's names for them).
KEPT_CALLS = ("memory_fraction", "allocator_settings")


@contextlib.contextmanager
def settings_kept() -> Iterator[list[tuple[str, Any]]]:
    """While open (inside ``as_one_cuda_gpu``), the process-wide allocator calls are kept in
    the list yielded, in order, as ``(name, argument)``."""
    log: list[tuple[Any, ...]] = []
    kept: list[tuple[str, Any]] = []
    try:
        with counting_allocations(StepMemory(log)):
            yield kept
    finally:
        kept += [(entry[0], entry[1]) for entry in log if entry[0] in KEPT_CALLS]


def made_again(kept: list[tuple[str, Any]], done: weakref.WeakSet[StepMemory]) -> None:
    """Make the ``kept`` calls in the open recording, once per recording (``done`` holds the
    recordings' memories that have had them)."""
    memory = recording_memory()
    if not kept or memory in done:
        return
    done.add(memory)
    for name, argument in kept:
        if name == "memory_fraction":
            memory.set_memory_fraction(argument)
        else:
            memory.set_allocator_settings(argument)

"""torchtitan jobs that several test modules record, recorded once per process.

An xdist worker (or a plain ``pytest`` run) imports many test modules; those that record the
same job (the same ``TorchtitanJob``, target and steps) share one recording here instead of
each making its own. ``tests`` is on ``sys.path`` (pytest's ``prepend`` mode for
``tests/conftest.py``), so ``tests/prediction`` and ``tests/scenario`` import this one module.

What is shared is read-only: ``TraceRecording``, ``TorchtitanRun`` and ``Prediction`` are frozen
dataclasses, and the tests that take them from here only read them.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["recorded_job"]


def recorded_job(job: Any, target: str = "h100", steps: int = 2) -> tuple[Any, Any, Any]:
    """(recording, run, prediction) of ``record_torchtitan_job(job, ...)`` on ``target``.

    Args:
        job: the ``TorchtitanJob`` (frozen, so it is the cache's key with the rest).
        target: the GPU's name, as ``Target.resolve`` takes it.
        steps: train steps to record.

    Returns:
        The recording, the run's record and ``predict_recording`` of the recording.
    """
    # one key however the caller spelled it (functools.cache keys ``f(job)`` and
    # ``f(job, steps=2)`` apart)
    return _recorded(job, target, steps)


@functools.cache
def _recorded(job: Any, target: str, steps: int) -> tuple[Any, Any, Any]:
    from oomkit.core.target import Target
    from oomkit.prediction.predictor import predict_recording
    from oomkit.prediction.torchtitan_job import record_torchtitan_job

    resolved = Target.resolve(target)
    recording, run = record_torchtitan_job(job, target=resolved, steps=steps)
    return recording, run, predict_recording(recording, target=resolved)

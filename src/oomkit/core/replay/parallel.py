"""Replaying one workload under several allocator settings, across processes when asked.

``tune`` and ``replay --what-if`` replay the same trace under many settings, and an epoch
envelope (``predict --lengths``) replays its run once per remedy. Each replay is deterministic
and independent of the others, so they can run in a pool of forked processes and give exactly
the one-at-a-time results, in the same order (``run_forked``; ``replay_settings`` for settings).
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from functools import partial
from typing import Any, TypeVar

from oomkit.core.allocator import AllocatorConfig
from oomkit.core.replay.result import ReplayResult
from oomkit.errors import AllocatorUsageError

__all__ = ["replay_settings", "run_forked", "worker_count"]

ReplayFunction = Callable[[AllocatorConfig], ReplayResult]
Progress = Callable[[int, int], None]
T = TypeVar("T")


def worker_count(jobs: int | None, settings: int) -> int:
    """How many processes replay ``settings`` settings: 1 unless asked for more (None: one per
    CPU core) and the ``fork`` start method is available (Linux).

    Raises:
        AllocatorUsageError: ``jobs`` is not a positive int or None.
    """
    if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1):
        raise AllocatorUsageError(
            f"jobs must be a positive int or None (one per CPU core); got {jobs!r}."
        )
    wanted = (os.cpu_count() or 1) if jobs is None else jobs
    if wanted <= 1 or settings <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        return 1
    return min(wanted, settings)


def replay_settings(
    replay: ReplayFunction,
    configs: Sequence[AllocatorConfig],
    *,
    jobs: int | None = 1,
    progress: Progress | None = None,
) -> list[ReplayResult]:
    """``[replay(c) for c in configs]``, run ``jobs`` at a time in forked processes.

    Args:
        replay: replays the workload under one setting. It reaches the workers through
            ``fork``, never pickled, so it may be a closure or hold a lambda.
        configs: the settings, in the order of the results.
        jobs: processes to use (None: one per CPU core; 1: one at a time in this process).
        progress: called as ``progress(done, total)``, with ``done`` = 0 before the first
            replay and after each one finishes.

    Returns:
        One result per setting, in ``configs`` order: the results of the one-at-a-time loop.

    Raises:
        AllocatorUsageError: ``jobs`` is not a positive int or None.
        OomkitError: the first failing setting's error (in ``configs`` order), as one at a time.
    """
    return run_forked([partial(replay, config) for config in configs], jobs=jobs, progress=progress)


def run_forked(
    tasks: Sequence[Callable[[], T]], *, jobs: int | None = 1, progress: Progress | None = None
) -> list[T]:
    """``[task() for task in tasks]``, run ``jobs`` at a time in forked processes.

    Args:
        tasks: the work, each a function of no arguments; they reach the workers through
            ``fork``, never pickled (closures are fine); what they return is pickled back.
        jobs: processes to use (None: one per CPU core; 1: one at a time in this process).
        progress: called as ``progress(done, total)``, with ``done`` = 0 before the first
            task and after each one finishes.

    Returns:
        One result per task, in ``tasks`` order: the results of the one-at-a-time loop.

    Raises:
        AllocatorUsageError: ``jobs`` is not a positive int or None.
        Exception: the first failing task's error (in ``tasks`` order), as one at a time.
    """
    total = len(tasks)
    workers = worker_count(jobs, total)
    if progress is not None:
        progress(0, total)
    if workers > 1:
        return _run_in_pool(list(tasks), workers, progress)
    results = []
    for done, task in enumerate(tasks, start=1):
        results.append(task())
        if progress is not None:
            progress(done, total)
    return results


# The tasks, in a worker process: inherited through fork, never pickled.
_WORKER_TASKS: list[Callable[[], Any]] = []


def _init_worker(tasks: list[Callable[[], Any]]) -> None:
    _WORKER_TASKS[:] = tasks


def _run_one(index: int) -> Any:
    assert _WORKER_TASKS, "the worker was started without its tasks"
    return _WORKER_TASKS[index]()


def _run_in_pool(tasks: list[Callable[[], T]], workers: int, progress: Progress | None) -> list[T]:
    """Every task run in a pool of forked processes; results in ``tasks`` order."""
    context = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(workers, context, initializer=_init_worker, initargs=(tasks,)) as pool:
        futures = [pool.submit(_run_one, index) for index in range(len(tasks))]
        if progress is not None:
            for done, _ in enumerate(as_completed(futures), start=1):
                progress(done, len(tasks))
        # In order, so the first failing task's error is raised, as one at a time.
        return [future.result() for future in futures]

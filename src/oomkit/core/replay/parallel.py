"""Replaying one workload under several allocator settings, across processes when asked.

``tune`` and ``replay --what-if`` replay the same trace under many settings. Each replay is
deterministic and independent of the others, so they can run in a pool of forked processes
and give exactly the one-at-a-time results, in the same order.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed

from oomkit.core.allocator import AllocatorConfig
from oomkit.core.replay.result import ReplayResult
from oomkit.errors import AllocatorUsageError

__all__ = ["replay_settings", "worker_count"]

ReplayFunction = Callable[[AllocatorConfig], ReplayResult]
Progress = Callable[[int, int], None]


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
    total = len(configs)
    workers = worker_count(jobs, total)
    if progress is not None:
        progress(0, total)
    if workers > 1:
        return _replay_in_pool(replay, list(configs), workers, progress)
    results = []
    for done, config in enumerate(configs, start=1):
        results.append(replay(config))
        if progress is not None:
            progress(done, total)
    return results


# The replay function, in a worker process: inherited through fork, never pickled.
_WORKER_REPLAY: ReplayFunction | None = None


def _init_worker(replay: ReplayFunction) -> None:
    global _WORKER_REPLAY
    _WORKER_REPLAY = replay


def _replay_one(config: AllocatorConfig) -> ReplayResult:
    assert _WORKER_REPLAY is not None, "the worker was started without its replay function"
    return _WORKER_REPLAY(config)


def _replay_in_pool(
    replay: ReplayFunction,
    configs: list[AllocatorConfig],
    workers: int,
    progress: Progress | None,
) -> list[ReplayResult]:
    """Every config replayed in a pool of forked processes; results in ``configs`` order."""
    context = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(workers, context, initializer=_init_worker, initargs=(replay,)) as pool:
        futures = [pool.submit(_replay_one, config) for config in configs]
        if progress is not None:
            for done, _ in enumerate(as_completed(futures), start=1):
                progress(done, len(configs))
        # In order, so the first failing setting's error is raised, as one at a time.
        return [future.result() for future in futures]

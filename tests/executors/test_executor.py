"""Executors: here, a local fork pool and Ray give the one-at-a-time results, in order."""

from __future__ import annotations

import os
import sys
import time

import pytest

from oomkit.errors import OomkitError
from oomkit.executors import (
    InProcessExecutor,
    LocalPoolExecutor,
    RayExecutor,
    make_executor,
)


def _square(n: int) -> int:
    return n * n


def _fails_on_odd(n: int) -> int:
    if n % 2:
        raise OomkitError(f"item {n} is odd")
    return n


def test_here_and_local_pool_give_the_loop_results_and_progress():
    """Both run [fn(x) for x in items] in order, reporting 0 then each finished task once."""
    items = list(range(7))
    for executor in (InProcessExecutor(), LocalPoolExecutor(2)):
        seen: list[tuple[int, int]] = []
        results = executor.map(_square, items, progress=lambda d, t, s=seen: s.append((d, t)))
        assert results == [0, 1, 4, 9, 16, 25, 36]
        assert seen == [(d, 7) for d in range(8)]


def test_local_pool_raises_the_first_failing_items_error():
    """The error of the first failing item in items order, as the loop would raise it."""
    with pytest.raises(OomkitError, match="item 1 is odd"):
        LocalPoolExecutor(2).map(_fails_on_odd, [0, 1, 2, 3])


def test_make_executor_kinds_and_bad_input():
    """'here', 'local' and 'ray' name the three; anything else and bad retries are refused."""
    assert isinstance(make_executor("here"), InProcessExecutor)
    local = make_executor("local", jobs=3)
    assert isinstance(local, LocalPoolExecutor) and local.jobs == 3
    ray = make_executor("ray", address="10.0.0.1:6379", max_retries=5)
    assert isinstance(ray, RayExecutor) and (ray.address, ray.max_retries) == ("10.0.0.1:6379", 5)
    with pytest.raises(OomkitError, match="unknown executor 'gpu'"):
        make_executor("gpu")  # type: ignore[arg-type]
    with pytest.raises(OomkitError, match="max_retries must be an int >= 0; got -1"):
        RayExecutor(max_retries=-1)


# --- Ray: a local cluster of 2 CPUs, started once for this module -------------------------------


@pytest.fixture(scope="module")
def ray_cluster(ray_session):
    ray = ray_session
    # The workers cannot import this test module: its functions travel by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield ray
    ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def test_ray_gives_the_loop_results_and_counts_each_task_once(ray_cluster):
    """Results in items order; progress 0..n, one call per finished task."""
    seen: list[int] = []
    results = RayExecutor().map(_square, list(range(6)), progress=lambda d, t: seen.append(d))
    assert results == [0, 1, 4, 9, 16, 25]
    assert seen == [0, 1, 2, 3, 4, 5, 6]


def test_ray_raises_the_tasks_own_error(ray_cluster):
    """What fn raised on a worker comes back as itself (OomkitError), first failing item first."""
    with pytest.raises(OomkitError, match="item 1 is odd"):
        RayExecutor().map(_fails_on_odd, [0, 1, 2, 3])


def test_ray_retries_a_task_whose_worker_died(ray_cluster, tmp_path):
    """A worker that dies (os._exit) once has its task run again: every item, once."""
    marker = str(tmp_path / "died")

    def dies_once(n: int) -> int:
        if n == 2 and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(1)
        return n + 100

    seen: list[int] = []
    results = RayExecutor(max_retries=2).map(dies_once, [0, 1, 2, 3], progress=lambda d, t: seen.append(d))
    assert results == [100, 101, 102, 103]
    assert os.path.exists(marker)
    assert seen == [0, 1, 2, 3, 4]


def test_ray_without_retries_names_the_lost_task(ray_cluster, tmp_path):
    """With max_retries=0 a dead worker's task gives an OomkitError saying what to do."""

    def dies(n: int) -> int:
        os._exit(3)

    with pytest.raises(OomkitError, match="its worker died more times than max_retries allows"):
        RayExecutor(max_retries=0).map(dies, [0])


# How long a task left running after the interrupt would take to finish, uncancelled.
_SLOW_TASK_S = 1.0


def test_ctrl_c_cancels_the_tasks_left_on_the_cluster(ray_cluster, tmp_path):
    """KeyboardInterrupt during the wait cancels the unfinished tasks: none of them finishes."""
    folder = str(tmp_path)
    interrupted = os.path.join(folder, "interrupted")

    def slow(n: int) -> int:
        if n:
            # The clock of a task's end starts at the interrupt, not at its start: however late
            # a busy machine lets the test see task 0 and interrupt, no task could have ended
            # before (tasks 2 and 3 wait for a CPU; task 1 runs beside task 0).
            while not os.path.exists(interrupted):
                time.sleep(0.01)
            time.sleep(_SLOW_TASK_S)
            open(os.path.join(folder, f"done{n}"), "w").close()
        return n

    def interrupt(done: int, total: int) -> None:
        if done == 1:
            open(interrupted, "w").close()
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        RayExecutor().map(slow, [0, 1, 2, 3], progress=interrupt)
    # Past the end of an uncancelled task (one running at the interrupt, or one that missed the
    # cancel and started when map returned), with the margin of seconds a busy machine needs.
    time.sleep(_SLOW_TASK_S + 1.5)
    assert sorted(os.listdir(folder)) == ["interrupted"]

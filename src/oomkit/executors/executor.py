"""Executors: one interface to run independent tasks here, in forked processes, or on Ray.

A plan's candidates, a fleet's snapshots, a tuning's settings: lists of independent,
deterministic tasks whose results do not depend on where they run. ``Executor.map(fn, items)``
is ``[fn(item) for item in items]`` with the results in ``items`` order, wherever the work went:

- ``InProcessExecutor``: one at a time, in this process (tests, debugging, one core).
- ``LocalPoolExecutor``: forked processes on this machine (``forked.py run_forked``: the
  libgomp one-thread rule and the stuck-pool watch come with it). The default.
- ``RayExecutor``: one Ray task per item on an existing cluster (``address``, or
  ``RAY_ADDRESS``) or a local one; a task whose worker dies is retried (Ray's ``max_retries``),
  so every item gets exactly one result, and Ctrl-C cancels the tasks still on the cluster.
  Ray is an optional extra (``pip install 'oomkit[ray]'``), imported only here and only when
  a ``RayExecutor`` runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Literal, Protocol, TypeVar

from oomkit.errors import OomkitError
from oomkit.executors.forked import run_forked

__all__ = [
    "Executor",
    "ExecutorKind",
    "InProcessExecutor",
    "LocalPoolExecutor",
    "RayExecutor",
    "make_executor",
]

A = TypeVar("A")
T = TypeVar("T")
Progress = Callable[[int, int], None]
ExecutorKind = Literal["here", "local", "ray"]


class Executor(Protocol):
    """Runs ``fn`` over ``items``; the results are ``[fn(item) for item in items]``."""

    name: str

    def map(
        self, fn: Callable[[A], T], items: Sequence[A], *, progress: Progress | None = None
    ) -> list[T]:
        """``[fn(item) for item in items]``, in ``items`` order.

        Args:
            fn: the work on one item.
            items: the inputs.
            progress: called as ``progress(done, total)``: ``done`` = 0 before the first task,
                then once per finished task (each task counted once, whatever its retries).

        Raises:
            Exception: the first failing item's error (in ``items`` order), as one at a time.
        """
        ...


class InProcessExecutor:
    """Every task one at a time in this process."""

    name = "here"

    def map(
        self, fn: Callable[[A], T], items: Sequence[A], *, progress: Progress | None = None
    ) -> list[T]:
        """See ``Executor.map``."""
        return run_forked([partial(fn, item) for item in items], jobs=1, progress=progress)


class LocalPoolExecutor:
    """Tasks in a pool of forked processes on this machine (``jobs``: None, one per core).

    ``fn`` and the items reach the workers through ``fork`` (never pickled: a closure is
    fine); results are pickled back. Where fork is not available (Windows), one at a time.
    """

    name = "local"

    def __init__(self, jobs: int | None = None) -> None:
        self.jobs = jobs

    def map(
        self, fn: Callable[[A], T], items: Sequence[A], *, progress: Progress | None = None
    ) -> list[T]:
        """See ``Executor.map``."""
        return run_forked([partial(fn, item) for item in items], jobs=self.jobs, progress=progress)


# How long one ray.wait looks before it looks again (a Ctrl-C is seen between looks).
_RAY_WAIT_S = 0.5
# On Ctrl-C: how many times unsettled tasks are cancelled, and how long each round waits for
# the cancelled ones to settle (``_cancel``).
_CANCEL_ROUNDS = 5
_CANCEL_WAIT_S = 0.5


class RayExecutor:
    """One Ray task per item, on the cluster at ``address`` (None: ``RAY_ADDRESS``, else a
    local cluster this process starts, of ``num_cpus`` CPUs).

    ``fn`` and the items are pickled to the workers (cloudpickle), so the workers must import
    oomkit (on a remote cluster, install it there or pass ``runtime_env``). A task whose worker
    process dies (killed, out of host memory) is run again, up to ``max_retries`` times
    (``ray.remote(max_retries=)``: Ray retries system failures, never an exception ``fn``
    raised, which comes back as it was raised). Results are gathered by task, in ``items``
    order, so a retried task is neither lost nor counted twice.
    """

    name = "ray"

    def __init__(
        self,
        address: str | None = None,
        *,
        max_retries: int = 3,
        num_cpus: int | None = None,
        runtime_env: dict[str, Any] | None = None,
    ) -> None:
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise OomkitError(f"max_retries must be an int >= 0; got {max_retries!r}")
        self.address = address
        self.max_retries = max_retries
        self.num_cpus = num_cpus
        self.runtime_env = runtime_env

    def map(
        self, fn: Callable[[A], T], items: Sequence[A], *, progress: Progress | None = None
    ) -> list[T]:
        """See ``Executor.map``.

        Raises:
            OomkitError: Ray is not installed, the cluster cannot be reached, or a task's
                worker died more than ``max_retries`` times.
            KeyboardInterrupt: after the unfinished tasks were cancelled on the cluster.
        """
        ray = _import_ray()
        self._connect(ray)
        total = len(items)
        if progress is not None:
            progress(0, total)
        remote = ray.remote(max_retries=self.max_retries, retry_exceptions=False)(fn)
        refs = [remote.remote(item) for item in items]
        pending = list(refs)
        done = 0
        try:
            while pending:
                finished, pending = ray.wait(pending, num_returns=1, timeout=_RAY_WAIT_S)
                for _ in finished:
                    done += 1
                    if progress is not None:
                        progress(done, total)
        except KeyboardInterrupt:
            _cancel(ray, pending)
            raise
        # In order, so the first failing item's error is raised, as one at a time.
        return [_ray_result(ray, ref) for ref in refs]

    def _connect(self, ray: Any) -> None:
        """Join the cluster (or start a local one) unless this process already has."""
        if ray.is_initialized():
            return
        options: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
        if self.runtime_env is not None:
            options["runtime_env"] = self.runtime_env
        if self.address is None and self.num_cpus is not None:
            options["num_cpus"] = self.num_cpus
        try:
            ray.init(address=self.address, **options)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise OomkitError(
                f"could not reach a Ray cluster at {self.address or 'RAY_ADDRESS / local'}: "
                f"{exc}. Start one (`ray start --head`) and pass its address (--ray HOST:6379), "
                "or leave --ray's address out for a local cluster"
            ) from exc


def _ray_result(ray: Any, ref: Any) -> Any:
    """One task's result; what ``fn`` raised is raised again as itself (not Ray's wrapper)."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException):
            raise cause from None
        raise
    except (ray.exceptions.WorkerCrashedError, ray.exceptions.TaskCancelledError) as exc:
        raise OomkitError(
            f"a Ray task gave no result ({type(exc).__name__}): its worker died more times than "
            "max_retries allows, or it was cancelled. Run again, or with more host memory per "
            "worker"
        ) from exc


def _cancel(ray: Any, refs: list[Any]) -> None:
    """Cancel every task of ``refs`` on the cluster, asking again for those still unsettled.

    A task that a worker is being handed while ``ray.cancel`` runs can miss the cancel and run
    to its end (measured: 1 run in 4 of tests/executors' Ctrl-C test let a queued task finish
    when the first one's slot freed); a cancelled task settles at once (``ray.wait`` returns
    it, its result a ``TaskCancelledError``), one that missed it does not, so it is cancelled
    again. Ray never retries a cancelled task (``ray.cancel``'s documentation).
    """
    for _ in range(_CANCEL_ROUNDS):
        for ref in refs:
            ray.cancel(ref, force=True)
        _, refs = ray.wait(refs, num_returns=len(refs), timeout=_CANCEL_WAIT_S)
        if not refs:
            return


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise OomkitError(
            "running on Ray needs the ray package: pip install 'oomkit[ray]' (or pip install "
            "ray), or drop --ray to run on this machine's processes"
        ) from exc
    return ray


def make_executor(
    kind: ExecutorKind = "local",
    *,
    jobs: int | None = None,
    address: str | None = None,
    max_retries: int = 3,
) -> Executor:
    """The executor of ``kind``: ``"here"`` (this process), ``"local"`` (forked processes,
    ``jobs`` of them; None: one per core) or ``"ray"`` (the cluster at ``address``).

    Raises:
        OomkitError: an unknown ``kind``.
    """
    if kind == "here":
        return InProcessExecutor()
    if kind == "local":
        return LocalPoolExecutor(jobs)
    if kind == "ray":
        return RayExecutor(address, max_retries=max_retries)
    raise OomkitError(f"unknown executor {kind!r}: use 'here', 'local' or 'ray'")

"""Forked processes: a pool for a list of independent tasks, and one call the caller goes on beside.

``tune`` and ``replay --what-if`` replay the same trace under many settings, and an epoch
envelope (``predict --lengths``) replays its run once per remedy. Each replay is deterministic
and independent of the others, so they can run in a pool of forked processes and give exactly
the one-at-a-time results, in the same order (``run_forked``; ``replay_settings`` for settings).
``ForkedCall`` runs one function in a forked process while the caller goes on, for work whose
need is known ahead (a batch search traces the sizes its next decision will ask for).
"""

from __future__ import annotations

import io
import os
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from oomkit.core.allocator import AllocatorConfig
from oomkit.core.replay.result import ReplayResult
from oomkit.errors import AllocatorUsageError

if TYPE_CHECKING:
    from concurrent.futures import Future

# multiprocessing and concurrent.futures are imported where a process is started: together they
# are a third of `oomkit replay FILE --verify`'s start-up, and a replay in this process needs
# neither (issue 41 item 4).

__all__ = [
    "ForkedCall",
    "ForkedCallFailed",
    "fork_available",
    "memory_worker_cap",
    "process_count",
    "replay_settings",
    "run_forked",
    "run_forked_or_here",
    "worker_count",
]

ReplayFunction = Callable[[AllocatorConfig], ReplayResult]
Progress = Callable[[int, int], None]
T = TypeVar("T")


def worker_count(jobs: int | None, settings: int) -> int:
    """How many processes replay ``settings`` settings: ``process_count(jobs)``, at most one
    per setting, and no more than free memory holds (``memory_worker_cap``).

    Raises:
        AllocatorUsageError: ``jobs`` is not a positive int or None.
    """
    cap = memory_worker_cap()
    return max(1, min(process_count(jobs), settings, settings if cap is None else cap))


def memory_worker_cap() -> int | None:
    """How many forked processes the memory available now holds, each counted as large as this
    process (at least 1); ``None`` where Linux's figures cannot be read.

    A forked process shares this one's pages until either writes one, and a replay writes to
    every object it reads (its reference count): replaying a snapshot, a worker comes to copy
    much of the trace this process loaded (a 1M-event, 200 MB snapshot: 715 MB resident here,
    and about 220 MB more per `tune` worker, proportional PSS). With one worker per core, a
    large snapshot on a many-core machine could take more memory than it has; counted as this
    whole process (VmRSS of /proc/self/status), a worker never does: MemAvailable of
    /proc/meminfo (proc(5)) over that.
    """
    rss = _proc_kib("/proc/self/status", "VmRSS:")
    available = _proc_kib("/proc/meminfo", "MemAvailable:")
    if rss is None or available is None or rss <= 0:
        return None
    return max(1, available // rss)


def _proc_kib(path: str, key: str) -> int | None:
    """The kiB figure of the line starting with ``key`` in a /proc file; None where absent."""
    try:
        with open(path, encoding="ascii", errors="replace") as lines:
            for line in lines:
                if line.startswith(key):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def process_count(jobs: int | None) -> int:
    """How many processes to run at once for ``jobs``: that many (None: one per CPU core), or 1
    where the ``fork`` start method is not available (Windows).

    Raises:
        AllocatorUsageError: ``jobs`` is not a positive int or None.
    """
    if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1):
        raise AllocatorUsageError(
            f"jobs must be a positive int or None (one per CPU core); got {jobs!r}."
        )
    wanted = (os.cpu_count() or 1) if jobs is None else jobs
    return wanted if wanted > 1 and fork_available() else 1


def fork_available() -> bool:
    """Whether processes can be forked here (Linux, macOS; not Windows)."""
    import multiprocessing

    return "fork" in multiprocessing.get_all_start_methods()


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

    A pool whose processes are stuck (together they used under 2% of a core for
    ``_POOL_LOOK_S`` while a task was unfinished: a process that waits forever, on a lock a
    library held when it was forked, uses none) is stopped, and every task is run here instead,
    one at a time: never a wait with no end that one at a time would not have had.

    Raises:
        AllocatorUsageError: ``jobs`` is not a positive int or None.
        Exception: the first failing task's error (in ``tasks`` order), as one at a time.
    """
    total = len(tasks)
    workers = worker_count(jobs, total)
    if progress is not None:
        progress(0, total)
    if workers > 1:
        try:
            return _run_in_pool(list(tasks), workers, progress)
        except _PoolStuck:  # every task again, one at a time here: as one at a time would
            if progress is not None:
                progress(0, total)
    results = []
    for done, task in enumerate(tasks, start=1):
        results.append(task())
        if progress is not None:
            progress(done, total)
    return results


def run_forked_or_here(
    tasks: Sequence[Callable[[], T]], *, jobs: int | None = 1, progress: Progress | None = None
) -> list[T]:
    """``run_forked``, and where a task fails in a forked process (it raised, its process died,
    its result could not come back), every task again one at a time here: an error is then
    raised as one at a time raises it, never a worker's copy of it.

    Raises:
        AllocatorUsageError: ``jobs`` is not a positive int or None.
        Exception: the first failing task's error (in ``tasks`` order), as one at a time.
    """
    if process_count(jobs) > 1 and len(tasks) > 1:
        try:
            return run_forked(tasks, jobs=jobs, progress=progress)
        except Exception:  # noqa: BLE001, S110 - done again here below
            pass
    return run_forked(tasks, jobs=1, progress=progress)


# The tasks, in a worker process: inherited through fork, never pickled.
_WORKER_TASKS: list[Callable[[], Any]] = []


def _init_worker(tasks: list[Callable[[], Any]]) -> None:
    _own_streams()
    _one_kernel_thread()
    _WORKER_TASKS[:] = tasks


def _run_one(index: int) -> Any:
    assert _WORKER_TASKS, "the worker was started without its tasks"
    return _WORKER_TASKS[index]()


# A pool whose processes together used less than this share of a core over this long, with a
# task unfinished, is stuck (run_forked). A task is a replay or a trace: CPU all along.
_POOL_LOOK_S = 5.0
_STUCK_CPU_SHARE = 0.02
# How often ForkedCall.result_unless_stalled looks whether the answer came.
_POLL_S = 0.1


class _PoolStuck(Exception):
    """The pool's processes stopped using CPU with tasks unfinished (they were stopped)."""


def _run_in_pool(tasks: list[Callable[[], T]], workers: int, progress: Progress | None) -> list[T]:
    """Every task run in a pool of forked processes; results in ``tasks`` order.

    Raises:
        _PoolStuck: the pool's processes stopped using CPU with tasks unfinished.
        Exception: the first failing task's error (in ``tasks`` order).
    """
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    context = multiprocessing.get_context("fork")
    _flush_before_fork()
    before = {child.pid for child in multiprocessing.active_children()}
    pool = ProcessPoolExecutor(workers, context, initializer=_init_worker, initargs=(tasks,))
    try:
        futures = [pool.submit(_run_one, index) for index in range(len(tasks))]
        _wait_unless_stuck(futures, progress, before)
        # In order, so the first failing task's error is raised, as one at a time.
        return [future.result() for future in futures]
    except _PoolStuck:
        for child in multiprocessing.active_children():
            if child.pid not in before:
                child.kill()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _wait_unless_stuck(futures: list[Future[Any]], progress: Progress | None, others: set[int | None]) -> None:
    """Wait for every future, calling ``progress`` as each finishes; raise ``_PoolStuck`` when
    the processes started since ``others`` (the pool's) use no CPU over ``_POOL_LOOK_S``."""
    from concurrent.futures import FIRST_COMPLETED, wait

    pending = set(futures)
    done = 0
    watch = _CpuWatch(partial(_pool_cpu_seconds, others), _POOL_LOOK_S, _STUCK_CPU_SHARE)
    while pending:
        finished, pending = wait(pending, timeout=_POOL_LOOK_S, return_when=FIRST_COMPLETED)
        if finished:
            for _ in finished:
                done += 1
                if progress is not None:
                    progress(done, len(futures))
            watch.restart()
        elif watch.starved():
            raise _PoolStuck(f"no CPU used with {len(pending)} task(s) unfinished")


class _CpuWatch:
    """Whether processes doing work stopped getting the CPU it takes.

    ``read()`` gives the CPU seconds they used so far (None where that cannot be read: the
    watch then never calls them starved). ``starved()``, asked as often as the caller likes,
    is True once, over a look of at least ``look_s`` seconds, they used less than
    ``min_share`` of that time: a process deadlocked in a wait uses none, one of normal
    priority gets its fair share of a core however busy the machine is, and one at the lowest
    priority gets little where other work holds the cores.
    """

    def __init__(self, read: Callable[[], float | None], look_s: float, min_share: float) -> None:
        self._read = read
        self._look_s = look_s
        self._min_share = min_share
        self.restart()

    def restart(self) -> None:
        """Start a new look from now (the work made progress another way)."""
        self._cpu, self._at = self._read(), time.monotonic()

    def starved(self) -> bool:
        now = time.monotonic()
        if now - self._at < self._look_s:
            return False
        used = self._read()
        if self._cpu is not None and used is not None and used - self._cpu < self._min_share * (now - self._at):
            return True
        self._cpu, self._at = used, now
        return False


def _pool_cpu_seconds(others: set[int | None]) -> float | None:
    """CPU seconds used so far by this process's children not in ``others``; None where one
    cannot be read (not Linux) or there are none yet."""
    import multiprocessing

    pids = [child.pid for child in multiprocessing.active_children() if child.pid not in others]
    seconds = [_cpu_seconds(pid) for pid in pids if pid is not None]
    if not seconds or any(value is None for value in seconds):
        return None
    return sum(value for value in seconds if value is not None)


def _cpu_seconds(pid: int) -> float | None:
    """CPU seconds process ``pid`` has used so far (user and system), read from Linux's
    ``/proc/PID/stat`` (fields 14 and 15, utime and stime, in clock ticks: proc(5));
    ``None`` where that cannot be read (another OS, the process already gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read().decode("ascii", "replace")
        # The command name (field 2) is in parentheses and may hold spaces: split after it.
        fields = text[text.rindex(")") + 2 :].split()
        ticks = int(fields[11]) + int(fields[12])  # fields 14 and 15 of the whole line
        return ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class ForkedCallFailed(Exception):
    """A ``ForkedCall`` that gave no result: its function raised (the message says what), or its
    process died. The caller runs the work itself to get the real error."""


class ForkedCall(Generic[T]):
    """``fn()`` running in a forked process from now on; ``result()`` waits for what it returned.

    The function reaches the process through ``fork`` (never pickled: a closure is fine); what it
    returns is pickled back. The process writes nothing of this one's buffered output again
    (buffers are flushed before the fork, and the child leaves by ``os._exit``).

    ``background=True`` (kept as ``background``) runs it at the lowest CPU priority
    (``os.nice(19)``): work that may not
    be needed, done on a core nothing else wants. Linux's scheduler then gives it about 1.5% of
    a core that a process of normal priority also wants (CFS weight 15 against 1024,
    kernel/sched/core.c ``sched_prio_to_weight``), so it never slows the work that is needed.

    Raises:
        OSError: the process could not be started (``fork_available()`` is False, no memory).
    """

    def __init__(self, fn: Callable[[], T], *, background: bool = False) -> None:
        self.background = background
        import multiprocessing

        context = multiprocessing.get_context("fork")
        self._receive, send = context.Pipe(duplex=False)
        _flush_before_fork()
        self._process = context.Process(
            target=_call_and_send, args=(fn, send, background), daemon=True
        )
        self._process.start()
        send.close()  # the child's end: EOF here once the child is gone

    def result(self, timeout_s: float | None = None) -> T:
        """What ``fn()`` returned, once it has (waits for it, at most ``timeout_s`` seconds).

        Raises:
            ForkedCallFailed: ``fn()`` raised, the process ended without an answer, or it gave
                none within ``timeout_s`` (it is then stopped).
        """
        if timeout_s is not None and not self._receive.poll(timeout_s):
            self.cancel()
            raise ForkedCallFailed(f"the forked process gave no answer within {timeout_s:.0f} s")
        try:
            try:
                status, payload = self._receive.recv()
            except (EOFError, OSError) as exc:
                self._process.join()
                raise ForkedCallFailed(
                    f"the forked process ended without an answer (exit code {self._process.exitcode})"
                ) from exc
        finally:
            self._receive.close()
        self._process.join()
        if status != "ok":
            raise ForkedCallFailed(payload)
        result: T = payload
        return result

    def result_unless_stalled(self, *, wait_s: float, look_s: float, min_cpu_share: float) -> T | None:
        """What ``fn()`` returned, or ``None`` (the caller does the work itself): waited for at
        most ``wait_s`` seconds, and given up on at once when, over a look of ``look_s``
        seconds, the process used less than ``min_cpu_share`` of that time in CPU (stuck, or
        starved by other work; where its CPU time cannot be read, not Linux, the plain wait).
        A process given up on is stopped, without waiting for it to exit; one whose ``fn()``
        raised or that died gives ``None`` too, so the work is redone, and raises, there."""
        deadline = time.monotonic() + wait_s
        watch = _CpuWatch(self.cpu_seconds, look_s, min_cpu_share)
        while not self.done(min(look_s, _POLL_S)):
            if time.monotonic() >= deadline or watch.starved():
                self.cancel(wait=False)
                return None
        try:
            return self.result()
        except ForkedCallFailed:
            return None

    def done(self, wait_s: float = 0.0) -> bool:
        """Whether its answer (or its end) has come, waiting at most ``wait_s`` seconds for it:
        ``result()`` would then not wait."""
        return self._receive.closed or self._receive.poll(wait_s)

    def cpu_seconds(self) -> float | None:
        """CPU seconds the process has used so far (user and system, ``_cpu_seconds``);
        ``None`` where that cannot be read (another OS, the process already gone)."""
        pid = self._process.pid
        return None if pid is None else _cpu_seconds(pid)

    def cancel(self, *, wait: bool = True) -> None:
        """Stop the process, whatever it is doing; its result is never read.

        ``wait=False`` sends the kill and goes on: a process at the lowest priority on a busy
        machine may take a few tenths of a second to be scheduled and exit; multiprocessing
        reaps it later (when the next process starts, or at exit).
        """
        if self._process.is_alive():
            self._process.kill()
        if wait:
            self._process.join()
        self._receive.close()


def _call_and_send(fn: Callable[[], Any], send: Any, background: bool = False) -> None:
    """In the forked process: ``fn()``, its result (or what it raised) sent back, then exit;
    at the lowest CPU priority when ``background``."""
    code = 0
    try:
        if background:
            _lowest_priority()
        _own_streams()
        _one_kernel_thread()
        try:
            message: tuple[str, Any] = ("ok", fn())
        except BaseException as exc:  # noqa: BLE001 - every failure goes back as text
            message = ("error", f"{type(exc).__name__}: {exc}")
        try:
            send.send(message)
        except Exception as exc:  # noqa: BLE001 - an unpicklable result
            send.send(("error", f"its result could not be sent back: {type(exc).__name__}: {exc}"))
    except BaseException:  # noqa: BLE001 - the parent went away: nothing to tell
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001, S110 - a closed stream: nothing to flush
                pass
        # Leave without the interpreter's exit (atexit handlers, buffers copied from the parent).
        os._exit(code)


def _lowest_priority() -> None:
    """Lower this process to the lowest CPU priority (nice 19); where it cannot be lowered, it
    runs as it is (the result is the same, only sooner or later)."""
    try:
        os.nice(19 - os.nice(0))
    except OSError:
        pass


def _one_kernel_thread() -> None:
    """In a forked process: torch's CPU kernels on one thread, where torch is loaded.

    torch's CPU build runs parallel regions on GNU OpenMP (libgomp), which keeps the thread
    pool a parent's first parallel region started; fork copies only the forking thread, so a
    child's next parallel region waits forever for threads it does not have (seen: a real CPU
    ``bmm`` of a Llama trace in the parent, then every process forked after it stuck in
    ``gomp_team_barrier_wait_end``). With one thread a parallel region runs inline. torch's
    DataLoader workers do the same (torch/utils/data/_utils/worker.py ``_worker_loop``:
    ``torch.set_num_threads(1)``); a forked process here is one of a process per core anyway.
    torch is never imported here: a process without it has no such pool.
    """
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


def _flush_before_fork() -> None:
    """Flush this process's output, so nothing buffered here is written again by a child."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()


def _own_streams() -> None:
    """Give the forked process new ``sys.stdout``/``sys.stderr`` on the file descriptors the
    parent's write to: a stream the parent wraps (rich's live display, ``redirect_stdout``) may
    hold a lock another of its threads had at the fork, which nothing here would ever release.
    A stream with no descriptor (a test's capture) leaves it as it was."""
    for name in ("stdout", "stderr"):
        try:
            fd = getattr(sys, name).fileno()
        except (AttributeError, OSError, ValueError):
            continue
        setattr(sys, name, io.TextIOWrapper(
            io.FileIO(os.dup(fd), "w"), line_buffering=True, errors="backslashreplace"
        ))

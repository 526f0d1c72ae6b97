"""replay_settings: several settings replayed in forked processes give the one-at-a-time results."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from _shared_snapshots import SHARED_FILES

from oomkit.core.allocator import AllocatorConfig
from oomkit.core.replay import replay_snapshot
from oomkit.core.snapshot import load_snapshot
from oomkit.errors import AllocatorUsageError
from oomkit.executors import replay_settings, worker_count

SETTINGS = (
    "",
    "expandable_segments:True",
    "max_split_size_mb:64",
    "max_split_size_mb:128,garbage_collection_threshold:0.6",
    "roundup_power2_divisions:4",
)


def _largest_shared_snapshot() -> Path | None:
    # The largest file below 2 MB: a real trace with thousands of events that replays in < 1 s.
    small = [p for p in SHARED_FILES if p.stat().st_size < 2_000_000]
    return max(small, key=lambda p: p.stat().st_size) if small else None


SNAPSHOT = _largest_shared_snapshot()


@pytest.mark.skipif(SNAPSHOT is None, reason="the shared snapshots are not available")
def test_parallel_results_equal_serial_on_a_real_snapshot():
    """Every field of every ReplayResult (segment decisions, peaks, final state) is the same with
    jobs=2 as one at a time, in the settings' order."""
    snapshot = load_snapshot(SNAPSHOT)
    device = snapshot.devices()[0]
    configs = [AllocatorConfig.parse(text) for text in SETTINGS]

    def replay(config):
        return replay_snapshot(snapshot, device, verify=False, config=config, capacity_bytes=2**34)

    serial = replay_settings(replay, configs, jobs=1)
    parallel = replay_settings(replay, configs, jobs=2)
    assert [r.alloc_conf for r in parallel] == list(SETTINGS)
    assert parallel == serial
    assert [r.segment_events for r in parallel] == [r.segment_events for r in serial]
    assert all(r.events > 0 for r in serial)
    # The inputs prepared once for this snapshot object give what a freshly loaded copy gives.
    fresh = load_snapshot(SNAPSHOT)
    assert replay(configs[1]) == replay_snapshot(
        fresh, device, verify=False, config=configs[1], capacity_bytes=2**34
    )


def test_progress_counts_every_setting_in_both_modes():
    """progress(0, n) first, then n more calls ending at (n, n), one at a time and in a pool."""
    configs = [AllocatorConfig.parse(text) for text in SETTINGS[:3]]

    def replay(config):
        return replay_snapshot(_tiny_snapshot(), 0, verify=False, config=config)

    for jobs in (1, 2):
        calls: list[tuple[int, int]] = []

        def record(done: int, total: int, calls: list[tuple[int, int]] = calls) -> None:
            calls.append((done, total))

        results = replay_settings(replay, configs, jobs=jobs, progress=record)
        assert calls == [(0, 3), (1, 3), (2, 3), (3, 3)]
        assert len(results) == 3


def test_the_first_failing_setting_raises_as_one_at_a_time():
    """A setting whose replay raises stops the sweep with that error, in a pool too."""

    def replay(config):
        if config.max_split_size_bytes is not None:
            raise AllocatorUsageError("boom at the max_split_size setting")
        return replay_snapshot(_tiny_snapshot(), 0, verify=False, config=config)

    configs = [AllocatorConfig.parse(text) for text in ("", "max_split_size_mb:64")]
    for jobs in (1, 2):
        with pytest.raises(AllocatorUsageError, match="boom"):
            replay_settings(replay, configs, jobs=jobs)


def test_worker_count_rules(monkeypatch):
    """One process for one setting or jobs=1; never more than the settings, nor than memory
    holds; bad jobs refused."""
    import oomkit.executors.forked as parallel

    monkeypatch.setattr(parallel, "memory_worker_cap", lambda: None)  # figures not readable
    assert worker_count(1, 10) == 1
    assert worker_count(4, 1) == 1
    assert worker_count(8, 3) == 3
    assert worker_count(2, 5) == 2
    assert worker_count(None, 64) == min(os.cpu_count() or 1, 64)
    for bad in (0, -1, True, 1.5, "2"):
        with pytest.raises(AllocatorUsageError, match="jobs must be a positive int"):
            worker_count(bad, 4)  # type: ignore[arg-type]
    monkeypatch.setattr(parallel, "memory_worker_cap", lambda: 3)
    assert worker_count(8, 10) == 3
    assert worker_count(2, 10) == 2
    assert worker_count(8, 1) == 1


def test_memory_worker_cap_is_available_memory_over_this_process(monkeypatch):
    """MemAvailable over VmRSS, at least 1; None where either figure is missing."""
    import oomkit.executors.forked as parallel

    figures = {"/proc/meminfo": 10 * 2**20, "/proc/self/status": 4 * 2**20}  # kiB: 10 and 4 GiB
    monkeypatch.setattr(parallel, "_proc_kib", lambda path, key: figures[path])
    assert parallel.memory_worker_cap() == 2
    figures["/proc/meminfo"] = 2**20  # 1 GiB available: still one process, this one
    assert parallel.memory_worker_cap() == 1
    figures["/proc/self/status"] = None  # type: ignore[assignment]
    assert parallel.memory_worker_cap() is None


def test_memory_worker_cap_reads_linux_figures(tmp_path):
    """The real figures, where Linux gives them; a file without the key reads as None."""
    import oomkit.executors.forked as parallel

    if not os.path.exists("/proc/meminfo"):
        pytest.skip("no /proc here")
    cap = parallel.memory_worker_cap()
    assert isinstance(cap, int) and cap >= 1
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmRSS:\t  123456 kB\n")
    assert parallel._proc_kib(str(status), "VmRSS:") == 123456
    assert parallel._proc_kib(str(status), "VmHWM:") is None
    assert parallel._proc_kib(str(tmp_path / "missing"), "VmRSS:") is None


def _tiny_snapshot():
    from oomkit.core.snapshot import snapshot_from_data

    MiB = 2**20
    base = 0x7F00_0000_0000
    trace = [
        {"action": "segment_alloc", "addr": base, "size": 20 * MiB, "stream": 0, "frames": []},
        {"action": "alloc", "addr": base, "size": 5 * MiB, "stream": 0, "frames": []},
        {"action": "free_requested", "addr": base, "size": 5 * MiB, "stream": 0, "frames": []},
        {"action": "free_completed", "addr": base, "size": 5 * MiB, "stream": 0, "frames": []},
    ]
    return snapshot_from_data({"segments": [], "device_traces": [trace]})


def test_replay_inputs_are_prepared_once_per_snapshot_and_dropped_with_it():
    """A second replay of the same snapshot object reuses its reconstructed start state (the
    same object), gives the same result as a fresh copy of the snapshot, and the cached inputs
    go when the snapshot does."""
    import gc

    from oomkit.core.replay import _prepared

    snapshot = _tiny_snapshot()
    config = AllocatorConfig.parse("expandable_segments:True")
    first = replay_snapshot(snapshot, 0, config=config)
    inputs = _prepared.prepared(snapshot, 0, None)
    second = replay_snapshot(snapshot, 0, config=config)
    assert _prepared.prepared(snapshot, 0, None) is inputs
    assert second == first == replay_snapshot(_tiny_snapshot(), 0, config=config)
    assert replay_snapshot(snapshot, 0, verify=True) == replay_snapshot(_tiny_snapshot(), 0, verify=True)
    key = id(snapshot)
    assert key in _prepared._CACHE
    del snapshot, inputs
    gc.collect()
    assert key not in _prepared._CACHE


def test_run_forked_returns_the_one_at_a_time_results_and_errors():
    """Closures (never pickled) run in 2 forked workers: results in task order, each from its
    own process; the first failing task in order raises its own error."""
    from oomkit.executors.forked import run_forked

    base = [10]  # reaches the workers through fork
    tasks = [lambda i=i: (base[0] + i, os.getpid()) for i in range(5)]
    serial = run_forked(tasks, jobs=1)
    forked = run_forked(tasks, jobs=2)
    assert [r for r, _ in serial] == [r for r, _ in forked] == [10, 11, 12, 13, 14]
    assert {pid for _, pid in serial} == {os.getpid()}
    assert os.getpid() not in {pid for _, pid in forked}

    def fails(message):
        raise ValueError(message)

    with pytest.raises(ValueError, match="first"):
        run_forked([lambda: 1, lambda: fails("first"), lambda: fails("second")], jobs=2)


# ForkedCall: one function in a forked process while the caller goes on.


def test_a_forked_call_returns_what_the_function_returned_in_another_process():
    """The function runs in a forked process (another pid), reaches it unpickled (a closure),
    and its result comes back pickled."""
    from oomkit.executors.forked import ForkedCall

    parent = os.getpid()
    seen = {"n": 3}
    call = ForkedCall(lambda: (os.getpid(), [seen["n"]] * 2))
    pid, value = call.result()
    assert pid != parent and value == [3, 3]


def test_a_background_forked_call_runs_at_the_lowest_priority():
    """background=True: the process runs at nice 19 (this one's priority is left as it was);
    a plain call keeps this process's priority."""
    from oomkit.executors.forked import ForkedCall

    mine = os.nice(0)
    assert ForkedCall(lambda: os.nice(0), background=True).result() == 19
    assert ForkedCall(lambda: os.nice(0)).result() == mine
    assert os.nice(0) == mine


def test_forked_processes_run_torch_kernels_after_the_caller_ran_parallel_ones():
    """Once this process ran a CPU kernel on several threads, GNU OpenMP keeps a thread pool
    that fork does not copy: a forked process's next parallel kernel waited forever for it
    (`oomkit fit llama-1b` waited 83 s for its confirming traces, then traced them again).
    Forked processes run torch's kernels on one thread, in a ForkedCall and in a pool."""
    torch = pytest.importorskip("torch")
    from oomkit.executors.forked import ForkedCall, run_forked

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.ones(64, 128, 128)
        x @ x  # a parallel region here: its pool of threads now exists in this process
        call = ForkedCall(lambda: (torch.get_num_threads(), float((x @ x).sum())))
        answer = call.result(timeout_s=60)
        # A pool's workers too (asked for their thread count only: a worker that hung in a
        # kernel would hang this test with no time limit).
        pooled = run_forked([torch.get_num_threads] * 2, jobs=2)
        assert torch.get_num_threads() == 2  # this process keeps its threads
    finally:
        torch.set_num_threads(before)
    # Every entry of x @ x is 128 (a row of 128 ones times a column of 128 ones).
    assert answer == (1, 64 * 128 * 128 * 128.0)
    assert pooled == [1, 1]


def _spin():
    while True:
        pass


def test_a_forked_calls_cpu_seconds_and_done():
    """cpu_seconds: what the process used (Linux's /proc), growing while it computes and not
    while it sleeps; done: whether result() would wait."""
    import time

    from oomkit.executors.forked import ForkedCall

    spinning, sleeping = ForkedCall(_spin), ForkedCall(lambda: time.sleep(30))
    try:
        if spinning.cpu_seconds() is None:
            pytest.skip("no /proc here: cpu_seconds is None off Linux")
        deadline = time.monotonic() + 20  # the tests' other workers may hold the cores
        while spinning.cpu_seconds() < 0.3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert spinning.cpu_seconds() >= 0.3
        assert sleeping.cpu_seconds() <= 0.1
        assert not spinning.done() and not sleeping.done(0.05)
    finally:
        spinning.cancel()
        sleeping.cancel()
    finished = ForkedCall(lambda: 5)
    assert finished.done(10)
    assert finished.result() == 5


def test_a_forked_call_that_raises_or_dies_is_a_forked_call_failed():
    """What the function raised comes back as text in ForkedCallFailed; a process that exits
    without an answer says so with its exit code."""
    from oomkit.executors.forked import ForkedCall, ForkedCallFailed

    def boom():
        raise KeyError("no such layer")

    with pytest.raises(ForkedCallFailed, match="KeyError: 'no such layer'"):
        ForkedCall(boom).result()
    with pytest.raises(ForkedCallFailed, match="exit code 7"):
        ForkedCall(lambda: os._exit(7)).result()


def test_a_forked_call_that_gives_no_answer_in_time_is_stopped():
    """A process still working at the timeout is killed and the wait ends there."""
    import time

    from oomkit.executors.forked import ForkedCall, ForkedCallFailed

    call = ForkedCall(lambda: time.sleep(30))
    start = time.monotonic()
    with pytest.raises(ForkedCallFailed, match="no answer within 0 s"):
        call.result(timeout_s=0.2)
    assert time.monotonic() - start < 5
    assert not call._process.is_alive()
    other = ForkedCall(lambda: time.sleep(30))
    other.cancel()
    assert other._process.exitcode is not None


def test_a_forked_process_writes_its_own_output_once_and_none_of_the_callers(capfd):
    """Text the caller had buffered is not written again by the process (flushed before the
    fork, and the process leaves by os._exit); the process's own prints come through."""
    import sys

    from oomkit.executors.forked import ForkedCall

    sys.stdout.write("caller before\n")
    ForkedCall(lambda: print("from the process")).result()
    sys.stdout.write("caller after\n")
    sys.stdout.flush()
    out = capfd.readouterr().out
    assert out.count("caller before") == 1 and out.count("caller after") == 1
    assert out.count("from the process") == 1


def test_run_forked_or_here_does_every_task_here_when_one_fails_in_a_worker():
    """A task that fails only in a forked worker: all tasks run again here, in order, with
    their one-at-a-time results; a task that fails here too raises its own error."""
    from oomkit.executors.forked import run_forked_or_here

    parent = os.getpid()
    ran_here = []

    def task(n, always=False):
        if os.getpid() == parent:
            ran_here.append(n)
        elif n == 2:
            raise RuntimeError("only in a worker")
        if always and n == 2:
            raise KeyError("here too")
        return n * 10

    tasks = [lambda n=n: task(n) for n in range(4)]
    assert run_forked_or_here(tasks, jobs=2) == [0, 10, 20, 30]
    assert ran_here == [0, 1, 2, 3]
    with pytest.raises(KeyError, match="here too"):
        run_forked_or_here([lambda n=n: task(n, always=True) for n in range(4)], jobs=2)


def _pool_with_a_stuck_task():
    """run_forked over 3 tasks of which the second waits forever in a worker (no CPU: a lock
    held at the fork); (results, tasks run here, progress calls, children left)."""
    import multiprocessing
    import threading

    import oomkit.executors.forked as parallel

    here = os.getpid()
    ran_here = []

    def task(n):
        if os.getpid() == here:
            ran_here.append(n)
        elif n == 1:
            threading.Event().wait()
        return n * 10

    calls = []
    results = parallel.run_forked([lambda n=n: task(n) for n in range(3)], jobs=2,
                                  progress=lambda done, total: calls.append((done, total)))
    return results, ran_here, calls, len(multiprocessing.active_children())


def _in_a_process_of_its_own(fn, timeout_s):
    """``fn()`` in a forked process that may start processes of its own (a ForkedCall's is a
    daemon: it may not); failed after ``timeout_s`` seconds without an answer."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=lambda: send.send(fn()), daemon=False)
    process.start()
    send.close()
    try:
        if not receive.poll(timeout_s):
            # Its own processes too: left behind, they would hold the test run's output open.
            children = Path(f"/proc/{process.pid}/task/{process.pid}/children")
            for pid in children.read_text().split() if children.exists() else ():
                os.kill(int(pid), 9)
            pytest.fail(f"no answer within {timeout_s} s")
        return receive.recv()
    finally:
        process.kill()
        process.join()


def test_a_stuck_pool_is_stopped_and_every_task_runs_here(monkeypatch):
    """Once the pool used no CPU for a look (0.5 s here), its processes are stopped and every
    task runs here, in order, with the one-at-a-time results; progress starts over. (Run in a
    forked process of its own with a time limit: without the check it would wait forever.)"""
    import time

    import oomkit.executors.forked as parallel

    if parallel._cpu_seconds(os.getpid()) is None:
        pytest.skip("no /proc here: a pool is waited for as it is")
    monkeypatch.setattr(parallel, "_POOL_LOOK_S", 0.5)
    start = time.monotonic()
    results, ran_here, calls, left = _in_a_process_of_its_own(_pool_with_a_stuck_task, 60)
    assert time.monotonic() - start < 30
    assert results == [0, 10, 20]
    assert ran_here == [0, 1, 2]
    assert calls[-4:] == [(0, 3), (1, 3), (2, 3), (3, 3)]
    assert left == 0  # the pool's processes were stopped


def test_a_pool_computing_longer_than_a_look_is_not_stuck(monkeypatch):
    """Tasks that compute for longer than a look finish in the pool, not here."""
    import oomkit.executors.forked as parallel

    if parallel._cpu_seconds(os.getpid()) is None:
        pytest.skip("no /proc here")
    monkeypatch.setattr(parallel, "_POOL_LOOK_S", 0.3)
    parent = os.getpid()

    def spin(n):
        import time

        end = time.monotonic() + 1.2
        while time.monotonic() < end:
            pass
        return (n, os.getpid() != parent)

    assert parallel.run_forked([lambda n=n: spin(n) for n in range(2)], jobs=2) == [(0, True), (1, True)]

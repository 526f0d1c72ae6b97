"""max_batch_size and smallest_gpu with jobs > 1: sizes traced ahead in forked processes give the
one-at-a-time search, decision for decision, and a failing process is never believed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from _steps import linear_step

import oomkit.plan.batch_prober as batch_prober
from oomkit.core.gpus import GpuSpec
from oomkit.core.target import Target
from oomkit.errors import AllocatorUsageError, UserCodeError
from oomkit.plan.batch_search import max_batch_size, smallest_gpu

torch = pytest.importorskip("torch")

MiB = 2**20


def _gpu(total_bytes, name="test GPU"):
    return GpuSpec(name=name, total_memory_bytes=total_bytes, context_overhead_bytes=0)


def _builder(log: Path, *, path_change_at=None, per_batch=1, in_child=None):
    """A step reserving (per_batch * b + 4) * 2 MiB (20 MiB more from ``path_change_at`` on);
    each build appends "pid batch" to ``log``. ``in_child(batch)`` runs when the build happens
    in another process than the test's (a size traced ahead)."""
    parent = os.getpid()

    def build(batch):
        with log.open("a") as out:
            out.write(f"{os.getpid()} {batch}\n")
        if in_child is not None and os.getpid() != parent:
            in_child(batch)
        return linear_step(batch, per_batch, path_change_at)

    return build


def _builds(log: Path) -> list[tuple[bool, int]]:
    """(built in the test's own process, batch) per build, in order of the log."""
    rows = [line.split() for line in log.read_text().splitlines()]
    return [(int(pid) == os.getpid(), int(batch)) for pid, batch in rows]


def _outcome(result):
    """Everything a search decided: answer, order, counts, every probe's fit and peaks."""
    curve = [
        (p.batch_size, p.fits, p.peak_reserved_bytes, p.peak_allocated_bytes, p.synthesized)
        for p in result.curve
    ]
    return (
        result.batch_size,
        result.first_failing_batch,
        result.probe_order,
        result.traces,
        result.synthesized,
        curve,
        result.warnings,
    )


def _wait_for_the_background(monkeypatch):
    """Wait as long as it takes for a size traced in the background: with the tests' other
    workers busy, a process at nice 19 may take longer than the least wait of a search, and
    look starved while they run."""
    monkeypatch.setattr(batch_prober, "_BACKGROUND_WAIT_MIN_S", 60.0)
    monkeypatch.setattr(batch_prober, "_STARVED_CPU_SHARE", 0.0)


def _ahead_needed(log: Path, background: int | None) -> list[int]:
    """The sizes built in another process, less ``background``: a size traced in the
    background that the search never asked for, which may be stopped before its build ran
    (at nice 19 on a busy machine). It was built at most once."""
    ahead = sorted(b for here, b in _builds(log) if not here)
    if background is not None:
        assert ahead.count(background) <= 1
        ahead = [b for b in ahead if b != background]
    return ahead


@pytest.mark.parametrize(
    ("options", "traced_ahead", "background", "unused"),
    [
        # Learned from 1 and 2 (2 ahead); 4, the first size synthesized, is traced in the
        # background and never asked for; 41, the last size bisection tries, fits by its
        # synthesis, so 42 goes ahead, and confirms the answer 41.
        ({}, [2, 42], 4, 1),
        # 2 MiB less usable: 41 does not fit by its synthesis, so 40 goes ahead: answer 40.
        ({"margin_mib": 12}, [2, 40], 4, 1),
        # The path changes at 30: 41's synthesis (the old path) fits, 42 goes ahead, but 41's
        # trace does not fit (unused 42); 40, traced to confirm, and the sizes between the two
        # paths of the second search are traced one at a time, the first of them (4) taken
        # from the background.
        ({"path_change_at": 30}, [2, 4, 42], None, 1),
        # Every size traced: the next doubling size ahead of each (128 unused: 64 does not
        # fit); nothing is synthesized, so nothing goes to the background.
        ({"interpolate": False}, [2, 8, 32, 128], None, 1),
    ],
)
def test_a_search_with_jobs_is_the_one_at_a_time_search(
    tmp_path, monkeypatch, options, traced_ahead, background, unused
):
    """With jobs=2 the answer, the sizes tried in order, the traces and syntheses and every
    probe's peaks equal jobs=1's, and the sizes named were built in another process."""
    _wait_for_the_background(monkeypatch)
    options = dict(options)
    interpolate = options.pop("interpolate", True)
    margin = options.pop("margin_mib", 10) * MiB
    kwargs = dict(
        target=Target.resolve(_gpu(100 * MiB)), margin_bytes=margin, interpolate=interpolate
    )
    serial_log, parallel_log = tmp_path / "serial", tmp_path / "parallel"
    serial = max_batch_size(_builder(serial_log, **options), jobs=1, **kwargs)
    parallel = max_batch_size(_builder(parallel_log, **options), jobs=2, **kwargs)
    assert _outcome(parallel) == _outcome(serial)
    assert (serial.unused_ahead, parallel.unused_ahead) == (0, unused)
    assert all(here for here, _ in _builds(serial_log))
    assert _ahead_needed(parallel_log, background) == traced_ahead
    # Every size built one at a time was built once with jobs=2 too, here or ahead.
    built = sorted(b for here, b in _builds(parallel_log) if here) + traced_ahead
    assert len(built) == len(_builds(serial_log)) + unused - (background is not None)
    assert set(built) >= {b for _, b in _builds(serial_log)}


@pytest.mark.parametrize(
    ("options", "traced_ahead", "background", "unused"),
    [
        # No difference: 4 (the background) and 40 (the side of 41 its synthesis did not
        # point to) are never asked for.
        ({}, [2, 40, 42], 4, 2),
        # The path changes at 30: 41's trace does not fit, so 40 is asked for and 42 is not;
        # the second search traces 4 first and takes it from the background.
        ({"path_change_at": 30}, [2, 4, 40, 42], None, 1),
    ],
)
def test_with_jobs_3_both_sides_of_the_last_size_go_ahead(
    tmp_path, monkeypatch, options, traced_ahead, background, unused
):
    """With jobs=3 both sizes beside the last one bisection tries are traced ahead beside it,
    and the background process beside them: the search is still the one-at-a-time one."""
    _wait_for_the_background(monkeypatch)
    kwargs = dict(target=Target.resolve(_gpu(100 * MiB)), margin_bytes=10 * MiB)
    serial_log, parallel_log = tmp_path / "serial", tmp_path / "parallel"
    serial = max_batch_size(_builder(serial_log, **options), jobs=1, **kwargs)
    parallel = max_batch_size(_builder(parallel_log, **options), jobs=3, **kwargs)
    assert _outcome(parallel) == _outcome(serial)
    assert parallel.unused_ahead == unused
    assert _ahead_needed(parallel_log, background) == traced_ahead
    if options:
        # The second search's first trace: built once, in the process ahead.
        assert [b for here, b in _builds(parallel_log) if b == 4] == [4]
        assert (False, 4) in _builds(parallel_log) and 4 in [b for _, b in _builds(serial_log)]


def test_the_first_synthesized_size_is_traced_at_the_lowest_priority(tmp_path, monkeypatch):
    """The size a second search traces first goes to a process at nice 19, outside the jobs;
    the sizes the search asks for next keep this process's priority (the path changes at 30,
    so the second search asks for 4, and its build always runs)."""
    _wait_for_the_background(monkeypatch)
    nice_log = tmp_path / "nice"
    mine = str(os.nice(0))

    def note_priority(batch):
        with nice_log.open("a") as out:
            out.write(f"{batch} {os.nice(0)}\n")

    builder = _builder(tmp_path / "log", path_change_at=30, in_child=note_priority)
    result = max_batch_size(
        builder, target=Target.resolve(_gpu(100 * MiB)), margin_bytes=10 * MiB, jobs=2
    )
    assert (result.batch_size, result.unused_ahead) == (31, 1)
    priorities = dict(line.split() for line in nice_log.read_text().splitlines())
    assert (priorities["2"], priorities["4"]) == (mine, "19")
    assert priorities.get("42", mine) == mine  # unused: stopped, perhaps before it built


def test_a_size_the_background_does_not_give_in_time_is_traced_here(tmp_path):
    """The background process for 4 hangs (as one a busy machine never runs): the second search
    gives up on it (it uses no CPU), traces 4 here, and answers as one at a time."""
    import time

    def hang_at_4(batch):
        if batch == 4:
            time.sleep(60)

    kwargs = dict(target=Target.resolve(_gpu(100 * MiB)), margin_bytes=10 * MiB)
    serial = max_batch_size(_builder(tmp_path / "serial", path_change_at=30), **kwargs)
    log = tmp_path / "parallel"
    start = time.monotonic()
    builder = _builder(log, path_change_at=30, in_child=hang_at_4)
    parallel = max_batch_size(builder, jobs=2, **kwargs)
    assert time.monotonic() - start < 30
    assert _outcome(parallel) == _outcome(serial)
    # Built here; in the background too, unless it was stopped before its build began.
    assert (True, 4) in _builds(log) and _builds(log).count((False, 4)) <= 1


def test_a_size_in_the_background_is_traced_again_at_full_priority_when_needed(tmp_path):
    """12 MiB a batch: 1 and 2 are learned from, 4 (synthesized: it does not fit) goes to the
    background, and bisection's last size, 3, needs 4 beside it: 4 is traced again at this
    process's priority (the background one stopped, unused), and confirms the answer 3."""
    nice_log = tmp_path / "nice"
    mine = str(os.nice(0))

    def note_priority(batch):
        with nice_log.open("a") as out:
            out.write(f"{batch} {os.nice(0)}\n")

    kwargs = dict(target=Target.resolve(_gpu(100 * MiB)), margin_bytes=10 * MiB)
    serial = max_batch_size(_builder(tmp_path / "serial", per_batch=12), **kwargs)
    log = tmp_path / "parallel"
    builder = _builder(log, per_batch=12, in_child=note_priority)
    parallel = max_batch_size(builder, jobs=2, **kwargs)
    assert _outcome(parallel) == _outcome(serial)
    assert (parallel.batch_size, parallel.probe_order, parallel.unused_ahead) == (3, (1, 2, 4, 3), 1)
    at_4 = [nice for batch, nice in map(str.split, nice_log.read_text().splitlines()) if batch == "4"]
    assert mine in at_4 and set(at_4) <= {mine, "19"}
    assert [b for here, b in _builds(log) if here] == [1, 3]


def _spin_then(value, seconds):
    import time

    end = time.process_time() + seconds
    while time.process_time() < end:
        pass
    return value


def test_a_background_process_is_waited_for_unless_it_is_starved(monkeypatch):
    """A size in the background is waited for while it computes (up to as long as a trace
    here takes, at least 1 s), and given up on at once when it gets no CPU (here: it sleeps,
    as a nice-19 process on a machine whose cores are all busy). The share of a core that
    counts as computing is lowered to 5%: the tests' other workers may hold the cores."""
    import time

    monkeypatch.setattr(batch_prober, "_STARVED_CPU_SHARE", 0.05)

    from oomkit.executors.forked import ForkedCall
    from oomkit.plan.batch_prober import _background_result

    if ForkedCall(lambda: None).cpu_seconds() is None:
        pytest.skip("no /proc here: the plain wait is the only one")
    # (A trace here took 10 s: the wait allows for the tests' other workers on the cores.)
    assert _background_result(ForkedCall(lambda: _spin_then("traced", 0.4)), 10.0) == "traced"
    starved = ForkedCall(lambda: time.sleep(30))
    start = time.monotonic()
    assert _background_result(starved, 20.0) is None
    assert time.monotonic() - start < 5
    # Computing, but for longer than the wait: given up on at the deadline.
    start = time.monotonic()
    assert _background_result(ForkedCall(lambda: _spin_then("late", 30)), 0.0) is None
    assert 0.9 < time.monotonic() - start < 10
    done = ForkedCall(lambda: "done")
    assert done.done(10) and _background_result(done, 0.0) == "done"


def test_an_eval_step_is_recorded_here_after_a_training_step_traced_ahead(tmp_path):
    """Train traced ahead, eval after it here: the same search as one at a time (eval caps
    the batch at 15)."""
    kwargs = dict(target=Target.resolve(_gpu(100 * MiB)), margin_bytes=0)
    serial = max_batch_size(
        _builder(tmp_path / "a"), eval_step=_builder(tmp_path / "b", per_batch=3), **kwargs
    )
    parallel = max_batch_size(
        _builder(tmp_path / "c"), eval_step=_builder(tmp_path / "d", per_batch=3), jobs=2, **kwargs
    )
    assert _outcome(parallel) == _outcome(serial)
    assert (parallel.batch_size, parallel.limiting_step) == (15, "eval")
    assert any(not here for here, _ in _builds(tmp_path / "c"))
    assert all(here for here, _ in _builds(tmp_path / "d"))


def _raise(batch):
    raise RuntimeError(f"only in the process ahead, batch {batch}")


def _exit(batch):
    os._exit(3)


def _stuck(batch):
    """Wait forever using no CPU, as a process deadlocked on a lock it inherited held."""
    import threading

    threading.Event().wait()


@pytest.mark.parametrize("in_child", [_raise, _exit, _stuck], ids=["raises", "dies", "stuck"])
def test_a_size_whose_process_fails_is_traced_here(tmp_path, in_child, monkeypatch):
    """A process ahead that raised, died or is stuck is not believed: its size is traced here,
    and the search is the one-at-a-time one. A stuck one is given up on once it used no CPU
    over a look (0.5 s here, 2 s in a search), not at the 60 s time limit."""
    import time

    monkeypatch.setattr(batch_prober, "_STUCK_LOOK_S", 0.5)
    kwargs = dict(target=Target.resolve(_gpu(100 * MiB)), margin_bytes=10 * MiB)
    serial = max_batch_size(_builder(tmp_path / "serial"), **kwargs)
    log = tmp_path / "parallel"
    start = time.monotonic()
    parallel = max_batch_size(_builder(log, in_child=in_child), jobs=2, **kwargs)
    assert time.monotonic() - start < 30
    assert _outcome(parallel) == _outcome(serial)
    built_here = [b for here, b in _builds(log) if here]
    assert built_here == [1, 2, 41, 42]  # every traced size, as one at a time


def test_a_process_ahead_is_waited_for_while_it_computes_and_not_once_it_is_stuck():
    """ForkedCall.result_unless_stalled (a size traced ahead is waited for by it): a process
    using CPU is waited for past a look; one using none over a look is
    stopped and gives None; one that outlives the wait is stopped at the deadline."""
    import time

    from oomkit.executors.forked import ForkedCall
    if ForkedCall(lambda: None).cpu_seconds() is None:
        pytest.skip("no /proc here: the plain wait is the only one")
    # The CPU the spinning processes burn is the test's cost: a look of 0.2 s (4 ms of CPU
    # counts as computing, what a process gets on however busy a machine), a spin of three
    # looks, a wait of two.
    look_s = 0.2
    wait = dict(wait_s=60.0, look_s=look_s, min_cpu_share=0.02)
    spin_s = 3 * look_s
    assert ForkedCall(lambda: _spin_then("traced", spin_s)).result_unless_stalled(**wait) == "traced"
    stuck = ForkedCall(lambda: _stuck(0))
    start = time.monotonic()
    assert stuck.result_unless_stalled(**wait) is None
    assert time.monotonic() - start < 10
    stuck._process.join(10)
    assert stuck._process.exitcode == -9  # stopped (SIGKILL)
    start = time.monotonic()
    late = ForkedCall(lambda: _spin_then("late", 30))
    late_wait_s = 2 * look_s
    assert late.result_unless_stalled(**{**wait, "wait_s": late_wait_s}) is None
    assert late_wait_s - 0.1 < time.monotonic() - start < 10


def test_a_builder_error_is_raised_as_one_at_a_time(tmp_path):
    """A builder that returns no step at batch 2: jobs=2 raises jobs=1's UserCodeError."""

    def build(batch):
        return 42 if batch == 2 else _builder(tmp_path / "log")(batch)

    errors = []
    for jobs in (1, 2):
        with pytest.raises(UserCodeError) as caught:
            max_batch_size(
                build, target=Target.resolve(_gpu(100 * MiB)), margin_bytes=10 * MiB, jobs=jobs
            )
        errors.append(str(caught.value))
    assert errors[0] == errors[1] and "returned int for batch 2" in errors[0]


def test_bad_jobs_are_refused():
    for bad in (0, -2, 1.5, True):
        with pytest.raises(AllocatorUsageError, match="jobs must be a positive int"):
            max_batch_size(
                _builder(Path(os.devnull)), target=Target.resolve(_gpu(100 * MiB)), jobs=bad
            )


def test_smallest_gpu_traces_each_compute_capability_in_its_own_process(tmp_path):
    """Three GPUs of two capabilities: two traces, made in forked processes with jobs=2, and
    the same fits and headroom as one at a time; a failing process is done again here."""
    candidates = [
        GpuSpec(name=n, total_memory_bytes=t * MiB, context_overhead_bytes=0, compute_capability=cc)
        for n, t, cc in (("small", 40, (8, 0)), ("mid", 60, (9, 0)), ("big", 90, (8, 0)))
    ]
    kwargs = dict(candidates=candidates, margin_bytes=4 * MiB)
    serial = smallest_gpu(_builder(tmp_path / "serial"), 16, **kwargs)
    parallel = smallest_gpu(_builder(tmp_path / "parallel"), 16, jobs=2, **kwargs)
    assert parallel == serial
    assert (serial.smallest.name, serial.traces) == ("mid", 2)
    assert [here for here, _ in _builds(tmp_path / "parallel")] == [False, False]
    failing = smallest_gpu(_builder(tmp_path / "failing", in_child=_raise), 16, jobs=2, **kwargs)
    assert failing == serial
    assert [here for here, _ in _builds(tmp_path / "failing")][-2:] == [True, True]

"""One trial of ``oomkit experiment``: the user's script run in a child Python under one setting.

``run_trial`` (and the experiment's scheduler, through ``start_trial`` / ``finish_trial``) starts
the script through ``_experiment_bootstrap.py`` with ``PYTORCH_CUDA_ALLOC_CONF`` set, in a process
group of its own that is killed as one on timeout, and reads what it left: the bootstrap's result
file (completed, finished, oom) and the monitor's JSONL log, summarised by ``summarize_log``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from oomkit.errors import MonitorLogError, OomkitError
from oomkit.runtime._monitor_log import StepRecord, read_monitor_log, summarize

__all__ = [
    "ALLOC_CONF_ENVS",
    "VISIBLE_ENV",
    "Running",
    "Trial",
    "TrialStatus",
    "finish_trial",
    "kill_group",
    "run_trial",
    "start_trial",
    "summarize_log",
]

TrialStatus = Literal["completed", "finished", "oom", "crashed", "timeout", "invalid"]

# Variables PyTorch reads the allocator setting from (newer releases read PYTORCH_ALLOC_CONF
# first, c10/core/AllocatorConfig.cpp); a candidate trial sets the CUDA one and drops the other.
ALLOC_CONF_ENVS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
_KILL_GRACE_S = 2.0
# The variable a child's CUDA runtime reads to choose its devices (CUDA C Programming Guide,
# "CUDA Environment Variables"); each parallel trial sees only its own GPU, as device 0.
VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"


@dataclass(frozen=True)
class Trial:
    """One setting's run of the script.

    Attributes:
        alloc_conf: the ``PYTORCH_CUDA_ALLOC_CONF`` value; ``""`` is PyTorch's default.
        baseline: this is the caller's own setting, the reference for the others.
        status: ``completed`` (stopped after the requested steps), ``finished`` (the script
            ended before them), ``oom``, ``crashed`` (another exception, an exit code or a
            signal), ``timeout`` (killed), ``invalid`` (PyTorch would reject the setting; not
            run).
        steps: optimizer steps the monitor recorded.
        peak_reserved_bytes: the highest reserved memory over the recorded steps.
        peak_allocated_bytes: the highest allocated memory over the recorded steps.
        max_inactive_split_bytes: the most memory held in free pieces of split blocks.
        fragmentation: the largest share, over the steps, of reserved-but-unallocated memory
            that sat in split blocks (``inactive_split / (reserved - allocated)``), 0..1.
        steps_per_s: throughput over the steps after the first (None with fewer than 2).
        alloc_retries: mallocs that freed the cache and retried (cumulative at the last step).
        device_allocs: cudaMalloc calls (cumulative at the last step).
        oom_step: the step that ran out of memory, counted from 1 (status ``oom``): the one
            after the last completed optimizer step.
        exit_code: the child's exit code (negative: killed by that signal); None if not run.
        error: why it did not complete: the last line the script wrote on stderr, the
            setting's error, or the timeout.
        duration_s: wall time of the child, seconds.
        gpu: the ``CUDA_VISIBLE_DEVICES`` value the child ran with (one GPU: an index or a
            UUID); None when the caller's environment was left as it was.
        device_name: the name of the GPU the script used (``torch.cuda.get_device_name``);
            None when it did not initialise CUDA or did not get as far as writing its result.
    """

    alloc_conf: str
    baseline: bool
    status: TrialStatus
    steps: int = 0
    peak_reserved_bytes: int | None = None
    peak_allocated_bytes: int | None = None
    max_inactive_split_bytes: int | None = None
    fragmentation: float | None = None
    steps_per_s: float | None = None
    alloc_retries: int | None = None
    device_allocs: int | None = None
    oom_step: int | None = None
    exit_code: int | None = None
    error: str | None = None
    duration_s: float = 0.0
    gpu: str | None = None
    device_name: str | None = None

    @property
    def ok(self) -> bool:
        """The script ran to the requested steps or to its end."""
        return self.status in ("completed", "finished")

    def to_json(self) -> dict[str, Any]:
        """The trial as a JSON-ready dict (the ``--json`` trial object)."""
        return {
            "alloc_conf": self.alloc_conf,
            "baseline": self.baseline,
            "status": self.status,
            "steps": self.steps,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "max_inactive_split_bytes": self.max_inactive_split_bytes,
            "fragmentation": self.fragmentation,
            "steps_per_s": self.steps_per_s,
            "alloc_retries": self.alloc_retries,
            "device_allocs": self.device_allocs,
            "oom_step": self.oom_step,
            "exit_code": self.exit_code,
            "error": self.error,
            "duration_s": round(self.duration_s, 3),
            "gpu": self.gpu,
            "device_name": self.device_name,
        }



def _last_line(path: Path) -> str | None:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else None


def _read_log(path: Path) -> list[StepRecord]:
    """The step records of a trial's monitor log; none when the child died before writing one."""
    try:
        return read_monitor_log(path)[1]
    except (OSError, MonitorLogError):
        return []


def summarize_log(records: Sequence[StepRecord]) -> dict[str, Any]:
    """Peak reserved, fragmentation and throughput of a trial from its monitor records.

    Args:
        records: the trial's step records, in step order.

    Returns:
        The ``Trial`` fields ``steps``, ``peak_reserved_bytes``, ``peak_allocated_bytes``,
        ``max_inactive_split_bytes``, ``fragmentation``, ``steps_per_s``, ``alloc_retries``
        and ``device_allocs`` (only ``steps`` without records).
    """
    if not records:
        return {"steps": 0}
    summary = summarize({}, records)
    fragmentation = 0.0
    for r in records:
        # Free memory the allocator cannot hand back because it sits inside split blocks.
        unallocated = r.reserved_bytes - r.allocated_bytes
        if unallocated > 0:
            fragmentation = max(fragmentation, r.inactive_split_bytes / unallocated)
    # records[0].step_time_s is None: the first step (warm-up: lazy init, cache growth) is left
    # out of the throughput.
    times = [r.step_time_s for r in records[1:] if r.step_time_s is not None]
    total = sum(times)
    return {
        "steps": summary.steps,
        "peak_reserved_bytes": summary.peak_reserved_bytes,
        "peak_allocated_bytes": summary.peak_allocated_bytes,
        "max_inactive_split_bytes": summary.max_inactive_split_bytes,
        "fragmentation": min(fragmentation, 1.0),
        "steps_per_s": len(times) / total if times and total > 0 else None,
        "alloc_retries": summary.num_alloc_retries,
        "device_allocs": records[-1].num_device_alloc,
    }


def _bootstrap_file() -> str:
    from oomkit.runtime import _experiment_bootstrap

    return os.path.abspath(_experiment_bootstrap.__file__)


def _oomkit_root() -> str:
    import oomkit

    return str(Path(oomkit.__file__).resolve().parent.parent)


def kill_group(proc: subprocess.Popen) -> None:
    """Kill the child and everything it started (its own session, see ``start_new_session``)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=_KILL_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            continue


def _trial_env(
    environ: Mapping[str, str], alloc_conf: str, baseline: bool, gpu: str | None = None
) -> dict[str, str]:
    env = dict(environ)
    if not baseline:
        for name in ALLOC_CONF_ENVS:
            env.pop(name, None)
        env["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
    if gpu is not None:
        env[VISIBLE_ENV] = gpu
    return env


@dataclass
class Running:
    """A started trial: its child, its files and when it must be killed (mutable, private)."""

    proc: subprocess.Popen
    alloc_conf: str
    baseline: bool
    timeout_s: float
    gpu: str | None
    result_path: Path
    log_path: Path
    stderr_path: Path
    started: float  # get_time() at the start, for duration_s
    deadline: float  # time.monotonic() after which the trial is killed


def start_trial(
    python: str,
    target: Sequence[str],
    alloc_conf: str,
    *,
    interpreter_options: Sequence[str],
    steps: int,
    timeout_s: float,
    baseline: bool,
    environ: Mapping[str, str],
    workdir: Path,
    get_time: Callable[[], float],
    gpu: str | None,
) -> Running:
    """Write the trial's config and start its child in a session of its own."""
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / "config.json"
    result_path = workdir / "result.json"
    log_path = workdir / "monitor.jsonl"
    stderr_path = workdir / "stderr.txt"
    config_path.write_text(
        json.dumps(
            {
                "steps": steps,
                "log_path": str(log_path),
                "result_path": str(result_path),
                "oomkit_root": _oomkit_root(),
            }
        )
    )
    # Interpreter options stay before the bootstrap file; the target follows its config.
    cmd = [python, *interpreter_options, _bootstrap_file(), str(config_path), *target]
    env = _trial_env(environ, alloc_conf, baseline, gpu)
    started = get_time()
    # The child holds its own copies of the descriptors; ours are closed when Popen returns.
    with open(workdir / "stdout.txt", "wb") as out, open(stderr_path, "wb") as err:
        try:
            proc = subprocess.Popen(
                cmd,
                env=env,
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a process group of its own, killed as one on timeout
            )
        except OSError as exc:
            raise OomkitError(f"could not start `{python}`: {exc.strerror or exc}") from exc
    return Running(
        proc=proc,
        alloc_conf=alloc_conf,
        baseline=baseline,
        timeout_s=timeout_s,
        gpu=gpu,
        result_path=result_path,
        log_path=log_path,
        stderr_path=stderr_path,
        started=started,
        deadline=time.monotonic() + timeout_s,
    )


def finish_trial(run: Running, *, timed_out: bool, get_time: Callable[[], float]) -> Trial:
    """The trial of a child that has exited (or was killed): its result file and monitor log."""
    duration = get_time() - run.started
    returncode = run.proc.returncode
    result: dict[str, Any] | None = None
    if run.result_path.is_file():
        result = json.loads(run.result_path.read_text())
    measured = summarize_log(_read_log(run.log_path))
    status: TrialStatus
    error: str | None = None
    oom_step: int | None = None
    if timed_out:
        status = "timeout"
        error = f"no result after {run.timeout_s:g} s; the process group was killed"
    elif result is not None and result["outcome"] in ("completed", "finished"):
        status = result["outcome"]
    elif result is not None and result["outcome"] == "oom":
        status = "oom"
        oom_step = result["steps"] + 1  # the step after the last completed one, from 1
        error = result["message"]
    else:
        status = "crashed"
        error = _last_line(run.stderr_path) or (
            f"killed by signal {-returncode}"
            if returncode is not None and returncode < 0
            else f"exit code {returncode}"
        )
    return Trial(
        alloc_conf=run.alloc_conf,
        baseline=run.baseline,
        status=status,
        oom_step=oom_step,
        exit_code=returncode,
        error=error,
        duration_s=duration,
        gpu=run.gpu,
        device_name=None if result is None else result.get("device_name"),
        **measured,
    )


def run_trial(
    python: str,
    target: Sequence[str],
    alloc_conf: str,
    *,
    interpreter_options: Sequence[str] = (),
    steps: int,
    timeout_s: float,
    baseline: bool = False,
    environ: Mapping[str, str] | None = None,
    workdir: str | Path | None = None,
    get_time: Callable[[], float] = time.monotonic,
    gpu: str | None = None,
) -> Trial:
    """Run the script once with ``alloc_conf`` and measure it.

    Args:
        python: the interpreter to run.
        target: ``[script, *args]`` or ``["-m", module, *args]``.
        alloc_conf: the ``PYTORCH_CUDA_ALLOC_CONF`` value to run with (for the baseline: its
            label; the environment is passed unchanged).
        steps: stop the script after this many optimizer steps.
        timeout_s: kill the script (and its process group) after this many seconds.
        interpreter_options: options for ``python`` before the script (``-X dev``).
        baseline: run with ``environ`` as it is.
        environ: the child's environment; None is this process's.
        workdir: where the trial's files (log, result, output) go; None is a temporary folder.
        get_time: clock for ``duration_s``.
        gpu: the child's ``CUDA_VISIBLE_DEVICES`` (its one GPU); None leaves it as in
            ``environ``.

    Returns:
        The trial; never raises for what the script does.

    Raises:
        OomkitError: the interpreter could not be started.
    """
    with contextlib.ExitStack() as stack:
        if workdir is None:  # the files live as long as the trial runs and is read
            workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="oomkit-experiment-"))
        run = start_trial(
            python,
            target,
            alloc_conf,
            interpreter_options=interpreter_options,
            steps=steps,
            timeout_s=timeout_s,
            baseline=baseline,
            environ=os.environ if environ is None else environ,
            workdir=Path(workdir),
            get_time=get_time,
            gpu=gpu,
        )
        timed_out = False
        try:
            run.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            kill_group(run.proc)
        except BaseException:
            kill_group(run.proc)
            raise
        return finish_trial(run, timed_out=timed_out, get_time=get_time)

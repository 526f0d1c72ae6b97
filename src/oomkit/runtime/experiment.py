"""Live experiments with allocator settings: run the user's script once per ``PYTORCH_CUDA_ALLOC_CONF``.

``run_experiment`` launches the script (unmodified) in a child Python per setting through
``_experiment_bootstrap.py``, which runs it under ``Monitor(auto_step=True)`` and stops it after
``steps`` optimizer steps. Each trial's JSONL log gives its peak reserved memory, its
fragmentation and its throughput; a trial that runs out of memory, crashes or hangs (killed with
its process group after ``timeout_s``) is recorded as such and the experiment goes on. The
baseline (the setting in the caller's environment, PyTorch's default when unset) is the first
trial. With several GPUs (``gpus``, by default every visible one) the trials run in parallel, at
most one per GPU, each child with ``CUDA_VISIBLE_DEVICES`` set to its GPU; the baseline starts in
the first wave with the candidates (see :func:`run_experiment`).
``recommend`` picks the setting with the lowest peak reserved among the trials that completed
without being more than ``max_slowdown`` slower than the baseline.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from oomkit.core.allocator import AllocatorConfig
from oomkit.errors import ConfigError, MonitorLogError, OomkitError
from oomkit.runtime.monitor import StepRecord, read_monitor_log, summarize

__all__ = [
    "DEFAULT_CONFIGS",
    "DEFAULT_MAX_SLOWDOWN",
    "ExperimentResult",
    "Trial",
    "TrialStatus",
    "parse_configs",
    "recommend",
    "run_experiment",
    "run_trial",
    "summarize_log",
    "visible_gpus",
]

TrialStatus = Literal["completed", "finished", "oom", "crashed", "timeout", "invalid"]

# What to try when the caller names no settings: the three knobs that change how the caching
# allocator splits and caches blocks (c10/cuda/CUDAAllocatorConfig.h).
DEFAULT_CONFIGS: tuple[str, ...] = (
    "expandable_segments:True",
    "max_split_size_mb:128",
    "roundup_power2_divisions:4",
)
# A setting that saves memory is not recommended when it costs more than this share of steps/s.
DEFAULT_MAX_SLOWDOWN = 0.05
# Variables PyTorch reads the allocator setting from (newer releases read PYTORCH_ALLOC_CONF
# first, c10/core/AllocatorConfig.cpp); a candidate trial sets the CUDA one and drops the other.
_ALLOC_CONF_ENVS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
_KILL_GRACE_S = 2.0
# How often the scheduler looks at the running trials (exit, timeout).
_POLL_S = 0.05
# The variable a child's CUDA runtime reads to choose its devices (CUDA C Programming Guide,
# "CUDA Environment Variables"); each parallel trial sees only its own GPU, as device 0.
_VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"


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
        oom_step: the 0-based step that ran out of memory (status ``oom``).
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


@dataclass(frozen=True)
class ExperimentResult:
    """Every trial (the baseline first) and the recommendation.

    Attributes:
        trials: one per setting, in the order run; settings PyTorch rejects are ``invalid``.
        recommended: the trial to adopt, or None when no trial completed.
        reason: why, in one sentence.
        steps: the optimizer steps each trial was run for.
        max_slowdown: the throughput loss (share of the baseline's steps/s) a recommendation
            may cost.
        warnings: what the numbers do not cover.
        gpus: the GPUs the trials were spread over (``CUDA_VISIBLE_DEVICES`` values), one trial
            per GPU at a time; empty when they ran one after another on the caller's devices.
    """

    trials: tuple[Trial, ...]
    recommended: Trial | None
    reason: str
    steps: int
    max_slowdown: float = DEFAULT_MAX_SLOWDOWN
    warnings: tuple[str, ...] = field(default_factory=tuple)
    gpus: tuple[str, ...] = ()

    @property
    def baseline(self) -> Trial:
        """The caller's own setting."""
        return self.trials[0]


def parse_configs(text: str) -> list[str]:
    """The settings in a configs file: one per line, ``#`` starts a comment, blank lines skipped.

    ``default`` or ``""`` on a line stands for PyTorch's default (the empty setting).
    """
    configs: list[str] = []
    for line in text.splitlines():
        value = line.split("#", 1)[0].strip()
        if not value:
            continue
        if value in ("default", '""', "''"):
            value = ""
        configs.append(value)
    return configs


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


def _kill_group(proc: subprocess.Popen) -> None:
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
        for name in _ALLOC_CONF_ENVS:
            env.pop(name, None)
        env["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
    if gpu is not None:
        env[_VISIBLE_ENV] = gpu
    return env


def _parse_visible_devices(value: str) -> tuple[str, ...]:
    """The devices a ``CUDA_VISIBLE_DEVICES`` value makes visible, as the CUDA runtime reads it.

    Mirrors ``torch.cuda._parse_visible_devices``: a list of ``GPU-``/``MIG-`` UUIDs keeps the
    entries up to the first without the prefix; otherwise each entry counts for the number it
    starts with (``strtoul``), a negative or non-numeric entry ends the list, and a repeated
    device makes the list empty.
    """
    entries = [entry.strip() for entry in value.split(",")]
    devices: list[str] = []
    for prefix in ("GPU-", "MIG-"):
        if value.strip().startswith(prefix):
            for entry in entries:
                if entry in devices:
                    return ()
                if not entry.startswith(prefix):
                    break
                devices.append(entry)
            return tuple(devices)
    for entry in entries:
        digits = entry[1:] if entry[:1] == "+" else entry
        count = len(digits) - len(digits.lstrip("0123456789"))
        if count == 0:  # empty, negative or not a number: the list ends here
            break
        ordinal = str(int(digits[:count]))
        if ordinal in devices:
            return ()
        devices.append(ordinal)
    return tuple(devices)


def _torch_device_count() -> int:
    """``torch.cuda.device_count()``; 0 without torch or without a CUDA build.

    Before CUDA is initialised it asks NVML (``_device_count_nvml``: libnvidia-ml through
    ctypes, no CUDA context) and only when NVML fails falls back to ``cudaGetDeviceCount``
    (torch/cuda/__init__.py, ``device_count``), which initialises the driver but creates no
    context and allocates no device memory; the trials are new processes (``exec``), so this
    parent's driver state is not theirs.
    """
    try:
        import torch
    except ImportError:
        return 0
    try:
        return int(torch.cuda.device_count())
    except Exception:  # noqa: BLE001 - a broken driver means no GPU to spread trials over
        return 0


def visible_gpus(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The GPUs trials may be spread over, without creating a CUDA context in this process.

    Args:
        environ: the environment the trials start from; None is this process's.

    Returns:
        ``CUDA_VISIBLE_DEVICES`` values, one per GPU: the entries of ``CUDA_VISIBLE_DEVICES``
        when it is set (indices or UUIDs, as the CUDA runtime reads them); else ``"0"`` to
        ``"n-1"`` for the n GPUs ``torch.cuda.device_count()`` finds (through NVML when it
        can); empty without a GPU or without torch.
    """
    env = os.environ if environ is None else environ
    if _VISIBLE_ENV in env:
        return _parse_visible_devices(env[_VISIBLE_ENV])
    return tuple(str(i) for i in range(_torch_device_count()))


@dataclass
class _Running:
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


def _start_trial(
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
) -> _Running:
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
    return _Running(
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


def _finish_trial(run: _Running, *, timed_out: bool, get_time: Callable[[], float]) -> Trial:
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
        oom_step = result["steps"]
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
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="oomkit-experiment-") as tmp:
            return run_trial(
                python,
                target,
                alloc_conf,
                interpreter_options=interpreter_options,
                steps=steps,
                timeout_s=timeout_s,
                baseline=baseline,
                environ=environ,
                workdir=tmp,
                get_time=get_time,
                gpu=gpu,
            )
    run = _start_trial(
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
        _kill_group(run.proc)
    except BaseException:
        _kill_group(run.proc)
        raise
    return _finish_trial(run, timed_out=timed_out, get_time=get_time)


def recommend(
    trials: Sequence[Trial], max_slowdown: float = DEFAULT_MAX_SLOWDOWN
) -> tuple[Trial | None, str]:
    """The setting to adopt: the lowest peak reserved that is not much slower than the baseline.

    Args:
        trials: the trials, the baseline first.
        max_slowdown: the share of the baseline's steps/s a setting may lose (0.05 = 5%).

    Returns:
        ``(trial, reason)``; the trial is the baseline when nothing beats it, None when no trial
        completed.
    """
    done = [t for t in trials if t.ok and t.peak_reserved_bytes is not None]
    if not done:
        return None, "no trial completed; see the errors above"
    base = trials[0]
    base_ok = base.ok and base.peak_reserved_bytes is not None
    slower: list[Trial] = []
    if base_ok and base.steps_per_s is not None:
        floor = base.steps_per_s * (1.0 - max_slowdown)
        eligible = []
        for t in done:
            if t.steps_per_s is not None and t.steps_per_s < floor:
                slower.append(t)
            else:
                eligible.append(t)
    else:
        eligible = done
    best = min(eligible, key=lambda t: t.peak_reserved_bytes or 0)  # ties: the earlier trial
    label = _label(best)
    if not base_ok:
        return best, (
            f"the baseline {_status_words(base)}; {label} completed {best.steps} steps with the "
            "lowest peak reserved memory of the trials that did"
        )
    if best is base:
        reason = f"keep {label}: no other setting reserved less at peak"
        if slower:
            reason += (
                f" without being more than {max_slowdown:.0%} slower "
                f"({', '.join(_label(t) for t in slower)} was slower)"
            )
        return best, reason
    saved = (base.peak_reserved_bytes or 0) - (best.peak_reserved_bytes or 0)
    share = saved / base.peak_reserved_bytes if base.peak_reserved_bytes else 0.0
    from oomkit.units import format_bytes

    reason = f"{label} reserves {format_bytes(saved)} ({share:.0%}) less at peak than the baseline"
    if best.steps_per_s is not None and base.steps_per_s:
        change = best.steps_per_s / base.steps_per_s - 1.0
        reason += f" at {change:+.0%} steps/s (within the {max_slowdown:.0%} allowed)"
    return best, reason


def _label(trial: Trial) -> str:
    if trial.alloc_conf == "":
        return "PyTorch's default setting"
    return f"PYTORCH_CUDA_ALLOC_CONF={trial.alloc_conf}"


def _status_words(trial: Trial) -> str:
    if trial.status == "oom":
        return f"ran out of memory at step {trial.oom_step}"
    if trial.status == "timeout":
        return "timed out"
    if trial.status == "invalid":
        return "is not a valid setting"
    return "crashed"


def _baseline_conf(environ: Mapping[str, str]) -> str:
    for name in _ALLOC_CONF_ENVS:
        if name in environ:
            return environ[name]
    return ""


def _mixed_models_warning(trials: Sequence[Trial]) -> str | None:
    """A warning when the trials ran on GPUs of different models (their steps/s do not compare)."""
    models = sorted({t.device_name for t in trials if t.device_name})
    if len(models) < 2:
        return None
    return (
        f"the trials ran on different GPU models ({', '.join(models)}): their steps/s "
        "compares the GPUs as much as the settings; name GPUs of one model with --gpus"
    )


def run_experiment(
    python: str,
    target: Sequence[str],
    configs: Sequence[str],
    *,
    interpreter_options: Sequence[str] = (),
    steps: int = 20,
    timeout_s: float = 600.0,
    environ: Mapping[str, str] | None = None,
    torch_version: str | None = None,
    max_slowdown: float = DEFAULT_MAX_SLOWDOWN,
    progress: Callable[[int, int, str], None] | None = None,
    log_dir: str | Path | None = None,
    gpus: Sequence[str] | None = None,
) -> ExperimentResult:
    """Run the script once with the caller's setting and once per candidate setting.

    With several GPUs the trials run in parallel, one per GPU at a time, each child with
    ``CUDA_VISIBLE_DEVICES`` set to its GPU; a trial starts on the first GPU another one frees,
    in the order of ``configs``. The baseline starts in the first wave with the candidates
    rather than alone before them: the deltas are only computed once every trial has ended, so
    nothing waits for it, and its steps/s is then measured under the same host load (CPU, data
    loading, PCIe, disk) as the candidates' instead of on an otherwise idle machine, which would
    make every candidate look slower. Peak memory is per process and unaffected.

    Args:
        python: the interpreter to run.
        target: ``[script, *args]`` or ``["-m", module, *args]``.
        configs: ``PYTORCH_CUDA_ALLOC_CONF`` candidates; each is checked with
            ``AllocatorConfig.parse`` first and, when PyTorch would reject it, reported
            ``invalid`` without being run. Repeats and the baseline's own setting are skipped.
        interpreter_options: options for ``python`` before the script.
        steps: optimizer steps per trial (at least 2 for a throughput).
        timeout_s: seconds before a trial is killed.
        environ: the environment the trials start from; None is this process's.
        torch_version: the PyTorch release whose config parser checks the candidates; None =
            newest.
        max_slowdown: see :func:`recommend`.
        progress: called as ``progress(index, total, alloc_conf)`` as each trial starts, in
            the order of the trials.
        log_dir: keep each trial's files (monitor log, output) in ``log_dir/trial-N``; None
            deletes them.
        gpus: ``CUDA_VISIBLE_DEVICES`` values (``("0", "1")``, or UUIDs) to spread the trials
            over, one trial per GPU at a time; ``()`` runs them one after another with the
            environment's devices. None: :func:`visible_gpus` of the trials' environment, in
            parallel when it finds two or more (one GPU or none: one after another, unpinned).

    Returns:
        The trials (the baseline first, then ``configs`` in order) and the recommendation.

    Raises:
        OomkitError: ``steps`` below 1, ``timeout_s`` not positive, a GPU named twice in
            ``gpus``, or the interpreter could not be started.
    """
    if steps < 1:
        raise OomkitError(f"steps must be at least 1; got {steps}. Example: --steps 20")
    if timeout_s <= 0:
        raise OomkitError(f"the timeout must be positive; got {timeout_s}. Example: --timeout 600")
    env = dict(os.environ if environ is None else environ)
    base_conf = _baseline_conf(env)
    if gpus is None:
        found = visible_gpus(env)
        slots: tuple[str, ...] = found if len(found) > 1 else ()
    else:
        names = gpus.split(",") if isinstance(gpus, str) else gpus  # "0,1" as --gpus takes it
        slots = tuple(str(gpu).strip() for gpu in names)
        repeated = sorted({gpu for gpu in slots if slots.count(gpu) > 1})
        if repeated or "" in slots:
            raise OomkitError(
                f"each GPU may be named once and not be empty; got {','.join(slots)!r}. "
                "Example: --gpus 0,1,2,3"
            )
    planned: list[tuple[str, str | None]] = []  # (setting, why it is invalid)
    seen = {base_conf}
    for text in configs:
        if text in seen:
            continue
        seen.add(text)
        try:
            AllocatorConfig.parse(text, torch_version)
        except ConfigError as exc:
            planned.append((text, str(exc)))
        else:
            planned.append((text, None))
    total = 1 + sum(1 for _, invalid in planned if invalid is None)
    warnings: list[str] = []
    results: list[Trial | None] = []
    pending: deque[tuple[int, int, str]] = deque()  # (position in results, trial index, setting)
    for text, invalid in [(base_conf, None), *planned]:
        if invalid is not None:
            results.append(Trial(alloc_conf=text, baseline=False, status="invalid", error=invalid))
        else:
            pending.append((len(results), len(pending), text))
            results.append(None)
    with tempfile.TemporaryDirectory(prefix="oomkit-experiment-") as tmp:
        root = Path(log_dir) if log_dir is not None else Path(tmp)
        free: deque[str | None] = deque(slots or (None,))
        running: dict[int, _Running] = {}
        try:
            while pending or running:
                # At most one trial per GPU: start one on each free GPU, in the input order.
                while pending and free:
                    position, index, text = pending.popleft()
                    if progress is not None:
                        progress(index, total, text)
                    running[position] = _start_trial(
                        python,
                        target,
                        text,
                        interpreter_options=interpreter_options,
                        steps=steps,
                        timeout_s=timeout_s,
                        baseline=index == 0,
                        environ=env,
                        workdir=root / f"trial-{index}",
                        get_time=time.monotonic,
                        gpu=free.popleft(),
                    )
                ended = False
                for position, run in list(running.items()):
                    timed_out = run.proc.poll() is None and time.monotonic() >= run.deadline
                    if run.proc.returncode is None and not timed_out:
                        continue
                    if timed_out:
                        _kill_group(run.proc)  # the others keep running meanwhile
                    del running[position]
                    results[position] = _finish_trial(
                        run, timed_out=timed_out, get_time=time.monotonic
                    )
                    free.append(run.gpu)
                    ended = True
                if not ended and running:
                    time.sleep(_POLL_S)
        except BaseException:
            for run in running.values():
                _kill_group(run.proc)
            raise
    trials = [t for t in results if t is not None]
    mixed = _mixed_models_warning(trials)
    if mixed is not None:
        warnings.append(mixed)
    if steps < 2:
        warnings.append("with 1 step per trial there is no throughput; use --steps 10 or more")
    if all(t.steps == 0 for t in trials if t.status != "invalid"):
        warnings.append(
            "no trial recorded an optimizer step: the monitor counts torch.optim optimizer "
            "steps; a script without one cannot be measured"
        )
    recommended, reason = recommend(trials, max_slowdown)
    return ExperimentResult(
        trials=tuple(trials),
        recommended=recommended,
        reason=reason,
        steps=steps,
        max_slowdown=max_slowdown,
        warnings=tuple(warnings),
        gpus=slots,
    )

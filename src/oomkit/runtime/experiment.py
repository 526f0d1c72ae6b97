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
without being more than ``max_slowdown`` slower than the baseline. One trial (its child process
and what it measured) lives in ``_trial.py``; its public names are re-exported here.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from oomkit.core.allocator import AllocatorConfig
from oomkit.errors import ConfigError, OomkitError
from oomkit.runtime._trial import (
    ALLOC_CONF_ENVS,
    VISIBLE_ENV,
    Running,
    Trial,
    TrialStatus,
    finish_trial,
    kill_group,
    run_trial,
    start_trial,
    summarize_log,
)

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

# What to try when the caller names no settings: the three knobs that change how the caching
# allocator splits and caches blocks (c10/cuda/CUDAAllocatorConfig.h).
DEFAULT_CONFIGS: tuple[str, ...] = (
    "expandable_segments:True",
    "max_split_size_mb:128",
    "roundup_power2_divisions:4",
)
# A setting that saves memory is not recommended when it costs more than this share of steps/s.
DEFAULT_MAX_SLOWDOWN = 0.05
# How often the scheduler looks at the running trials (exit, timeout).
_POLL_S = 0.05


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
    if VISIBLE_ENV in env:
        return _parse_visible_devices(env[VISIBLE_ENV])
    return tuple(str(i) for i in range(_torch_device_count()))


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
    for name in ALLOC_CONF_ENVS:
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
            AllocatorConfig.parse(text, torch_version, native_only=False)
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
        running: dict[int, Running] = {}
        try:
            while pending or running:
                # At most one trial per GPU: start one on each free GPU, in the input order.
                while pending and free:
                    position, index, text = pending.popleft()
                    if progress is not None:
                        progress(index, total, text)
                    running[position] = start_trial(
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
                        kill_group(run.proc)  # the others keep running meanwhile
                    del running[position]
                    results[position] = finish_trial(
                        run, timed_out=timed_out, get_time=time.monotonic
                    )
                    free.append(run.gpu)
                    ended = True
                if not ended and running:
                    time.sleep(_POLL_S)
        except BaseException:
            for run in running.values():
                kill_group(run.proc)
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

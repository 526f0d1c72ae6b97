"""The reverse question of the batch search: the smallest GPU one batch fits on.

``smallest_gpu`` predicts one batch on every candidate GPU (the catalog by default) with a
safety margin (``batch_probe``) and names the smallest it fits on. The recording depends on a
GPU only through its compute capability, so a step is traced once per capability and replayed
on each candidate; with ``jobs``, the capabilities are traced in forked processes at once
(``executors/forked.py run_forked_or_here``).

``smallest_gpu_count`` answers "how many GPUs of which kind" for a fixed global batch trained
with FSDP2: for each GPU count N (1, 2, 4, ... up to a maximum) that divides the global batch,
rank 0's step at per-rank batch global / N is recorded once (on the target's GPU) and replayed
on every candidate GPU.

This module never imports torch at import time; a probe imports ``oomkit.prediction.tracing``
when it runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from oomkit.core.gpus import CATALOG, GpuSpec
from oomkit.core.target import Target
from oomkit.core.trace.step_count import check_step_count
from oomkit.errors import ConfigError
from oomkit.executors.forked import run_forked_or_here
from oomkit.plan.batch_probe import (
    StepBuilder,
    check_positive,
    dedupe,
    less_margin,
    new_model_cache,
    predict_searched,
    probe_record,
    record_step,
    resolve_margin,
)
from oomkit.prediction.predictor import Prediction

__all__ = [
    "GpuCountResult",
    "GpuCountRow",
    "GpuFit",
    "SmallestGpuResult",
    "gpu_counts",
    "smallest_gpu",
    "smallest_gpu_count",
]

# (GPU count, per-rank batch, target) -> (rank 0's TraceRecording, its description).
CountRecorder = Callable[[int, int, Target], tuple[Any, str]]


@dataclass(frozen=True)
class GpuFit:
    """Whether one batch fits on one GPU.

    Attributes:
        gpu: the device.
        fits: no OOM on the GPU with ``margin_bytes`` less usable memory.
        headroom_bytes: usable memory less the reserved memory the step needs (negative: it
            does not fit even without a margin).
        peak_reserved_bytes: reserved memory the step needs there (its peak reserved; when it
            would OOM, its peak on a device without limit).
        usable_bytes: what the allocator may reserve there.
        margin_bytes: the margin required there.
        limiting_step: the part with the least headroom (see ``BatchProbe.limiting_step``).
    """

    gpu: GpuSpec
    fits: bool
    headroom_bytes: int
    peak_reserved_bytes: int
    usable_bytes: int
    margin_bytes: int
    limiting_step: str


@dataclass(frozen=True)
class SmallestGpuResult:
    """The GPUs one batch fits on, smallest memory first.

    Attributes:
        batch_size: the batch checked (``None`` for a recording given as is).
        smallest: the GPU with the least total memory it fits on; ``None`` if none.
        candidates: every GPU checked, by total memory (then name).
        margin_bytes: the margin asked for; ``None``: each GPU's default margin.
        traces: traces made (one per compute capability and part: the recorded ops depend on
            it, e.g. the SDPA backend and the cuBLAS workspace).
        description: what was checked.
        warnings: what the predictions do not model.
    """

    batch_size: int | None
    smallest: GpuSpec | None
    candidates: tuple[GpuFit, ...]
    margin_bytes: int | None
    traces: int
    description: str
    warnings: tuple[str, ...]


def smallest_gpu(
    source: StepBuilder | Any,
    batch_size: int | None = None,
    *,
    candidates: Sequence[GpuSpec] = CATALOG,
    target: Target | None = None,
    margin_bytes: int | None = None,
    steps: int = 2,
    eval_step: StepBuilder | None = None,
    jobs: int | None = 1,
) -> SmallestGpuResult:
    """Check one batch on every candidate GPU and name the smallest it fits on.

    Args:
        source: a builder as for ``max_batch_size`` (batch size -> step), or a recording
            (``oomkit.prediction.tracing.trace_step``'s ``TraceRecording``) replayed as is on every GPU.
        batch_size: the batch to check; required with a builder.
        candidates: the GPUs to check; the catalog by default.
        target: the allocator setting and versions (``Target.resolve("h100",
            alloc_conf=...)``); its GPU is replaced by each candidate; its cuDNN version, when
            stated, picks the SDPA backend. ``None`` is ``Target.resolve("h100")``: PyTorch's
            default allocator setting, the newest torch release.
        margin_bytes: memory to leave unreserved on each GPU, in bytes; ``None`` is each GPU's
            ``default_margin_bytes``.
        steps: training steps to record (builders only).
        eval_step: batch size -> an evaluation step that must fit too (builders only).
        jobs: processes that trace the compute capabilities at once (None: one per CPU core;
            1, the default: one at a time here; the result is the same). Where one of them
            fails, every capability is traced here, so an error is raised as one at a time.

    Returns:
        Every candidate with its fit and headroom, by total memory, and the smallest fit.

    Raises:
        ConfigError: no candidates, or a builder without ``batch_size`` (a ``ValueError`` too).
        UserCodeError: a builder returned something that is not a step.
    """
    ordered = sorted(candidates, key=lambda g: (g.total_memory_bytes, g.name))
    if not ordered:
        raise ConfigError("candidates is empty; pass GPUs to check, e.g. oomkit.core.gpus.CATALOG")
    check_step_count(steps, "smallest_gpu(build, 16, steps=2)")
    # Every candidate shares the allocator setting and versions; each brings its own GPU.
    base = Target.resolve("h100") if target is None else target
    recording: Any = source if hasattr(source, "events") and hasattr(source, "step_starts") else None
    if recording is None:
        if batch_size is None:
            raise ConfigError(
                "smallest_gpu needs batch_size with a step builder; e.g. smallest_gpu(build, 16)"
            )
        check_positive("batch_size", batch_size, "smallest_gpu(build, 16)")
    # The recording depends on the GPU only through its compute capability (the SDPA backend,
    # the cuBLAS workspace size: tracing/emulations), so trace once per capability.
    recorded: dict[tuple[int, int] | None, tuple[Any, Any, str]] = {}
    traces = 0
    if recording is None:
        assert batch_size is not None
        firsts: dict[tuple[int, int] | None, Target] = {}  # capability: its first candidate
        for spec in ordered:
            firsts.setdefault(spec.compute_capability, base.with_gpu(spec))
        recorded = _record_capabilities(
            source, eval_step, batch_size, firsts, steps=steps, jobs=jobs
        )
        traces = sum(1 + (second is not None) for _, second, _ in recorded.values())
    fits: list[GpuFit] = []
    warnings: list[tuple[str, ...]] = []  # per candidate
    description = ""
    for spec in ordered:
        on_spec = base.with_gpu(spec)
        margin = resolve_margin(margin_bytes, on_spec.usable_bytes)
        if recording is not None:
            train_recording, eval_recording = recording, None
            described = ""
        else:
            train_recording, eval_recording, described = recorded[spec.compute_capability]
        fit, train, evaluation = _fit_on(
            on_spec, margin, batch_size or 0, train_recording, eval_recording, described
        )
        description = description or described
        warnings.append((*train.warnings, *(() if evaluation is None else evaluation.warnings)))
        fits.append(fit)
    # The same recording warns alike on every device, with that device's figures: keep the
    # warnings of the smallest fit (or, when none fits, of the largest GPU).
    shown = next((i for i, f in enumerate(fits) if f.fits), len(fits) - 1)
    return SmallestGpuResult(
        batch_size=batch_size if recording is None else None,
        smallest=next((f.gpu for f in fits if f.fits), None),
        candidates=tuple(fits),
        margin_bytes=margin_bytes,
        traces=traces,
        description=description,
        warnings=tuple(dedupe(warnings[shown])),
    )



@dataclass(frozen=True)
class GpuCountRow:
    """One GPU count of the table: rank 0's per-rank batch and its fit on every candidate.

    Attributes:
        gpu_count: GPUs (FSDP2 ranks).
        per_rank_batch: the global batch divided by ``gpu_count``.
        candidates: every GPU checked, as in ``SmallestGpuResult.candidates``.
        description: what was recorded for this count.
    """

    gpu_count: int
    per_rank_batch: int
    candidates: tuple[GpuFit, ...]
    description: str

    @property
    def smallest(self) -> GpuSpec | None:
        """The GPU with the least memory that fits at this count; ``None`` if none."""
        return next((fit.gpu for fit in self.candidates if fit.fits), None)


@dataclass(frozen=True)
class GpuCountResult:
    """How many GPUs of which kind a global batch needs under FSDP2.

    Attributes:
        global_batch: the batch over all ranks.
        rows: one per GPU count checked, fewest GPUs first.
        skipped_counts: counts up to the maximum that do not divide ``global_batch``.
        fewest: per catalog GPU name, the fewest GPUs of it that fit (GPUs no count fits on
            are left out).
        least_memory: ``(count, gpu)`` of the fitting configuration with the least total memory
            (count x the GPU's memory; ties: fewer GPUs); ``None`` when nothing fits.
        traces: recordings made (one per count: replayed on every GPU).
        margin_bytes: the margin asked for; ``None``: each GPU's default margin.
        warnings: what the predictions do not model, and where the table may differ.
    """

    global_batch: int
    rows: tuple[GpuCountRow, ...]
    skipped_counts: tuple[int, ...]
    fewest: dict[str, int]
    least_memory: tuple[int, GpuSpec] | None
    traces: int
    margin_bytes: int | None
    warnings: tuple[str, ...]


def _fit_on(
    on_spec: Target,
    margin: int,
    batch_size: int,
    train_recording: Any,
    eval_recording: Any,
    description: str,
) -> tuple[GpuFit, Prediction, Prediction | None]:
    """Replay the recordings on ``on_spec``'s GPU less ``margin``: its fit and the predictions.

    A margin that leaves nothing fails outright (``less_margin`` returns None).
    """
    spec = on_spec.gpu
    searched = less_margin(on_spec, margin)
    replayed = on_spec if searched is None else searched
    off = 0 if searched is None else margin
    train = predict_searched(train_recording, replayed, off, description)
    evaluation = None
    if eval_recording is not None:
        evaluation = predict_searched(eval_recording, replayed, off)
    probe = probe_record(
        batch_size,
        train,
        evaluation,
        on_spec.usable_bytes,
        feasible=searched is not None,
        margin_bytes=off,
    )
    fit = GpuFit(
        gpu=spec,
        fits=probe.fits,
        headroom_bytes=probe.headroom_bytes,
        peak_reserved_bytes=probe.peak_reserved_bytes,
        usable_bytes=probe.usable_bytes,
        margin_bytes=margin,
        limiting_step=probe.limiting_step,
    )
    return fit, train, evaluation


def gpu_counts(global_batch: int, max_gpus: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the powers of two up to ``max_gpus`` that divide ``global_batch``, those that do not)."""
    check_positive("global_batch", global_batch, "smallest_gpu_count(record, 64)")
    check_positive("max_gpus", max_gpus, "smallest_gpu_count(record, 64, max_gpus=64)")
    counts = [1 << k for k in range(max_gpus.bit_length()) if 1 << k <= max_gpus]
    return (
        tuple(n for n in counts if global_batch % n == 0),
        tuple(n for n in counts if global_batch % n),
    )


def _after_start(
    progress: Callable[[int, int], None] | None,
) -> Callable[[int, int], None] | None:
    """``progress`` without ``run_forked``'s call before anything is done (done = 0)."""
    if progress is None:
        return None
    return lambda done, total: progress(done, total) if done else None


def _record_capabilities(
    source: StepBuilder,
    eval_step: StepBuilder | None,
    batch_size: int,
    targets: dict[tuple[int, int] | None, Target],
    *,
    steps: int,
    jobs: int | None,
) -> dict[tuple[int, int] | None, tuple[Any, Any, str]]:
    """Per compute capability, (the training recording, the evaluation recording or None, the
    description), each recorded on that capability's target; ``jobs`` of them at once."""
    models = new_model_cache()  # one model for every capability traced here (model_cache.py)

    def record(on: Target) -> tuple[Any, Any, str]:
        first, described = record_step(
            source, "train step", batch_size, target=on, steps=steps, models=models
        )
        second = None
        if eval_step is not None:
            second, _ = record_step(eval_step, "eval step", batch_size, target=on, steps=1, models=models)
        return first, second, described

    results = run_forked_or_here([partial(record, on) for on in targets.values()], jobs=jobs)
    return dict(zip(targets, results, strict=True))


def smallest_gpu_count(
    record: CountRecorder,
    global_batch: int,
    *,
    max_gpus: int = 64,
    candidates: Sequence[GpuSpec] = CATALOG,
    margin_bytes: int | None = None,
    target: Target | None = None,
    progress: Callable[[int, int], None] | None = None,
    jobs: int | None = 1,
) -> GpuCountResult:
    """For each GPU count dividing ``global_batch``, which candidate GPUs rank 0 fits on.

    Rank 0's step at per-rank batch ``global_batch // count`` is recorded once per count, for
    ``target``'s GPU, and replayed on every candidate with its margin (as ``smallest_gpu`` does).
    The recording's kernels are those of ``target``'s GPU: on a GPU of another compute
    capability the SDPA backend (what attention saves) and the cuBLAS workspace may differ.

    Args:
        record: (GPU count, per-rank batch, target) -> (rank 0's recording, description).
        global_batch: the batch over all ranks.
        max_gpus: the largest count tried (counts are 1, 2, 4, ... up to it).
        candidates: the GPUs to check; the catalog by default.
        margin_bytes: memory to leave unreserved per GPU; ``None``: each GPU's default.
        target: the allocator setting, versions and GPU to record for (default: an H100).
        progress: called after each recording with (recordings made, recordings to make).
        jobs: processes that record and replay the counts at once (None: one per CPU core; 1,
            the default: one at a time here; the result is the same). Where one of them fails,
            the counts are done here, so an error is raised as one at a time.

    Raises:
        ValueError: no candidates, a count or batch below 1, or no count divides the batch.
    """
    ordered = sorted(candidates, key=lambda g: (g.total_memory_bytes, g.name))
    if not ordered:
        raise ConfigError("candidates is empty; pass GPUs to check, e.g. oomkit.core.gpus.CATALOG")
    counts, skipped = gpu_counts(global_batch, max_gpus)
    if not counts:  # unreachable: 1 divides every batch
        raise ConfigError(f"no GPU count up to {max_gpus} divides the global batch {global_batch}")
    base = Target.resolve("h100") if target is None else target

    def row_of(count: int) -> tuple[GpuCountRow, tuple[str, ...]]:
        """The count's row, and the warnings of its prediction on the largest candidate."""
        per_rank = global_batch // count
        recording, description = record(count, per_rank, base)
        fits: list[GpuFit] = []
        shown: tuple[str, ...] = ()
        for spec in ordered:
            margin = resolve_margin(margin_bytes, base.with_gpu(spec).usable_bytes)
            fit, train, _ = _fit_on(
                base.with_gpu(spec), margin, per_rank, recording, None, description
            )
            if spec is ordered[-1]:  # alike on every GPU, with its figures: the largest's
                shown = tuple(train.warnings)
            fits.append(fit)
        return GpuCountRow(count, per_rank, tuple(fits), description), shown

    # One at a time, each recording is dropped before the next is made (a row keeps none).
    done = run_forked_or_here(
        [partial(row_of, count) for count in counts], jobs=jobs, progress=_after_start(progress)
    )
    rows = [row for row, _ in done]
    warnings = [line for _, shown in done for line in shown]
    fewest: dict[str, int] = {}
    for row in rows:
        for fit in row.candidates:
            if fit.fits:
                fewest.setdefault(fit.gpu.name, row.gpu_count)
    options = [
        (row.gpu_count * fit.gpu.total_memory_bytes, row.gpu_count, fit.gpu)
        for row in rows
        for fit in row.candidates
        if fit.fits
    ]
    best = min(options, key=lambda o: (o[0], o[1], o[2].name), default=None)
    kernels = base.gpu.name
    warnings.append(
        f"each count was recorded once with {kernels}'s kernels and replayed on every GPU; on a "
        "GPU of another compute capability the attention backend (what it saves for backward) "
        "and the cuBLAS workspace may differ"
    )
    return GpuCountResult(
        global_batch=global_batch,
        rows=tuple(rows),
        skipped_counts=skipped,
        fewest=fewest,
        least_memory=None if best is None else (best[1], best[2]),
        traces=len(counts),
        margin_bytes=margin_bytes,
        warnings=tuple(dedupe(warnings)),
    )

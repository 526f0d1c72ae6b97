"""The reverse question of the batch search: the smallest GPU one batch fits on.

``smallest_gpu`` predicts one batch on every candidate GPU (the catalog by default) with a
safety margin (``batch_probe``) and names the smallest it fits on. The recording depends on a
GPU only through its compute capability, so a step is traced once per capability and replayed
on each candidate.

This module never imports torch at import time; a probe imports ``oomkit.prediction.tracing``
when it runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from oomkit.core.allocator import AllocatorConfig
from oomkit.core.gpus import CATALOG, GpuSpec
from oomkit.core.target import Target, resolve_target
from oomkit.plan.batch_probe import (
    StepBuilder,
    check_positive,
    dedupe,
    less_margin,
    probe_record,
    record_step,
    resolve_margin,
)
from oomkit.prediction.predictor import predict_recording

__all__ = ["GpuFit", "SmallestGpuResult", "smallest_gpu"]


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
    alloc_conf: str | AllocatorConfig | None = None,
    margin_bytes: int | None = None,
    steps: int = 2,
    eval_step: StepBuilder | None = None,
    torch_version: str | None = None,
    target: Target | None = None,
) -> SmallestGpuResult:
    """Check one batch on every candidate GPU and name the smallest it fits on.

    Args:
        source: a builder as for ``max_batch_size`` (batch size -> step), or a recording
            (``oomkit.prediction.tracing.trace_step``'s ``TraceRecording``) replayed as is on every GPU.
        batch_size: the batch to check; required with a builder.
        candidates: the GPUs to check; the catalog by default.
        alloc_conf: ``PYTORCH_CUDA_ALLOC_CONF`` value to simulate; ``None`` is the default.
        margin_bytes: memory to leave unreserved on each GPU, in bytes; ``None`` is each GPU's
            ``default_margin_bytes``.
        steps: training steps to record (builders only).
        eval_step: batch size -> an evaluation step that must fit too (builders only).
        torch_version: the PyTorch version whose allocator to model; ``None`` is the newest.
        target: the allocator setting and versions at once, instead of ``alloc_conf`` and
            ``torch_version`` (its GPU is replaced by each candidate; its cuDNN version, when
            stated, picks the SDPA backend).

    Returns:
        Every candidate with its fit and headroom, by total memory, and the smallest fit.

    Raises:
        ValueError: no candidates, a builder without ``batch_size``, or a negative margin.
        UserCodeError: a builder returned something that is not a step.
        ConfigError: ``alloc_conf`` is a setting PyTorch would reject, or ``target`` and
            ``alloc_conf`` or ``torch_version`` are both given.
    """
    ordered = sorted(candidates, key=lambda g: (g.total_memory_bytes, g.name))
    if not ordered:
        raise ValueError("candidates is empty; pass GPUs to check, e.g. oomkit.core.gpus.CATALOG")
    check_positive("steps", steps, "smallest_gpu(build, 16, steps=2)")
    # Every candidate shares the allocator setting and versions; each brings its own GPU.
    base = resolve_target(target, alloc_conf=alloc_conf, torch_version=torch_version)
    recording: Any = source if hasattr(source, "events") and hasattr(source, "step_starts") else None
    if recording is None:
        if batch_size is None:
            raise ValueError(
                "smallest_gpu needs batch_size with a step builder; e.g. smallest_gpu(build, 16)"
            )
        check_positive("batch_size", batch_size, "smallest_gpu(build, 16)")
    # The recording depends on the GPU only through its compute capability (the SDPA backend,
    # the cuBLAS workspace size: tracing/emulations), so trace once per capability.
    recorded: dict[tuple[int, int] | None, tuple[Any, Any, str]] = {}
    traces = 0
    fits: list[GpuFit] = []
    warnings: list[tuple[str, ...]] = []  # per candidate
    description = ""
    for spec in ordered:
        on_spec = base.with_gpu(spec)
        margin = resolve_margin(margin_bytes, spec.usable_bytes())
        if recording is not None:
            train_recording, eval_recording = recording, None
            described = ""
        else:
            assert batch_size is not None
            key = spec.compute_capability
            if key not in recorded:
                first, described = record_step(
                    source, "train step", batch_size, target=on_spec, steps=steps
                )
                second = None
                if eval_step is not None:
                    second, _ = record_step(
                        eval_step, "eval step", batch_size, target=on_spec, steps=1
                    )
                recorded[key] = (first, second, described)
                traces += 1 + (second is not None)
            train_recording, eval_recording, described = recorded[key]
        # Replayed on the GPU less the margin; a margin that leaves nothing fails outright.
        searched = less_margin(on_spec, margin)
        replayed = on_spec if searched is None else searched
        train = predict_recording(train_recording, target=replayed, description=described)
        evaluation = None
        if eval_recording is not None:
            evaluation = predict_recording(eval_recording, target=replayed)
        probe = probe_record(
            batch_size or 0, train, evaluation, spec.usable_bytes(), feasible=searched is not None
        )
        description = description or described
        warnings.append((*train.warnings, *(() if evaluation is None else evaluation.warnings)))
        fits.append(
            GpuFit(
                gpu=spec,
                fits=probe.fits,
                headroom_bytes=probe.headroom_bytes,
                peak_reserved_bytes=probe.peak_reserved_bytes,
                usable_bytes=spec.usable_bytes(),
                margin_bytes=margin,
                limiting_step=probe.limiting_step,
            )
        )
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


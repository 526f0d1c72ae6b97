"""One batch size predicted: the step built, recorded and replayed with a safety margin.

The unit that ``max_batch_size`` (batch_search.py) and ``smallest_gpu`` (smallest_gpu.py) repeat:
a builder makes the step at one batch size under ``torch.device("meta")``, the tracer records it
for the target's GPU, and the predictor replays it on that GPU with ``margin_bytes`` less usable
memory, as if something outside the prediction held the margin. ``BatchProbe`` is the result.

This module never imports torch at import time; a probe imports ``oomkit.prediction.tracing``
when it runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from oomkit.core.target import Target
from oomkit.errors import ConfigError, UserCodeError
from oomkit.prediction.predictor import Prediction, predict_recording
from oomkit.units import MiB, format_bytes

__all__ = [
    "DEFAULT_MARGIN_FRACTION",
    "MIN_DEFAULT_MARGIN_BYTES",
    "BatchProbe",
    "Progress",
    "RecordingBuilder",
    "StepBuilder",
    "check_positive",
    "dedupe",
    "default_margin_bytes",
    "less_margin",
    "new_model_cache",
    "predict_built",
    "probe_record",
    "record_step",
    "resolve_margin",
]

# The default safety margin: 2% of the usable memory, at least 256 MiB, rounded down to 2 MiB
# (the granularity of large segments: CUDACachingAllocator.cpp kRoundLarge). The prediction is
# exact for the recorded ops; the margin covers what it does not see: kernels that allocate
# workspaces outside PyTorch (cuDNN, NCCL), driver-version drift of total memory (catalog notes:
# up to a few hundred MiB) and the context-overhead estimate (gpus/overhead.py).
DEFAULT_MARGIN_FRACTION = 0.02
MIN_DEFAULT_MARGIN_BYTES = 256 * MiB
_MARGIN_ROUND_BYTES = 2 * MiB

# A builder maps a batch size to one of: a ``BuiltStep`` (or anything with ``step_fn`` and
# ``track``), a pair ``(step_fn, objects_to_track)``, or a zero-argument step function.
StepBuilder = Callable[[int], Any]
Progress = Callable[[int, int], None]


def default_margin_bytes(usable_bytes: int) -> int:
    """The default safety margin for a device with ``usable_bytes`` usable.

    Args:
        usable_bytes: what the allocator may reserve (total memory less the CUDA context).

    Returns:
        ``max(256 MiB, 2% of usable_bytes rounded down to 2 MiB)``, in bytes.
    """
    share = int(usable_bytes * DEFAULT_MARGIN_FRACTION) // _MARGIN_ROUND_BYTES * _MARGIN_ROUND_BYTES
    return max(MIN_DEFAULT_MARGIN_BYTES, share)


@dataclass(frozen=True)
class BatchProbe:
    """One batch size tried: its predictions and whether it fits with the margin.

    Attributes:
        batch_size: the batch size.
        fits: every training step and the evaluation step run without an OOM on the GPU with
            the margin less usable memory (so at least the margin stays unreserved).
        peak_reserved_bytes: reserved memory the most demanding part needs (its peak reserved;
            for a part that would OOM, its peak on a device without limit).
        peak_allocated_bytes: highest allocated memory over the parts predicted.
        headroom_bytes: ``usable_bytes`` less ``peak_reserved_bytes`` (negative: it does not
            fit even without a margin).
        usable_bytes: what the allocator may reserve at this batch without the margin: the
            target's usable bytes less what the step's layout holds outside the allocator
            (NCCL's buffers: ``DistributedMemory.off_usable_bytes``), as ``predict`` says.
        limiting_step: the part that fails, or when all fit the one with the least headroom:
            ``"train step N"`` (1-based: ``"train step 1"`` is the first step, which creates the
            optimizer state), ``"before train step 1"`` (the model and inputs alone) or
            ``"eval"``.
        train: the prediction of the training step, made on the GPU less the margin (its
            ``gpu.context_overhead_bytes`` includes the margin).
        eval: the prediction of the evaluation step; ``None`` without one, or when the training
            step already does not fit (it is then not predicted).
        synthesized: a prediction of it replayed a recording synthesized from the recordings of
            other batch sizes (``trace_interpolation.py``) instead of one traced at this size.
    """

    batch_size: int
    fits: bool
    peak_reserved_bytes: int
    peak_allocated_bytes: int
    headroom_bytes: int
    limiting_step: str
    train: Prediction
    usable_bytes: int
    eval: Prediction | None = None
    synthesized: bool = False


def check_positive(name: str, value: int, example: str) -> None:
    """Raise ``ConfigError`` (saying ``example``) unless ``value`` is a whole number >= 1."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be a whole number of at least 1; got {value!r}. Example: {example}")


def resolve_margin(margin_bytes: int | None, usable_bytes: int, gpu_name: str | None = None) -> int:
    """``margin_bytes``, checked; ``None`` is ``default_margin_bytes(usable_bytes)``.

    With ``gpu_name`` (a search on that one GPU), a margin the user gave that is not below
    ``usable_bytes`` contradicts the question and raises ``ConfigError``; the default margin
    above a small GPU's memory is left to the search, which finds that nothing fits. A
    search over several GPUs (``smallest_gpu``) passes no name: there a margin above one
    GPU only rules that GPU out.
    """
    if margin_bytes is None:
        return default_margin_bytes(usable_bytes)
    if not isinstance(margin_bytes, int) or isinstance(margin_bytes, bool) or margin_bytes < 0:
        raise ConfigError(
            f"margin_bytes must be a whole number of bytes >= 0; got {margin_bytes!r}. "
            "Example: margin_bytes=512 * 2**20"
        )
    if gpu_name is not None and margin_bytes >= usable_bytes:
        raise ConfigError(
            f"the margin of {format_bytes(margin_bytes)} is not below the "
            f"{format_bytes(usable_bytes)} usable on {gpu_name}, so no batch could fit. Give a "
            f"margin below {format_bytes(usable_bytes)} (margin_bytes, --margin; the default is "
            f"{format_bytes(default_margin_bytes(usable_bytes))} here) or a GPU with more memory."
        )
    return margin_bytes


@dataclass(frozen=True)
class RecordingBuilder:
    """A builder that records its own step, for steps the meta-device tracer cannot run alone:
    rank 0 of a parallel layout recorded on a fake process group (``oomkit fit --fsdp/--tp/--dp``:
    ``record`` calls ``trace_distributed_step`` with ``ParallelLayout.mesh_shape``; the batch
    is then rank 0's per-rank batch).

    Attributes:
        record: (batch size, target, steps) -> (the ``TraceRecording``, its description).
    """

    record: Callable[[int, Target, int], tuple[Any, str]]

    def __call__(self, batch_size: int) -> Any:
        raise TypeError("a RecordingBuilder records its step: call record_step with it")


def _unpack_built(built: Any, what: str, batch_size: int) -> tuple[Callable[[], Any], tuple[Any, ...], str]:
    """(step_fn, objects to track, description) from what a builder returned."""
    step_fn = getattr(built, "step_fn", None)
    if step_fn is not None and callable(step_fn) and hasattr(built, "track"):
        description = getattr(built, "description", "") or ""
        return step_fn, tuple(built.track), str(description)
    if isinstance(built, (tuple, list)) and len(built) == 2 and callable(built[0]):
        track = built[1]
        return built[0], tuple(track) if isinstance(track, (tuple, list)) else (track,), ""
    if callable(built):
        return built, (), ""
    raise UserCodeError(
        f"the {what} builder returned {type(built).__name__} for batch {batch_size}; it must "
        "return a BuiltStep (oomkit.prediction.models.build_preset_step), (step_fn, objects_to_track) with "
        "the model, optimizer and inputs, or a zero-argument step function."
    )


def record_step(
    builder: StepBuilder,
    what: str,
    batch_size: int,
    *,
    target: Target,
    steps: int,
    models: Any = None,
) -> tuple[Any, str]:
    """Build the step at ``batch_size`` under ``torch.device("meta")`` and record it for
    ``target`` (its GPU's compute capability and its cuDNN version pick the kernels).

    Args:
        models: a ``oomkit.prediction.models.model_cache.ModelCache`` active while the builder
            runs: the presets and Hugging Face models it builds are then built once per cache
            and shared by the probes (``new_model_cache``); ``None`` builds afresh.

    Returns:
        The ``TraceRecording`` and the builder's description of the step.
    """
    if isinstance(builder, RecordingBuilder):
        return builder.record(batch_size, target, steps)
    import torch  # the caller's builder needs torch anyway; imported here to keep oomkit light

    from oomkit.prediction.tracing import trace_step

    meta = torch.device("meta")
    with meta, contextlib.nullcontext() if models is None else models.active():
        built = builder(batch_size)
    step_fn, track, description = _unpack_built(built, what, batch_size)

    def step(*_tracked: Any) -> Any:
        # As for `oomkit predict file.py:function`: the step, too, runs with meta as default.
        with meta:
            return step_fn()

    return trace_step(step, *track, steps=steps, target=target), description


def predict_built(
    builder: StepBuilder,
    what: str,
    batch_size: int,
    *,
    target: Target,
    steps: int,
    models: Any = None,
) -> Prediction:
    """Build, record and predict the step at ``batch_size`` on ``target`` (``models``: as
    for ``record_step``)."""
    recording, description = record_step(
        builder, what, batch_size, target=target, steps=steps, models=models
    )
    return predict_recording(recording, target=target, description=description)


def new_model_cache() -> Any:
    """A ``ModelCache`` for the probes of one search (imports torch: call it when probing)."""
    from oomkit.prediction.models.model_cache import ModelCache

    return ModelCache()


def less_margin(target: Target, margin_bytes: int) -> Target | None:
    """``target`` with ``margin_bytes`` less usable memory (held outside the allocator, as the
    CUDA context is); ``None`` when nothing would be left."""
    spec = target.gpu
    if margin_bytes >= target.usable_bytes:
        return None
    overhead = spec.context_overhead_bytes + margin_bytes
    searched = target.with_gpu(dataclasses.replace(spec, context_overhead_bytes=overhead))
    limit = target.fraction_limit_bytes
    if limit is None:
        return searched
    # The setting's per_process_memory_fraction limits the allocator below the GPU's memory:
    # the margin comes off that limit too (a smaller fraction of the same total).
    fraction = (limit - margin_bytes) / spec.total_memory_bytes
    config = dataclasses.replace(target.allocator_config, per_process_memory_fraction=fraction)
    return dataclasses.replace(searched, allocator_config=config)


def predict_searched(
    recording: Any, target: Target, margin_bytes: int, description: str = ""
) -> Prediction:
    """``predict_recording`` on the searched ``target`` (the GPU less ``margin_bytes``: see
    ``less_margin``), the margin also off the limit the step's own
    ``torch.cuda.set_per_process_memory_fraction`` call sets: a margin held outside the
    allocator does not lower a fraction's limit (c10/cuda/CUDACachingAllocator.cpp
    ``setMemoryFraction``: ``allowed_memory_maximum`` is a share of the total), so it comes off
    that share, as ``less_margin`` takes it off the setting's."""
    fraction = recording.memory_fraction
    if fraction is not None and margin_bytes > 0:
        total = target.gpu.total_memory_bytes
        lowered = max(0.0, (fraction * total - margin_bytes) / total)
        recording = dataclasses.replace(recording, memory_fraction=lowered)
    return predict_recording(recording, target=target, description=description)


def _train_label(prediction: Prediction) -> str:
    """Which training step limits: the one that would OOM, else the one with the highest peak."""
    step = prediction.oom.step if prediction.oom is not None else prediction.peak_step
    # Prediction steps count from 1, as this label does.
    return "before train step 1" if step is None else f"train step {step}"


def probe_record(
    batch_size: int,
    train: Prediction,
    evaluation: Prediction | None,
    usable_bytes: int,
    *,
    feasible: bool = True,
    synthesized: bool = False,
    margin_bytes: int = 0,
) -> BatchProbe:
    """A probe from predictions made on the GPU less ``margin_bytes`` (``usable_bytes``: the
    target's, without; less where a step's own memory fraction limits it, ``predict_searched``)."""
    train_fits = feasible and train.fits
    eval_fits = evaluation is None or (feasible and evaluation.fits)
    parts = [(train, _train_label(train), train_fits)]
    if evaluation is not None:
        parts.append((evaluation, "eval", eval_fits))
    failing = [part for part in parts if not part[2]]
    # The limiting part: a failing one (the most demanding when both fail), else the one with
    # the least headroom.
    worst = max(failing or parts, key=lambda part: part[0].required_bytes)
    demanding = max(parts, key=lambda part: part[0].required_bytes)[0]
    # A layout's NCCL buffers come off what the allocator may reserve (predictor.py nccl_of).
    usable = min(
        usable_bytes
        - max(p[0].distributed.off_usable_bytes if p[0].distributed is not None else 0 for p in parts),
        # A prediction's usable is the searched GPU's (the margin off) or its step's limit.
        min(p[0].usable_bytes for p in parts) + margin_bytes,
    )
    return BatchProbe(
        batch_size=batch_size,
        fits=train_fits and eval_fits,
        peak_reserved_bytes=demanding.required_bytes,
        peak_allocated_bytes=max(p[0].peak_allocated_bytes for p in parts),
        headroom_bytes=usable - demanding.required_bytes,
        limiting_step=worst[1],
        train=train,
        usable_bytes=usable,
        eval=evaluation,
        synthesized=synthesized,
    )


def dedupe(lines: Iterable[str]) -> list[str]:
    """``lines`` without repeats, in first-seen order."""
    return list(dict.fromkeys(lines))

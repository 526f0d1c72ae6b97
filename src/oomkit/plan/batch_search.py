"""The largest batch that fits on a GPU, found by prediction (no GPU, no OOMs paid).

``max_batch_size`` searches over batch size with the predictor: every probe builds the step at
one batch size, records it on the meta device and replays it through the simulated caching
allocator of the target GPU (``oomkit.prediction.predictor.predict_recording``). The search
brackets by doubling from a start (1 by default) until a batch does not fit, then bisects
between the largest batch that fits and the smallest that does not. A batch fits only when every
recorded training step (so the first optimizer step, which creates the optimizer state, counts
as well as the steady state) and the evaluation step, if one is given, run without an OOM on the
GPU with ``margin_bytes`` less usable memory, as if something outside the prediction held the
margin (near the limit the allocator frees its cache and retries there, as PyTorch would).

``smallest_gpu`` answers the reverse question: for one batch, which catalog GPUs it fits on and
the smallest of them.

The worst case is the caller's to build: the builder should make the longest sequence (largest
image) the training will see; ``oomkit fit`` passes ``--seq`` as that maximum.

This module never imports torch at import time; a probe imports ``oomkit.prediction.tracing`` when it runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from oomkit.core.allocator import AllocatorConfig
from oomkit.prediction.predictor import Prediction, predict_recording
from oomkit.errors import NoFeasibleBatchSizeError, UserCodeError
from oomkit.core.gpus import CATALOG, GpuSpec, get_gpu
from oomkit.units import MiB, format_bytes

__all__ = [
    "DEFAULT_MARGIN_FRACTION",
    "MIN_DEFAULT_MARGIN_BYTES",
    "BatchProbe",
    "BatchSearchResult",
    "GpuFit",
    "SmallestGpuResult",
    "default_margin_bytes",
    "max_batch_size",
    "smallest_gpu",
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
        headroom_bytes: usable memory less ``peak_reserved_bytes`` (negative: it does not fit
            even without a margin).
        limiting_step: the part that fails, or when all fit the one with the least headroom:
            ``"train step N"`` (1-based: ``"train step 1"`` is the first step, which creates the
            optimizer state), ``"before train step 1"`` (the model and inputs alone) or
            ``"eval"``.
        train: the prediction of the training step, made on the GPU less the margin (its
            ``gpu.context_overhead_bytes`` includes the margin).
        eval: the prediction of the evaluation step; ``None`` without one, or when the training
            step already does not fit (it is then not predicted).
    """

    batch_size: int
    fits: bool
    peak_reserved_bytes: int
    peak_allocated_bytes: int
    headroom_bytes: int
    limiting_step: str
    train: Prediction
    eval: Prediction | None = None


@dataclass(frozen=True)
class BatchSearchResult:
    """The largest batch that fits on one GPU, and how it was found.

    Attributes:
        batch_size: the largest batch size found to fit (with the margin).
        gpu: the device searched for.
        alloc_conf: the ``PYTORCH_CUDA_ALLOC_CONF`` simulated, canonical (``""`` = default).
        capacity_bytes: the device's total memory.
        context_overhead_bytes: memory held outside the allocator (CUDA context).
        usable_bytes: ``capacity_bytes - context_overhead_bytes``.
        margin_bytes: memory that stays unreserved at the answer, at least: every size was
            predicted on the GPU with this much less usable memory.
        margin_is_default: ``margin_bytes`` is ``default_margin_bytes(usable_bytes)``.
        peak_reserved_bytes: peak reserved at ``batch_size`` (its most demanding part).
        peak_allocated_bytes: peak allocated at ``batch_size``.
        headroom_bytes: ``usable_bytes - peak_reserved_bytes`` at ``batch_size``.
        limiting_step: what stops a larger batch: the limiting part of the smallest batch
            tried above the answer that does not fit (see ``BatchProbe.limiting_step``); when
            the search stopped at ``max_batch``, the answer's own least-headroom part.
        first_failing_batch: the smallest batch tried that does not fit; ``None`` when every
            batch tried fits (the search stopped at ``max_batch``).
        curve: every batch tried, by batch size.
        probe_order: the batch sizes in the order they were tried.
        traces: predictions made (a trace and a replay each; training and evaluation count
            one each).
        steps: training steps recorded per prediction.
        max_batch: the largest batch the search would try.
        description: what was searched ("GPT-2 124M, batch 12, ...", at the answer).
        warnings: what the predictions do not model, and what the search noticed.
    """

    batch_size: int
    gpu: GpuSpec
    alloc_conf: str
    capacity_bytes: int
    context_overhead_bytes: int
    usable_bytes: int
    margin_bytes: int
    margin_is_default: bool
    peak_reserved_bytes: int
    peak_allocated_bytes: int
    headroom_bytes: int
    limiting_step: str
    first_failing_batch: int | None
    curve: tuple[BatchProbe, ...]
    probe_order: tuple[int, ...]
    traces: int
    steps: int
    max_batch: int
    description: str
    warnings: tuple[str, ...]

    @property
    def answer(self) -> BatchProbe:
        """The probe at ``batch_size``."""
        return next(p for p in self.curve if p.batch_size == self.batch_size)


def _check_positive(name: str, value: int, example: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a whole number of at least 1; got {value!r}. Example: {example}")




def _resolve_margin(margin_bytes: int | None, usable_bytes: int) -> int:
    if margin_bytes is None:
        return default_margin_bytes(usable_bytes)
    if not isinstance(margin_bytes, int) or margin_bytes < 0:
        raise ValueError(
            f"margin_bytes must be a whole number of bytes >= 0; got {margin_bytes!r}. "
            "Example: margin_bytes=512 * 2**20"
        )
    return margin_bytes


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


def _record(
    builder: StepBuilder, what: str, batch_size: int, *, gpu: GpuSpec, steps: int
) -> tuple[Any, str]:
    """Build the step at ``batch_size`` under ``torch.device("meta")`` and record it.

    Returns:
        The ``TraceRecording`` and the builder's description of the step.
    """
    import torch  # the caller's builder needs torch anyway; imported here to keep oomkit light

    from oomkit.prediction.tracing import trace_step

    meta = torch.device("meta")
    with meta:
        built = builder(batch_size)
    step_fn, track, description = _unpack_built(built, what, batch_size)

    def step(*_tracked: Any) -> Any:
        # As for `oomkit predict file.py:function`: the step, too, runs with meta as default.
        with meta:
            return step_fn()

    return trace_step(step, *track, steps=steps, gpu=gpu), description


def _predict_built(
    builder: StepBuilder,
    what: str,
    batch_size: int,
    *,
    gpu: GpuSpec,
    config: AllocatorConfig,
    steps: int,
    torch_version: str | None,
) -> Prediction:
    """Build, record and predict the step at ``batch_size`` on ``gpu``."""
    recording, description = _record(builder, what, batch_size, gpu=gpu, steps=steps)
    return predict_recording(
        recording, gpu, config, torch_version=torch_version, description=description
    )


def _less_margin(spec: GpuSpec, margin_bytes: int) -> GpuSpec | None:
    """``spec`` with ``margin_bytes`` less usable memory; ``None`` when nothing would be left."""
    if margin_bytes >= spec.usable_bytes():
        return None
    return replace(spec, context_overhead_bytes=spec.context_overhead_bytes + margin_bytes)


def _train_label(prediction: Prediction) -> str:
    """Which training step limits: the one that would OOM, else the one with the highest peak."""
    step = prediction.oom.step if prediction.oom is not None else prediction.peak_step
    return "before train step 1" if step is None else f"train step {step + 1}"


def _probe_record(
    batch_size: int,
    train: Prediction,
    evaluation: Prediction | None,
    usable_bytes: int,
    *,
    feasible: bool = True,
) -> BatchProbe:
    """A probe from predictions made on the GPU less the margin (``usable_bytes``: without)."""
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
    return BatchProbe(
        batch_size=batch_size,
        fits=train_fits and eval_fits,
        peak_reserved_bytes=demanding.required_bytes,
        peak_allocated_bytes=max(p[0].peak_allocated_bytes for p in parts),
        headroom_bytes=usable_bytes - demanding.required_bytes,
        limiting_step=worst[1],
        train=train,
        eval=evaluation,
    )


class _Prober:
    """Predicts batch sizes once each, counting traces and reporting progress."""

    def __init__(
        self,
        build_step: StepBuilder,
        eval_step: StepBuilder | None,
        *,
        gpu: GpuSpec,
        config: AllocatorConfig,
        steps: int,
        torch_version: str | None,
        usable_bytes: int,
        progress: Progress | None,
    ) -> None:
        self._build_step = build_step
        self._eval_step = eval_step
        self._gpu = gpu
        self._config = config
        self._steps = steps
        self._torch_version = torch_version
        self._usable_bytes = usable_bytes
        self._progress = progress
        self.probes: dict[int, BatchProbe] = {}
        self.order: list[int] = []
        self.traces = 0

    def fits(self, batch_size: int, remaining: int) -> bool:
        """Whether ``batch_size`` fits (predicted once; later calls reuse the result).

        ``remaining`` is how many more probes the search may make after this one, for progress.
        """
        probe = self.probes.get(batch_size)
        if probe is None:
            probe = self._probe(batch_size)
            self.probes[batch_size] = probe
            self.order.append(batch_size)
            if self._progress is not None:
                self._progress(len(self.order), len(self.order) + remaining)
        return probe.fits

    def _probe(self, batch_size: int) -> BatchProbe:
        common = {
            "gpu": self._gpu,
            "config": self._config,
            "torch_version": self._torch_version,
        }
        train = _predict_built(self._build_step, "train step", batch_size, steps=self._steps, **common)
        self.traces += 1
        evaluation = None
        # A batch whose training step does not fit fails whatever its evaluation needs.
        if self._eval_step is not None and train.fits:
            evaluation = _predict_built(self._eval_step, "eval step", batch_size, steps=1, **common)
            self.traces += 1
        return _probe_record(batch_size, train, evaluation, self._usable_bytes)


def _bisect_probes(lo: int, hi: int) -> int:
    """Most probes bisection needs to close the open interval between ``lo`` and ``hi``."""
    return max(0, (hi - lo - 1).bit_length())


def _doubling_probes(batch_size: int, max_batch: int) -> int:
    """Most probes doubling from ``batch_size`` still makes before reaching ``max_batch``."""
    count = 0
    while batch_size < max_batch:
        batch_size = min(2 * batch_size, max_batch)
        count += 1
    return count


def max_batch_size(
    build_step: StepBuilder,
    *,
    gpu: str | GpuSpec = "h100",
    alloc_conf: str | AllocatorConfig | None = None,
    margin_bytes: int | None = None,
    steps: int = 2,
    eval_step: StepBuilder | None = None,
    start_batch: int = 1,
    max_batch: int = 65536,
    context_overhead_bytes: int | None = None,
    torch_version: str | None = None,
    progress: Progress | None = None,
) -> BatchSearchResult:
    """The largest batch size whose step fits on ``gpu``, found by prediction.

    Every probe calls ``build_step(batch_size)`` under ``torch.device("meta")`` and predicts
    the step it returns (``steps`` training steps, then ``eval_step`` alone if given). Sizes are
    tried by doubling from ``start_batch`` until one does not fit (or ``max_batch`` fits), then
    by bisection; each size is predicted at most once. Bisection assumes memory grows with the
    batch; when the curve shows otherwise, the result warns. The answer is always a size that
    was predicted to fit.

    Build the worst case: the longest sequence (largest image) the run will see. ::

        from oomkit.prediction.models import StepOptions, build_preset_step
        result = oomkit.max_batch_size(
            lambda b: build_preset_step("gpt2-124m", StepOptions(batch_size=b, seq_len=1024)),
            gpu="rtx4090",
        )

    Args:
        build_step: batch size -> the training step: a ``BuiltStep``, ``(step_fn,
            objects_to_track)`` or a zero-argument step function. Create the model, optimizer
            and inputs in the builder (they are then on the meta device).
        gpu: a catalog name (``"rtx4090"``), a size (``"24GiB"``) or a ``GpuSpec``.
        alloc_conf: ``PYTORCH_CUDA_ALLOC_CONF`` value to simulate; ``None`` is the default.
        margin_bytes: memory to leave unreserved, in bytes: each size is predicted on the GPU
            with this much less usable memory. ``None`` is ``default_margin_bytes(usable)``: 2%
            of the usable memory, at least 256 MiB.
        steps: training steps to record per probe; 2 covers the first optimizer step (which
            creates the optimizer state) and the steady state after it.
        eval_step: batch size -> an evaluation step, built like ``build_step``; it is predicted
            on its own (one step), so build in it what is alive during evaluation.
        start_batch: the first size tried.
        max_batch: the largest size tried.
        context_overhead_bytes: memory outside the allocator; ``None`` uses the GPU's figure.
        torch_version: the PyTorch version whose allocator to model; ``None`` is the newest.
        progress: called after each new probe with (probes made, probes expected at most).

    Returns:
        The largest fitting batch size, its peaks, the curve of every size tried, and the
        number of traces made.

    Raises:
        NoFeasibleBatchSizeError: not even batch 1 fits with the margin (or the margin is
            not below the usable memory).
        UnknownGpuError: ``gpu`` is neither a catalog GPU nor a size with a unit.
        ConfigError: ``alloc_conf`` is a setting PyTorch would reject.
        UserCodeError: a builder returned something that is not a step.
        UnsupportedOpError: an op of the step cannot run on the meta device.
        ValueError: ``steps``, ``start_batch`` or ``max_batch`` is below 1, ``start_batch``
            is above ``max_batch`` or ``margin_bytes`` is negative.
    """
    _check_positive("steps", steps, "max_batch_size(build, gpu='rtx4090', steps=2)")
    _check_positive("start_batch", start_batch, "max_batch_size(build, gpu='rtx4090', start_batch=8)")
    _check_positive("max_batch", max_batch, "max_batch_size(build, gpu='rtx4090', max_batch=4096)")
    if start_batch > max_batch:
        raise ValueError(
            f"start_batch ({start_batch}) is above max_batch ({max_batch}); lower start_batch or "
            "raise max_batch."
        )
    spec = get_gpu(gpu, context_overhead_bytes=context_overhead_bytes)
    config = AllocatorConfig.coerce(alloc_conf, torch_version)
    usable = spec.usable_bytes()
    margin = _resolve_margin(margin_bytes, usable)
    searched = _less_margin(spec, margin)
    if searched is None:
        raise NoFeasibleBatchSizeError(
            f"nothing fits on {spec.name}: the margin of {format_bytes(margin)} is not below the "
            f"{format_bytes(usable)} usable. Give a smaller margin (margin_bytes, --margin) or a "
            "GPU with more memory."
        )
    prober = _Prober(
        build_step,
        eval_step,
        gpu=searched,
        config=config,
        steps=steps,
        torch_version=torch_version,
        usable_bytes=usable,
        progress=progress,
    )

    # Bracket: double from start_batch until a size does not fit or max_batch fits.
    lo, hi = 0, None  # lo: largest size known to fit (0: none); hi: smallest known not to
    batch = start_batch
    while True:
        if prober.fits(batch, _doubling_probes(batch, max_batch) + (batch - 1).bit_length()):
            lo = batch
            if batch >= max_batch:
                break
            batch = min(2 * batch, max_batch)
        else:
            hi = batch
            break
    # Bisect the open interval (lo, hi).
    while hi is not None and hi - lo > 1:
        mid = (lo + hi) // 2
        if prober.fits(mid, _bisect_probes(lo, hi) - 1):
            lo = mid
        else:
            hi = mid
    if lo == 0:
        raise NoFeasibleBatchSizeError(_infeasible_message(prober.probes[1], spec, margin))
    return _result(prober, lo, hi, spec, config, margin, margin_bytes is None, steps, max_batch)


def _infeasible_message(probe: BatchProbe, spec: GpuSpec, margin: int) -> str:
    return (
        f"not even batch 1 fits on {spec.name}: {probe.limiting_step} needs "
        f"{format_bytes(probe.peak_reserved_bytes)} reserved, and of the "
        f"{format_bytes(spec.usable_bytes())} usable a margin of {format_bytes(margin)} must "
        "stay free. Try a GPU "
        "with more memory (`oomkit fit TARGET --batch 1 --smallest-gpu` names the smallest), "
        "mixed precision (--precision bf16-mixed), activation checkpointing (--checkpointing), "
        "a shorter sequence, an optimizer with less state (sgd), or a smaller margin (--margin)."
    )


def _result(
    prober: _Prober,
    batch_size: int,
    first_failing: int | None,
    spec: GpuSpec,
    config: AllocatorConfig,
    margin: int,
    margin_is_default: bool,
    steps: int,
    max_batch: int,
) -> BatchSearchResult:
    answer = prober.probes[batch_size]
    curve = tuple(prober.probes[b] for b in sorted(prober.probes))
    limiting = answer.limiting_step
    if first_failing is not None:
        limiting = prober.probes[first_failing].limiting_step
    return BatchSearchResult(
        batch_size=batch_size,
        gpu=spec,
        alloc_conf=str(config),
        capacity_bytes=spec.total_memory_bytes,
        context_overhead_bytes=spec.context_overhead_bytes,
        usable_bytes=spec.usable_bytes(),
        margin_bytes=margin,
        margin_is_default=margin_is_default,
        peak_reserved_bytes=answer.peak_reserved_bytes,
        peak_allocated_bytes=answer.peak_allocated_bytes,
        headroom_bytes=answer.headroom_bytes,
        limiting_step=limiting,
        first_failing_batch=first_failing,
        curve=curve,
        probe_order=tuple(prober.order),
        traces=prober.traces,
        steps=steps,
        max_batch=max_batch,
        description=answer.train.description,
        warnings=tuple(_search_warnings(answer, curve, first_failing, max_batch, steps)),
    )


def _dedupe(lines: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(lines))


def _search_warnings(
    answer: BatchProbe,
    curve: Sequence[BatchProbe],
    first_failing: int | None,
    max_batch: int,
    steps: int,
) -> list[str]:
    out = [*answer.train.warnings]
    if answer.eval is not None:
        out.extend(answer.eval.warnings)
    if first_failing is None:
        out.append(
            f"batch {max_batch} (max_batch) fits; the search stopped there: raise max_batch "
            "(--max-batch) to look further"
        )
    if steps < 2:
        out.append(
            "only the first training step was recorded: the steady state (optimizer state alive "
            "while activations are) was not checked; use steps=2 or more"
        )
    # Bisection assumes memory grows with the batch; say so when the curve shows otherwise and
    # a cache flush near the limit (the retries warned about below) does not explain it.
    for smaller, larger in zip(curve, curve[1:], strict=False):
        flushed = larger.train.num_alloc_retries or (larger.eval and larger.eval.num_alloc_retries)
        if larger.peak_reserved_bytes < smaller.peak_reserved_bytes and not flushed:
            out.append(
                f"memory does not grow steadily with batch size here: batch "
                f"{larger.batch_size} needs {format_bytes(larger.peak_reserved_bytes)}, less than "
                f"batch {smaller.batch_size} ({format_bytes(smaller.peak_reserved_bytes)}); "
                "bisection assumes it grows, so a size it skipped may fit too"
            )
            break
    retries = max(
        answer.train.num_alloc_retries, 0 if answer.eval is None else answer.eval.num_alloc_retries
    )
    if retries:
        out.append(
            f"at batch {answer.batch_size} the allocator frees its cache and retries {retries} "
            "time(s) (each cudaFree synchronizes the GPU): it runs close to the limit and slower; "
            "a smaller batch avoids that"
        )
    return _dedupe(out)


# --- the reverse question: the smallest GPU a batch fits on ---------------------------------


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

    Returns:
        Every candidate with its fit and headroom, by total memory, and the smallest fit.

    Raises:
        ValueError: no candidates, a builder without ``batch_size``, or a negative margin.
        UserCodeError: a builder returned something that is not a step.
        ConfigError: ``alloc_conf`` is a setting PyTorch would reject.
    """
    ordered = sorted(candidates, key=lambda g: (g.total_memory_bytes, g.name))
    if not ordered:
        raise ValueError("candidates is empty; pass GPUs to check, e.g. oomkit.core.gpus.CATALOG")
    _check_positive("steps", steps, "smallest_gpu(build, 16, steps=2)")
    config = AllocatorConfig.coerce(alloc_conf, torch_version)
    recording = source if hasattr(source, "events") and hasattr(source, "step_starts") else None
    if recording is None:
        if batch_size is None:
            raise ValueError(
                "smallest_gpu needs batch_size with a step builder; e.g. smallest_gpu(build, 16)"
            )
        _check_positive("batch_size", batch_size, "smallest_gpu(build, 16)")
    # The recording depends on the GPU only through its compute capability (the SDPA backend,
    # the cuBLAS workspace size: tracing/emulations), so trace once per capability.
    recorded: dict[tuple[int, int] | None, tuple[Any, Any, str]] = {}
    traces = 0
    fits: list[GpuFit] = []
    warnings: list[tuple[str, ...]] = []  # per candidate
    description = ""
    for spec in ordered:
        margin = _resolve_margin(margin_bytes, spec.usable_bytes())
        if recording is not None:
            train_recording, eval_recording = recording, None
            described = ""
        else:
            assert batch_size is not None
            key = spec.compute_capability
            if key not in recorded:
                first, described = _record(source, "train step", batch_size, gpu=spec, steps=steps)
                second = None
                if eval_step is not None:
                    second, _ = _record(eval_step, "eval step", batch_size, gpu=spec, steps=1)
                recorded[key] = (first, second, described)
                traces += 1 + (second is not None)
            train_recording, eval_recording, described = recorded[key]
        # Replayed on the GPU less the margin; a margin that leaves nothing fails outright.
        searched = _less_margin(spec, margin)
        target = spec if searched is None else searched
        train = predict_recording(
            train_recording, target, config, torch_version=torch_version, description=described
        )
        evaluation = None
        if eval_recording is not None:
            evaluation = predict_recording(eval_recording, target, config, torch_version=torch_version)
        probe = _probe_record(
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
        warnings=tuple(_dedupe(warnings[shown])),
    )

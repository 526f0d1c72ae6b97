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

What does not depend on the batch is not redone per probe: the presets and Hugging Face models
a builder makes (``build_preset_step``, ``build_hf_step``) are built once per search and shared
by its probes (``oomkit.prediction.models.model_cache``: each probe still gets a new optimizer,
new inputs and no ``.grad``), and the meta-kernel memo (``prediction/tracing/meta_memo.py``)
answers the ops an earlier probe ran on the same shapes. Most sizes are not traced at all: once
two traced sizes next to one another recorded the same events with sizes affine in the batch,
the recording of a size beside them is synthesized and replayed (``trace_interpolation.py``).
The sizes the answer rests on are traced: the last size bisection tries and ``max_batch`` at
once, the answer and the size above it, if synthesized, to confirm them. Each such trace is
compared with its synthesis, recording for recording (the check a third learned size would
make); a difference runs the search again, learning from those traces too, and the third
search traces every size. ``interpolate=False`` traces every size. While a search runs, the
objects earlier probes made are kept out of Python's garbage collections (``frozen_heap.py``).

``smallest_gpu`` (smallest_gpu.py) answers the reverse question: for one batch, which catalog
GPUs it fits on and the smallest of them; ``batch_probe.py`` holds what both repeat per batch
size. Their names are importable from here too.

The worst case is the caller's to build: the builder should make the longest sequence (largest
image) the training will see; ``oomkit fit`` passes ``--seq`` as that maximum.

This module never imports torch at import time; a probe imports ``oomkit.prediction.tracing`` when it runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from oomkit.core.gpus import GpuSpec
from oomkit.core.target import Target
from oomkit.core.trace.step_count import check_step_count
from oomkit.errors import ConfigError, NoFeasibleBatchSizeError
from oomkit.executors.forked import process_count
from oomkit.plan._batch_grid import Grid, grid_words, search_grid
from oomkit.plan.batch_advice import infeasible_advice, infeasible_error
from oomkit.plan.batch_probe import (
    DEFAULT_MARGIN_FRACTION,
    MIN_DEFAULT_MARGIN_BYTES,
    BatchProbe,
    Progress,
    StepBuilder,
    check_positive,
    dedupe,
    default_margin_bytes,
    less_margin,
    resolve_margin,
)
from oomkit.plan.batch_prober import BatchProber
from oomkit.plan.frozen_heap import frozen_heap
from oomkit.plan.smallest_gpu import GpuFit, SmallestGpuResult, smallest_gpu
from oomkit.plan.trace_interpolation import INTERPOLATED_SEARCHES
from oomkit.units import format_bytes

__all__ = [
    "DEFAULT_MARGIN_FRACTION",
    "MIN_DEFAULT_MARGIN_BYTES",
    "BatchProbe",
    "BatchSearchResult",
    "GpuFit",
    "SmallestGpuResult",
    "default_margin_bytes",
    "infeasible_advice",
    "max_batch_warning",
    "max_batch_size",
    "smallest_gpu",
]


@dataclass(frozen=True)
class BatchSearchResult:
    """The largest batch that fits on one GPU, and how it was found.

    Attributes:
        batch_size: the largest batch size found to fit (with the margin).
        gpu: the device searched for.
        alloc_conf: the ``PYTORCH_CUDA_ALLOC_CONF`` simulated, canonical (``""`` = default).
        capacity_bytes: the device's total memory.
        context_overhead_bytes: memory held outside the allocator (CUDA context).
        usable_bytes: what the allocator may reserve at ``batch_size``: ``capacity_bytes -
            context_overhead_bytes``, less a layout's NCCL buffers (``BatchProbe.usable_bytes``).
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
        traces: recordings traced for real (each replayed; training and evaluation count one
            each), confirmations of synthesized probes included.
        synthesized: recordings synthesized from traced ones and replayed instead of traced
            (``interpolate``; not in ``traces``); the probes they made are marked
            ``BatchProbe.synthesized``. The answer and the first failing batch never are.
        unused_ahead: training steps started ahead in forked processes (``jobs``, the one in
            the background included) that the search did not need (stopped or thrown away;
            not in ``traces``).
        steps: training steps recorded per prediction.
        max_batch: the largest batch the search would try.
        description: what was searched ("GPT-2 124M, batch 12, ...", at the answer).
        warnings: what the predictions do not model, and what the search noticed.
        target: the machine searched for (``gpu``, ``alloc_conf`` are its parts), without the
            margin.
        with_retries_batch_size: a larger batch that fits only with the allocator freeing its
            cache and retrying (``num_alloc_retries``: CUDACachingAllocator.cpp malloc,
            ``release_cached_blocks`` then a second cudaMalloc; each cudaFree synchronizes the
            device); ``None`` when the answer is the largest that fits at all.
        with_retries_count: the retries at ``with_retries_batch_size`` (0 when it is None).
        non_monotonic: ``(fits, fails)``: a batch that fits above a smaller one that does not,
            from the sizes tried; ``None`` when the curve is monotonic. The verdict explains it.
        multiple_of: every size tried is a multiple of this (``None``: any size).
        power_of_two: every size tried is a power of two (times ``multiple_of``).
        memory_stops_growing_at: a batch from which every larger one allocated exactly the
            same (a script whose loader never makes a larger batch: a dataset of at most that
            many examples); the search stopped there, and it is the answer when it fits.
            ``None``: not seen.
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
    target: Target | None = None
    synthesized: int = 0
    unused_ahead: int = 0
    with_retries_batch_size: int | None = None
    with_retries_count: int = 0
    non_monotonic: tuple[int, int] | None = None
    multiple_of: int | None = None
    power_of_two: bool = False
    memory_stops_growing_at: int | None = None

    @property
    def answer(self) -> BatchProbe:
        """The probe at ``batch_size``."""
        return next(p for p in self.curve if p.batch_size == self.batch_size)


# Searches with interpolation before one with traces only (a name of its own: tests lower it).
_SEARCHES = INTERPOLATED_SEARCHES


def _search(
    prober: BatchProber, start_batch: int, max_batch: int, grid: Grid | None = None
) -> tuple[int, int | None]:
    """(largest size found to fit, 0 for none; smallest found not to, None for none).

    ``start_batch`` and ``max_batch`` are indices of ``grid`` (sizes themselves for the plain
    grid); so are the two returned.
    """
    grid = grid or Grid()
    # Bracket: double from start_batch until a size does not fit or max_batch fits.
    lo, hi = 0, None  # lo: largest size known to fit (0: none); hi: smallest known not to
    batch = start_batch
    while True:
        # max_batch, when it fits, is the answer: traced straight away, like the last size
        # bisection tries (below).
        remaining = _doubling_probes(batch, max_batch) + (batch - 1).bit_length()
        if batch < max_batch and (not prober.interpolating or not prober.traced_any):
            # The next size is traced too if this one fits: every size without interpolation,
            # and the second of the two sizes it learns from with it.
            prober.trace_ahead([grid.size(min(2 * batch, max_batch))])
        if prober.fits(grid.size(batch), remaining, synthesize=batch < max_batch):
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
        # The last size bisection tries becomes the answer or the size above it: traced
        # straight away, as confirming a synthesized one would trace it anyway; the size on
        # either side of it is confirmed next, so both are traced ahead meanwhile.
        last = hi - lo <= 2
        if (
            last
            and prober.traces_ahead
            and prober.interpolating
            and not prober.traced(grid.size(mid))
        ):
            # Whichever of the two the synthesis of mid says the answer needs, first.
            pair = [hi, lo] if prober.likely_fits(grid.size(mid)) else [lo, hi]
            prober.trace_ahead(grid.size(b) for b in pair if b)
        if prober.fits(grid.size(mid), _bisect_probes(lo, hi) - 1, synthesize=not last):
            lo = mid
        else:
            hi = mid
    return lo, hi


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


def _retries(probe: BatchProbe) -> int:
    """The allocator's free-cache-and-retry count of the probe's most retrying part."""
    return max(probe.train.num_alloc_retries, probe.eval.num_alloc_retries if probe.eval else 0)


def _without_retries(prober: BatchProber, lo: int, grid: Grid) -> int:
    """The largest index at most ``lo`` whose size fits with no allocator retry (0: none).

    Retries grow with the batch near the limit, so the clean sizes are bisected for between
    the largest clean size tried below ``lo`` and ``lo``; each size traced, as an answer is.
    """

    def clean(index: int) -> bool:
        probe = prober.probes[grid.size(index)]
        return probe.fits and _retries(probe) == 0

    if clean(lo):
        return lo
    on_grid = [grid.index_at_most(b) for b in prober.probes]
    tried = [i for i in on_grid if 0 < i < lo and grid.size(i) in prober.probes]
    low = max((i for i in tried if clean(i)), default=0)
    high = lo
    while high - low > 1:
        mid = (low + high) // 2
        prober.fits(grid.size(mid), _bisect_probes(low, high) - 1, synthesize=False)
        if clean(mid):
            low = mid
        else:
            high = mid
    return low


def _non_monotonic(curve: Sequence[BatchProbe]) -> tuple[int, int] | None:
    """``(fits, fails)``: the largest batch that fits above a smaller one that does not."""
    failing = [p.batch_size for p in curve if not p.fits]
    for probe in reversed(curve):
        below = [b for b in failing if b < probe.batch_size]
        if probe.fits and below:
            return probe.batch_size, min(below)
    return None


def max_batch_size(
    build_step: StepBuilder,
    *,
    target: Target | None = None,
    margin_bytes: int | None = None,
    steps: int = 2,
    eval_step: StepBuilder | None = None,
    start_batch: int = 1,
    max_batch: int = 65536,
    progress: Progress | None = None,
    interpolate: bool = True,
    jobs: int | None = 1,
    multiple_of: int | None = None,
    power_of_two: bool = False,
    allow_retries: bool = False,
) -> BatchSearchResult:
    """The largest batch size whose step fits on ``target``'s GPU, found by prediction.

    Every probe calls ``build_step(batch_size)`` under ``torch.device("meta")`` and predicts
    the step it returns (``steps`` training steps, then ``eval_step`` alone if given). Sizes are
    tried by doubling from ``start_batch`` until one does not fit (or ``max_batch`` fits), then
    by bisection; each size is predicted at most once (an interpolated one traced once more to
    confirm it). Bisection assumes memory grows with the
    batch; when the curve shows otherwise, the result warns. The answer is always a size that
    was predicted to fit. A preset or Hugging Face model the builder makes is built once for
    the whole search and shared by its probes (``oomkit.prediction.models.model_cache``).

    Build the worst case: the longest sequence (largest image) the run will see. ::

        from oomkit.prediction.models import StepOptions, build_preset_step
        result = oomkit.max_batch_size(
            lambda b: build_preset_step("gpt2-124m", StepOptions(batch_size=b, seq_len=1024)),
            target=Target.resolve("rtx4090"),
        )

    Args:
        build_step: batch size -> the training step: a ``BuiltStep``, ``(step_fn,
            objects_to_track)`` or a zero-argument step function. Create the model, optimizer
            and inputs in the builder (they are then on the meta device).
        target: the GPU, allocator setting and versions
            (``Target.resolve("rtx4090", alloc_conf=...)``); ``None`` is
            ``Target.resolve("h100")``: an H100, PyTorch's default allocator setting, the
            newest torch release. Its cuDNN version, when stated, picks the SDPA backend.
        margin_bytes: memory to leave unreserved, in bytes: each size is predicted on the GPU
            with this much less usable memory. ``None`` is ``default_margin_bytes(usable)``: 2%
            of the usable memory, at least 256 MiB.
        steps: training steps to record per probe; 2 covers the first optimizer step (which
            creates the optimizer state) and the steady state after it.
        eval_step: batch size -> an evaluation step, built like ``build_step``; it is predicted
            on its own (one step), so build in it what is alive during evaluation.
        start_batch: the first size tried.
        max_batch: the largest size tried.
        progress: called after each new probe with (probes made, probes expected at most).
        interpolate: once two traced sizes next to one another recorded one step structure
            with sizes affine in the batch, synthesize the recordings of sizes beside them
            instead of tracing them (``trace_interpolation.py``); the last size bisection
            tries, and the answer and the size above it, are traced for real, and if one
            recording differs from its synthesis the search runs again (learning from them;
            the third search traces every size). An emulated kernel that picks its path by a
            size (the embedding backward above 3,072 indices) is synthesized on either path
            from sizes on one (``oomkit.prediction.tracing.emulation_sites``). ``False``
            traces every size.
        jobs: processes that trace at once (None: one per CPU core; 1, the default: all in
            this one). Above 1, the training step of sizes the search will trace next is
            traced ahead in forked processes (the second size learned from, the other sizes an
            answer rests on; without ``interpolate``, the next size doubling tries): the
            answer, every probe and ``traces`` are the one-at-a-time ones, in less wall time.
            One more process, at the lowest CPU priority, also traces the first size the
            search synthesizes, the first a search after a difference traces, on the core
            left idle while the search synthesizes. The builder then runs in those
            processes too (a builder with side effects outside its process, such as files it
            writes, should keep 1).
        multiple_of: try only multiples of this (``8``: tensor-core friendly sizes, or the
            data-parallel degree); ``None``: any size. ``start_batch`` is rounded up to one.
        power_of_two: try only powers of two (times ``multiple_of``, which must then be a power
            of two too).
        allow_retries: answer the largest batch that fits even when the allocator must free
            its cache and retry to serve it (``num_alloc_retries``; each cudaFree synchronizes
            the GPU, so such a run is slower and one step from an OOM). Default: the largest
            that fits without, the larger one with retries given as
            ``with_retries_batch_size``.

    Returns:
        The largest fitting batch size, its peaks, the curve of every size tried, and the
        number of traces made and of recordings synthesized.

    Raises:
        NoFeasibleBatchSizeError: not even batch 1 fits with the margin (or the default
            margin is not below the usable memory).
        UserCodeError: a builder returned something that is not a step.
        UnsupportedOpError: an op of the step cannot run on the meta device.
        ValueError: ``steps``, ``start_batch`` or ``max_batch`` is below 1, ``start_batch``
            is above ``max_batch``, or a given ``margin_bytes`` is negative or not below the
            usable memory (``ConfigError``); ``jobs`` is not a positive int or None
            (``AllocatorUsageError``).
    """
    check_step_count(steps, "max_batch_size(build, target=target, steps=2)")
    check_positive("start_batch", start_batch, "max_batch_size(build, target=target, start_batch=8)")
    check_positive("max_batch", max_batch, "max_batch_size(build, target=target, max_batch=4096)")
    processes = process_count(jobs)
    grid = search_grid(multiple_of, power_of_two)
    if start_batch > max_batch:
        raise ConfigError(
            f"start_batch ({start_batch}) is above max_batch ({max_batch}); lower start_batch or "
            "raise max_batch."
        )
    if target is None:
        target = Target.resolve("h100")
    spec = target.gpu
    usable = target.usable_bytes
    margin = resolve_margin(margin_bytes, usable, spec.name)
    searched = less_margin(target, margin)
    if searched is None:
        raise NoFeasibleBatchSizeError(
            f"nothing fits on {spec.name}: the margin of {format_bytes(margin)} is not below the "
            f"{format_bytes(usable)} usable. Give a smaller margin (margin_bytes, --margin) or a "
            "GPU with more memory.",
            usable_bytes=usable,
            margin_bytes=margin,
        )
    prober = BatchProber(
        build_step,
        eval_step,
        target=searched,
        steps=steps,
        usable_bytes=usable,
        progress=progress,
        interpolate=interpolate,
        jobs=processes,
    )

    first_index, last_index = grid.index_at_least(start_batch), grid.index_at_most(max_batch)
    if first_index > last_index:
        raise ConfigError(
            f"no size from start_batch {start_batch} to max_batch {max_batch} is "
            f"{grid_words(grid)}; raise max_batch"
        )
    with frozen_heap() as prober.freeze:
        try:
            lo, hi = _search(prober, first_index, last_index, grid)
            # The answer rests on lo fitting and hi not: trace them if they were synthesized.
            # Where a traced recording is not the synthesized one, search again, learning from
            # it too; after _SEARCHES searches, with traces only.
            searches = 1
            while prober.interpolating and not prober.confirm([b for b in (lo, hi) if b]):
                searches += 1
                if searches < _SEARCHES:
                    prober.forget_synthesized()
                else:
                    prober.fall_back()
                lo, hi = _search(prober, first_index, last_index, grid)
            clean = lo if allow_retries or lo == 0 else _without_retries(prober, lo, grid)
            if clean and clean != lo:
                # The answer is traced, as every answer is: a synthesized clean size is traced,
                # and the clean sizes searched again below it if the trace retries after all.
                prober.confirm([grid.size(clean)])
                clean = _without_retries(prober, clean, grid)
        finally:
            prober.stop_ahead()
    prober.close()
    if lo == 0:  # the bisection reached the grid's first size: "not even" that one fits
        smallest = prober.probes[min(prober.probes)]
        raise infeasible_error(smallest, spec, margin)
    # With every fitting size retrying, the answer is the largest that fits, and says so.
    answer = clean or lo
    result = _result(
        prober, grid.size(answer), None if hi is None else grid.size(hi), target, margin,
        margin_bytes is None, steps, max_batch,
    )
    larger = grid.size(lo) if answer != lo else None
    return dataclasses.replace(
        result,
        with_retries_batch_size=larger,
        with_retries_count=0 if larger is None else _retries(prober.probes[larger]),
        non_monotonic=_non_monotonic(result.curve),
        multiple_of=multiple_of,
        power_of_two=bool(power_of_two),
        warnings=tuple(dedupe([*result.warnings, *_grid_warnings(result, larger, prober, grid)])),
    )


def _grid_warnings(
    result: BatchSearchResult, larger: int | None, prober: BatchProber, grid: Grid
) -> list[str]:
    out = []
    if larger is not None:
        out.append(
            f"batch {larger} fits too, but only with the allocator freeing its cache and "
            f"retrying {_retries(prober.probes[larger])} time(s) (each cudaFree synchronizes the "
            f"GPU: slower, and one step from an OOM); {result.batch_size} is the largest without"
        )
    pair = _non_monotonic(result.curve)
    if pair is not None:
        fits, fails = pair
        out.append(
            f"the curve is not monotonic: batch {fits} fits but the smaller batch {fails} does "
            "not. The caching allocator's placement changes with the request sizes (requests "
            "under 1 MiB share 2 MiB segments, under 10 MiB 20 MiB ones, larger ones are rounded "
            "to 2 MiB: CUDACachingAllocator.cpp get_allocation_size), and so does the cache it "
            "can free: a size can fit where a smaller one fragments. The answer is the largest "
            "size tried that fits"
        )
    return out


def _result(
    prober: BatchProber,
    batch_size: int,
    first_failing: int | None,
    target: Target,
    margin: int,
    margin_is_default: bool,
    steps: int,
    max_batch: int,
) -> BatchSearchResult:
    answer = prober.probes[batch_size]
    # The sizes of the last search (confirmations of an earlier one's answer it did not try
    # are left out: traced, but not part of this search).
    curve = tuple(prober.probes[b] for b in sorted(prober.order))
    limiting = answer.limiting_step
    if first_failing is not None:
        limiting = prober.probes[first_failing].limiting_step
    spec = target.gpu
    return BatchSearchResult(
        batch_size=batch_size,
        gpu=spec,
        alloc_conf=target.alloc_conf,
        capacity_bytes=spec.total_memory_bytes,
        context_overhead_bytes=spec.context_overhead_bytes,
        usable_bytes=answer.usable_bytes,
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
        synthesized=prober.synthesized,
        unused_ahead=prober.unused_ahead,
        steps=steps,
        max_batch=max_batch,
        description=answer.train.description,
        warnings=tuple(_search_warnings(answer, curve, first_failing, max_batch, steps)),
        target=target,
    )


def max_batch_warning(max_batch: int) -> str:
    """What a search that stopped at ``max_batch`` (it fits) warns."""
    return (
        f"batch {max_batch} (max_batch) fits; the search stopped there: raise max_batch "
        "(--max-batch) to look further"
    )


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
        out.append(max_batch_warning(max_batch))
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
    return dedupe(out)

"""Predict a step's peak GPU memory on a named GPU, without a GPU.

``predict_recording`` replays a ``TraceRecording`` (from ``oomkit.prediction.tracing``) through the
simulated caching allocator of that GPU: capacity is the device's total memory as PyTorch sees
it, and the CUDA context is held outside the allocator, as on a real device. ``predict`` records
the step first (``trace_step`` on the meta device) and then does the same.

This module never imports torch itself; ``predict`` imports ``oomkit.prediction.tracing`` when called.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from oomkit.core.allocator.constants import UNLIMITED_CAPACITY_BYTES
from oomkit.core.gpus import GpuSpec
from oomkit.core.target import Target
from oomkit.core.trace.step_count import check_step_count
from oomkit.errors import ConfigError, UserCodeError
from oomkit.prediction._replay import (
    MAX_TIMELINE_POINTS,
    StepPeak,
    TimelinePoint,
    category_levels,
    live_breakdown,
    replay_for_prediction,
    step_of,
)
from oomkit.prediction.distributed_memory import DistributedMemory, distributed_memory, nccl_of
from oomkit.prediction.summary import prediction_summary, verdict_line
from oomkit.prediction.workload import WorkloadSpec
from oomkit.units import format_bytes

if TYPE_CHECKING:  # oomkit.prediction.tracing imports torch
    from oomkit.prediction.tracing import TraceRecording

__all__ = [
    "MAX_TIMELINE_POINTS",
    "TOP_MODULES",
    "OomPoint",
    "PeakBreakdown",
    "Prediction",
    "StepPeak",
    "TimelinePoint",
    "predict",
    "predict_recording",
]

# How many modules a breakdown lists (the largest by live bytes).
TOP_MODULES = 10


@dataclass(frozen=True)
class OomPoint:
    """Where a step would run out of memory.

    Attributes:
        event_index: the failing alloc's index in the recording's events.
        step: the step it belongs to, counted from 1 (the first recorded step is step 1);
            ``None`` before the first step.
        op: the aten op that allocated (``aten.mm.default``), if known.
        module: the module path it ran in (``transformer.h.3.attn``; ``""`` is the root
            module); ``None`` outside any module.
        category: the allocation's category (``activation``, ``gradient``...).
        requested_bytes: the request, unrounded.
        message: PyTorch's ``torch.OutOfMemoryError`` text for this device.
        frame: the user's own source line that triggered it (``file.py:12 in step``), if known.
        phase: where the step was (``forward``, ``backward``, ``optimizer``; ``user`` outside
            any module, backward or optimizer step), if recorded (the tracer's ``phase`` tag).
        parameter: for a gradient or optimizer state, the parameter it serves, in full
            (``layers.7.mlp.gate_proj.weight``).
        optimizer: for optimizer state, the optimizer's class (``AdamW``).
    """

    event_index: int
    step: int | None
    op: str | None
    module: str | None
    category: str | None
    requested_bytes: int
    message: str
    frame: str | None = None
    phase: str | None = None
    parameter: str | None = None
    optimizer: str | None = None


@dataclass(frozen=True)
class PeakBreakdown:
    """What was allocated at one moment of the step.

    Attributes:
        event_index: the moment (index into the recording's events); ``None`` before any.
        step: its step, counted from 1; ``None`` before the first step.
        allocated_bytes: allocated bytes then (block sizes, as ``memory_allocated()``).
        reserved_bytes: reserved bytes then (as ``memory_reserved()``).
        by_category_bytes: allocated bytes by category, largest first; sums to
            ``allocated_bytes``.
        top_modules: the ``TOP_MODULES`` largest ``(module path, bytes)``, largest first.
        unattributed_bytes: allocated bytes made outside any module (parameters and inputs
            tracked before the step, gradients, optimizer state, loss scalars).
        modules: every module's ``(path, bytes)``, largest first, ties in numeric path order
            (``h.2`` before ``h.10``); ``top_modules`` is its head. Reports merge repeated layers
            with ``oomkit.prediction.module_groups.group_modules``.
        by_stream_category_bytes: allocated bytes by the CUDA stream each block was allocated
            on, then by category (stream 0: the default stream; FSDP2's all-gather and
            reduce-scatter streams are 1, 2, ... in the order the recording first used them).
    """

    event_index: int | None
    step: int | None
    allocated_bytes: int
    reserved_bytes: int
    by_category_bytes: Mapping[str, int]
    top_modules: tuple[tuple[str, int], ...]
    unattributed_bytes: int
    modules: tuple[tuple[str, int], ...] = ()
    by_stream_category_bytes: Mapping[int, Mapping[str, int]] = field(default_factory=dict)


@dataclass(frozen=True, repr=False)
class Prediction:
    """A step's predicted memory on one GPU under one allocator setting.

    Attributes:
        gpu: the device predicted for (its ``context_overhead_bytes`` is the one used).
        alloc_conf: the ``PYTORCH_CUDA_ALLOC_CONF`` simulated, canonical (``""`` = default).
        torch_version: the PyTorch version whose allocator was modelled; ``None`` = newest.
        capacity_bytes: the device's total memory (``cudaMemGetInfo`` total).
        context_overhead_bytes: memory held outside the allocator (CUDA context, kernels).
        usable_bytes: ``capacity_bytes - context_overhead_bytes``: the most it may reserve.
        peak_allocated_bytes: highest ``memory_allocated()`` (up to the OOM, if any).
        peak_reserved_bytes: highest ``memory_reserved()`` (up to the OOM, if any).
        required_bytes: reserved memory the step needs under this setting: the peak reserved
            when it fits; when it does not, the peak reserved of the same replay on a device
            with unlimited memory (an upper bound: near capacity the allocator frees its cache
            and retries, so somewhat less may do).
        fits: the step ran every recorded step without an OOM.
        headroom_bytes: ``usable_bytes - required_bytes``; negative when it does not fit.
        by_category_bytes: allocated bytes by category at the peak-allocated moment.
        top_modules: the largest modules at the peak-allocated moment.
        peak_allocated_at: the full breakdown at the peak-allocated moment.
        peak_reserved_at: the full breakdown at the peak-reserved moment.
        peak_step: the step in which reserved memory peaked, counted from 1 (``None``: before
            the first step).
        oom: where it would run out of memory, or ``None``.
        steps: how many steps were recorded.
        step_starts: index of each step's first event.
        step_peaks: peak allocated and reserved of each step (up to the OOM).
        events: events replayed (up to and including an OOM).
        num_device_alloc: cudaMalloc calls. num_device_free: cudaFree calls.
        num_alloc_retries: allocations that freed the cache and retried.
        timeline: at most ``MAX_TIMELINE_POINTS`` points, each the maximum of a run of events.
        warnings: the recording's warnings (what is not emulated), then the prediction's.
        budget_bytes: a limit on peak reserved set by the caller (``--budget``), or ``None``.
        within_budget: ``fits`` and ``required_bytes <= budget_bytes``; ``None`` without one.
        description: what was predicted ("GPT-2 124M, batch 8, ..."), for reports.
        kernel_choices: the CUDA kernels the recording assumed for the GPU, with call counts
            (``{"SDPA flash_attention": 24}``).
        assumptions: facts about the target those choices rest on (``{"cuDNN": "9.20.0
            (torch 2.13's default Linux wheel)"}``), from the recording.
        target: the machine predicted for (``gpu``, ``alloc_conf`` and ``torch_version`` are
            its parts); ``predict`` fills in the cuDNN version the step was traced with.
        workload: what was recorded (batch size, mode, optimizer...), when the caller said.
        scenario: the request that made it, as plain data (``oomkit.scenario``'s JSON form),
            when it was predicted from a scenario; saved with ``--json`` so that ``explain``
            re-predicts from it.
        distributed: NCCL's buffers (also out of ``usable_bytes``) and the timing range; multi-GPU.
        rank_peaks: with ``--all-ranks``, each distinct rank's peaks and ``fits`` (this record
            is the rank that peaks: ``oomkit.scenario.ranks``); else empty.
    """

    gpu: GpuSpec
    alloc_conf: str
    torch_version: str | None
    capacity_bytes: int
    context_overhead_bytes: int
    usable_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    required_bytes: int
    fits: bool
    headroom_bytes: int
    by_category_bytes: Mapping[str, int]
    top_modules: tuple[tuple[str, int], ...]
    peak_allocated_at: PeakBreakdown
    peak_reserved_at: PeakBreakdown
    peak_step: int | None
    oom: OomPoint | None
    steps: int
    step_starts: tuple[int, ...]
    step_peaks: tuple[StepPeak, ...]
    events: int
    num_device_alloc: int
    num_device_free: int
    num_alloc_retries: int
    timeline: tuple[TimelinePoint, ...]
    warnings: tuple[str, ...]
    budget_bytes: int | None = None
    within_budget: bool | None = None
    description: str = ""
    kernel_choices: Mapping[str, int] = field(default_factory=dict)
    assumptions: Mapping[str, str] = field(default_factory=dict)
    target: Target | None = None
    workload: WorkloadSpec | None = None
    scenario: Mapping[str, Any] | None = None
    distributed: DistributedMemory | None = None
    rank_peaks: tuple[Mapping[str, Any], ...] = ()

    def __str__(self) -> str:
        """The verdict and the top lines (``print(oomkit.predict(...))``): what the step is,
        the verdict, the largest categories and modules at the peak, the warnings. The full
        reports are ``oomkit.render_prediction`` (terminal) and ``oomkit.prediction_to_json``."""
        return prediction_summary(self)

    def __repr__(self) -> str:
        """``<Prediction: fits on RTX 4090: peak reserved 9.71 GiB of ...>``: the verdict; the
        fields are attributes, ``str()`` gives the summary."""
        return f"<Prediction: {verdict_line(self)}>"


def predict_recording(
    recording: TraceRecording,
    *,
    target: Target | None = None,
    budget_bytes: int | None = None,
    description: str = "",
    workload: WorkloadSpec | None = None,
) -> Prediction:
    """Replay a recorded step through the caching allocator of ``target``'s GPU.

    Args:
        recording: what ``oomkit.prediction.tracing.trace_step`` returned (or any object with
            ``events``, ``step_starts`` and ``warnings``).
        target: the GPU, allocator setting and versions
            (``Target.resolve("rtx4090", alloc_conf=...)``); ``None`` is
            ``Target.resolve("h100")``: an H100, PyTorch's default allocator setting, the
            newest torch release.
        budget_bytes: a limit on reserved memory to check (``--budget``), in bytes.
        description: what was recorded, carried into the result for reports.
        workload: what was recorded, as data, carried into the result.

    Returns:
        The prediction.

    Raises:
        TraceFormatError: the recording frees an allocation it never made.
    """
    if target is None:
        target = Target.resolve("h100")
    spec, config, torch_version = target.gpu, target.allocator_config, target.torch_version
    events = recording.events
    step_starts = tuple(recording.step_starts)
    nccl, nccl_bytes = nccl_of(target, recording)  # NCCL's (+ async TP's): outside the allocator
    replay = replay_for_prediction(
        events,
        step_starts,
        config,
        capacity_bytes=spec.total_memory_bytes,
        reserved_outside_bytes=spec.context_overhead_bytes + nccl_bytes,
        torch_version=torch_version,
        memory_fraction=recording.memory_fraction,
    )
    usable = replay.usable_bytes(spec.usable_bytes() - nccl_bytes)
    at_alloc = _breakdown(
        events,
        step_starts,
        replay.block_bytes,
        replay.peak_allocated_index,
        reserved_bytes=replay.reserved_at_peak_allocated_bytes,
    )
    at_reserved = _breakdown(
        events,
        step_starts,
        replay.block_bytes,
        replay.peak_reserved_index,
        reserved_bytes=replay.peak_reserved_bytes,
    )
    oom = None
    required = replay.peak_reserved_bytes
    if replay.oom_index is not None:
        oom = _oom_point(events, step_starts, replay.oom_index, replay.oom_error)
        unlimited = replay_for_prediction(
            events,
            step_starts,
            config,
            capacity_bytes=UNLIMITED_CAPACITY_BYTES,
            reserved_outside_bytes=0,
            torch_version=torch_version,
            max_points=1,
        )
        required = unlimited.peak_reserved_bytes
    fits = oom is None
    within_budget = None
    if budget_bytes is not None:
        within_budget = fits and required <= budget_bytes
    warnings = [
        *target.warnings,
        *recording.warnings,
        *_warnings(events, replay.block_bytes, replay.step_peaks, fits),
    ]
    peak_allocated = replay.peak_allocated_bytes
    return Prediction(
        gpu=spec,
        alloc_conf=str(config),
        torch_version=torch_version,
        capacity_bytes=spec.total_memory_bytes,
        context_overhead_bytes=spec.context_overhead_bytes,
        usable_bytes=usable,
        peak_allocated_bytes=replay.peak_allocated_bytes,
        peak_reserved_bytes=replay.peak_reserved_bytes,
        required_bytes=required,
        fits=fits,
        headroom_bytes=usable - required,
        by_category_bytes=at_alloc.by_category_bytes,
        top_modules=at_alloc.top_modules,
        peak_allocated_at=at_alloc,
        peak_reserved_at=at_reserved,
        peak_step=at_reserved.step,
        oom=oom,
        steps=len(step_starts),
        step_starts=step_starts,
        step_peaks=tuple(replay.step_peaks),
        events=replay.events if replay.oom_index is None else replay.oom_index + 1,
        num_device_alloc=replay.num_device_alloc,
        num_device_free=replay.num_device_free,
        num_alloc_retries=replay.num_alloc_retries,
        timeline=tuple(
            category_levels(events, replay.block_bytes, replay.timeline, step_starts)
        ),
        warnings=tuple(warnings),
        budget_bytes=budget_bytes,
        within_budget=within_budget,
        description=description,
        kernel_choices=dict(recording.kernel_choices),
        assumptions=dict(recording.assumptions),
        target=target,
        workload=workload,
        distributed=distributed_memory(recording, target, nccl, required, peak_allocated, usable),
    )


def _breakdown(
    events: Sequence[Any],
    step_starts: Sequence[int],
    block_bytes: dict[int, int],
    index: int | None,
    *,
    reserved_bytes: int,
) -> PeakBreakdown:
    live = live_breakdown(events, block_bytes, index)
    return PeakBreakdown(
        event_index=index,
        step=None if index is None else step_of(step_starts, index),
        allocated_bytes=sum(live.by_category_bytes.values()),
        reserved_bytes=reserved_bytes,
        by_category_bytes=live.by_category_bytes,
        top_modules=tuple(list(live.by_module_bytes.items())[:TOP_MODULES]),
        unattributed_bytes=live.unattributed_bytes,
        modules=tuple(live.by_module_bytes.items()),
        by_stream_category_bytes=live.by_stream_category_bytes,
    )


def _oom_point(
    events: Sequence[Any], step_starts: Sequence[int], index: int, error: Any
) -> OomPoint:
    event = events[index]
    tags = dict(event.tags)
    frame = None
    if event.frames:
        f = event.frames[0]
        frame = f"{f.filename}:{f.line} in {f.name}"
    return OomPoint(
        event_index=index,
        step=step_of(step_starts, index),
        op=tags.get("op"),
        module=tags.get("module"),
        category=tags.get("category"),
        requested_bytes=event.size,
        message=str(error),
        frame=frame,
        phase=tags.get("phase"),
        parameter=_parameter_path(tags.get("module"), tags.get("parameter")),
        optimizer=tags.get("optimizer"),
    )


def _parameter_path(module: str | None, name: str | None) -> str | None:
    """``layers.7.mlp.gate_proj`` + ``weight`` -> ``layers.7.mlp.gate_proj.weight``."""
    if name is None:
        return None
    return f"{module}.{name}" if module else name


def _warnings(
    events: Sequence[Any],
    block_bytes: Mapping[int, int],
    step_peaks: Sequence[StepPeak],
    fits: bool,
) -> list[str]:
    out = []
    if not any(e.action == "alloc" and e.size > 0 for e in events):
        out.append(
            "the recording holds no device allocations: check that the step creates its tensors "
            "on the meta device (oomkit runs it under torch.device('meta'))"
        )
    if fits and len(step_peaks) >= 2:
        last, before = step_peaks[-1], step_peaks[-2]
        once = _made_once_bytes(
            events, block_bytes, before.first_event_index, last.first_event_index
        )
        grew_bytes = last.peak_allocated_bytes - before.peak_allocated_bytes
        # Optimizer state made by the first optimizer step (Adam's exp_avg/exp_avg_sq) and the
        # cuBLAS workspace of a handle first used after the step's peak (backward runs on the
        # autograd thread, which has its own handle) live on into the next step: growth they
        # explain is not growth later steps repeat. Both sides count block bytes (the allocator's
        # rounded sizes, as the step peaks do): against requested sizes, the rounding of Adam's
        # state blocks alone (a GPT-2 step: 18 MB) made explained growth look unexplained.
        explained = grew_bytes <= once
        if last.peak_reserved_bytes > before.peak_reserved_bytes and not explained:
            out.append(
                f"peak reserved still grew in the last recorded step (step {before.step}: "
                f"{format_bytes(before.peak_reserved_bytes)}, step {last.step}: "
                f"{format_bytes(last.peak_reserved_bytes)}); later steps may need more: "
                "predict with more steps"
            )
    return out


# Categories whose allocations are made once and kept: optimizer state, cuBLAS workspaces
# (cached per handle and stream for the process's life, CUDABlas.cpp getCurrentCUDABlasHandle).
_MADE_ONCE = frozenset({"optimizer_state", "workspace"})


def _made_once_bytes(
    events: Sequence[Any], block_bytes: Mapping[int, int], start: int, stop: int
) -> int:
    """Block bytes of made-once categories allocated in ``events[start:stop]``, live at ``stop``."""
    live: dict[int, int] = {}
    for index in range(start, stop):
        event = events[index]
        if event.action == "alloc" and event.tag("category") in _MADE_ONCE:
            live[event.address] = block_bytes.get(index, 0)
        elif event.action == "free_completed":
            live.pop(event.address, None)
    return sum(live.values())


def _refuse_modules_on_the_host(objects: Sequence[Any]) -> None:
    """A module among ``objects`` (or in a list, tuple or dict of them) with a tensor on the CPU
    is a model left there by mistake: say so before running anything (issue 22 item 11).

    Host tensors that are not a module's (a batch a step moves to the device) are fine.
    Duck-typed (``parameters``/``buffers``): this module does not import torch.
    """
    pending = list(objects)
    for _ in range(10_000):  # nested containers, bounded
        if not pending:
            return
        obj = pending.pop()
        if isinstance(obj, dict):
            pending.extend(obj.values())
            continue
        if isinstance(obj, (list, tuple)):
            pending.extend(obj)
            continue
        parameters, buffers = getattr(obj, "parameters", None), getattr(obj, "buffers", None)
        if not (callable(parameters) and callable(buffers)):
            continue
        for tensor in (*parameters(), *buffers()):
            device = getattr(tensor, "device", None)
            if getattr(device, "type", None) == "cpu":
                raise UserCodeError(
                    f"a {type(obj).__name__} passed to oomkit.predict (or tracked by a builder) "
                    "has its parameters on the CPU: the step would run there for real and "
                    "allocate nothing on the traced "
                    "GPU, so there would be nothing to predict. Build it on the meta device "
                    "(`with torch.device('meta'): model = ...`, or `device='meta'`) and predict "
                    "again."
                )


# The target's parts that predict took as keywords before it took one ``target``.
_TARGET_PARTS = ("gpu", "alloc_conf", "context_overhead_bytes", "torch_version")


def _refuse_target_parts(kwargs: Mapping[str, Any]) -> None:
    """Refuse ``gpu=`` (...): the target is one ``target``, and they are not the step's."""
    given = [name for name in _TARGET_PARTS if name in kwargs]
    if given:
        raise ConfigError(
            f"predict takes the GPU and allocator setting as one target=, not "
            f"{', '.join(name + '=' for name in given)}. "
            "Example: predict(step, model, x, target=Target.resolve('rtx4090', "
            "alloc_conf='expandable_segments:True')), or oomkit.predict(step, model, x, "
            "gpu='rtx4090')"
        )


def predict(
    step_fn: Callable[..., Any],
    *args: Any,
    steps: int = 3,
    budget_bytes: int | None = None,
    track: Sequence[Any] = (),
    description: str = "",
    target: Target | None = None,
    workload: WorkloadSpec | None = None,
    values: Mapping[str, float] | None = None,
    compile: bool = False,
    **kwargs: Any,
) -> Prediction:
    """Record ``step_fn`` on the meta device and predict its memory on ``target``'s GPU.

    Build the model, optimizer and inputs under ``torch.device("meta")`` first; pass them as
    ``args`` (they are then also passed to ``step_fn``) or in ``track`` (recorded as allocated
    before the first step, not passed), so that they count from the start::

        with torch.device("meta"):
            model = GPT(...); opt = torch.optim.AdamW(model.parameters()); x = ...
        p = oomkit.predict(train_step, model, opt, x, gpu="rtx4090")

    Args:
        step_fn: one training or inference step; it must run on meta tensors.
        args: passed to ``step_fn`` and tracked.
        steps: steps to record (3 shows optimizer-state creation and the steady state).
        budget_bytes: a reserved-memory limit to check, in bytes.
        track: more objects to record as existing before the first step (not passed).
        description: what is predicted, for reports.
        target: the GPU, allocator setting and versions (``oomkit.core.target.Target``;
            ``Target.resolve("rtx4090", alloc_conf=...)``); ``None`` is
            ``Target.resolve("h100")``: an H100, PyTorch's default allocator setting, the
            newest torch release. Its ``cudnn_version``, when stated, picks the SDPA backend
            (else the settings in effect: ``use_sdpa_settings``, else this torch install's
            cuDNN).
        workload: what is predicted, as data, carried into the result (``oomkit explain``
            reads it).
        values: tensor values the step reads, by the line that reads them
            (``{"train.py:42": 1024}``, as ``--value``); other reads are answered from known
            values or get a stand-in (docs/howto/predict-your-script.md, "Values your step reads").
        compile: record code compiled with ``torch.compile`` (Inductor) as compiled: dynamo
            and AOTAutograd's partitioner run for real, Inductor's fusion and buffer reuse are
            emulated (``--compile``); else it runs eagerly, with a warning.
        kwargs: passed to ``step_fn`` and tracked.

    Returns:
        The prediction.

    Raises:
        TorchRequiredError: torch is not installed.
        UnsupportedOpError: an op of the step cannot run on the meta device.
        UserCodeError: a module passed (in ``args``, ``track`` or ``kwargs``) has its
            parameters or buffers on the CPU: a model left there by mistake would run the
            step on the CPU for real and allocate nothing on the traced device.
        DataDependentValueError: a tensor value oomkit cannot know decides a size or a branch.
        EmptyRecordingError: the model is not on the meta device, or the step allocated
            nothing there (it ran on the CPU, for real).
        ConfigError: ``steps`` is not a whole number from 1 to ``MAX_RECORDED_STEPS``; or
            ``gpu``, ``alloc_conf``, ``context_overhead_bytes`` or ``torch_version`` is given.
    """
    _refuse_target_parts(kwargs)
    check_step_count(steps, "oomkit.predict(step_fn, *args, steps=3)")
    if target is None:
        target = Target.resolve("h100")
    _refuse_modules_on_the_host((*args, *track, *kwargs.values()))
    from oomkit.prediction.tracing import trace_step
    from oomkit.prediction.tracing.emulations import current_sdpa_settings

    count = len(args)

    def step(*all_args: Any, **all_kwargs: Any) -> Any:
        return step_fn(*all_args[:count], **all_kwargs)

    recording = trace_step(
        step,
        *args,
        *track,
        steps=steps,
        target=target,
        values=values,
        require_allocations=True,
        compile=compile,
        **kwargs,
    )
    traced = target
    if traced.cudnn_version is None:
        # Not stated: the tracer used the settings in effect; the result names that version.
        traced = dataclasses.replace(traced, cudnn_version=current_sdpa_settings().cudnn_version)
    return predict_recording(
        recording,
        target=traced,
        budget_bytes=budget_bytes,
        description=description,
        workload=workload,
    )

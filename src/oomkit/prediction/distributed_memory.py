"""A multi-GPU prediction's memory beyond the replay: NCCL's buffers and the timing range.

Two things a distributed step holds that one replay of its recording does not say:

- **NCCL's buffers** (``oomkit.core.gpus.nccl``): device memory outside PyTorch's caching
  allocator, per communicator the layout makes. Like the CUDA context, it comes off what the
  allocator may reserve: the replay's capacity and the usable bytes are reduced by it.
- **The GPU's timing of collectives** (``prediction/tracing/stream_timeline.py``): where frees
  wait on a collective's event (ProcessGroupNCCL's ``record_stream`` before torch 2.8), the peak
  reserved depends on how far the GPU trails the CPU: a range, lower end (the GPU keeps up: the
  recorded order) to upper end (the frees of the recording's ``collective_ids`` moved a launch
  queue later: ``core/trace/delayed_frees.py``). The verdict uses the lower end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from oomkit.core.allocator.constants import UNLIMITED_CAPACITY_BYTES
from oomkit.core.gpus.nccl import (
    DEFAULT_GPUS_PER_NODE,
    NcclMemory,
    communicators_of,
    nccl_memory,
)
from oomkit.core.target import Target
from oomkit.core.trace.delayed_frees import delayed_frees
from oomkit.prediction._replay import replay_for_prediction
from oomkit.units import format_bytes

if TYPE_CHECKING:  # oomkit.prediction.tracing imports torch
    from oomkit.prediction.tracing import TraceRecording

__all__ = ["DistributedMemory", "distributed_memory", "nccl_of"]



@dataclass(frozen=True)
class DistributedMemory:
    """What a multi-GPU step holds beyond one replay of its recording.

    Attributes:
        outside_lines: ``(what, bytes, source)`` of each block of memory outside PyTorch's
            allocator: the CUDA context, then NCCL's buffers per communicator, then what the
            step itself allocated there (async TP's symmetric-memory workspace).
        nccl_bytes: the NCCL lines' sum (0: no communicator, or one rank); it comes off the
            usable bytes unless ``--context-overhead`` stated all memory outside PyTorch.
        nccl_notes: where the NCCL figure may differ from a real run.
        reserved_range_bytes: peak reserved, ``(lower, upper)``: the GPU keeps up, or trails
            the CPU by a launch queue (equal where timing changes nothing). The lower end is the
            verdict's (``Prediction.required_bytes``). The pair is in that order, not sorted:
            frees that come later change which cached segments later requests split or reuse,
            so the upper end's replay can reserve less than the lower end's.
        allocated_range_bytes: peak allocated, likewise (the upper end counts blocks whose free
            waits on their event as allocated; PyTorch's ``allocated_bytes`` drops at the free).
        timing_note: why the range is what it is, in words.
        usable_bytes: what the allocator may reserve on the target (the prediction's
            ``usable_bytes``; ``None``: not known). An upper end above it cannot happen as
            such: there a real allocator synchronizes and reuses the waiting blocks.
        off_usable_bytes: what of ``outside_lines`` past the CUDA context came off the
            usable bytes (``nccl_of``'s: all of it, or 0 where ``--context-overhead`` stated
            the memory outside PyTorch); a batch search's headroom is taken from what is left.
    """

    outside_lines: tuple[tuple[str, int, str], ...]
    nccl_bytes: int
    nccl_notes: tuple[str, ...]
    reserved_range_bytes: tuple[int, int] | None
    allocated_range_bytes: tuple[int, int] | None
    timing_note: str | None
    usable_bytes: int | None = None
    off_usable_bytes: int = 0

    def lines(self) -> list[str]:
        """The report's lines: memory outside the allocator, then the timing range."""
        out = [
            f"outside the allocator: {format_bytes(n)}  {what}  [{source}]"
            for what, n, source in self.outside_lines
        ]
        if self.reserved_range_bytes is not None:
            low, high = self.reserved_range_bytes
            if low == high:
                out.append(
                    f"peak reserved does not depend on the GPU's timing: {format_bytes(low)} "
                    "at either end"
                )
            elif high < low:
                # CUDACachingAllocator.cpp get_free_block: a request takes the best-fitting
                # cached block there is at that moment, so frees that come later can let later
                # requests reuse whole segments where, freed at once, they split one.
                out.append(
                    f"peak reserved by the GPU's timing: {format_bytes(low)} if the GPU keeps up "
                    f"(the verdict's), {format_bytes(high)} if the CPU is a launch queue ahead: "
                    "the later frees change which cached segments the allocator splits and reuses"
                )
            else:
                out.append(
                    f"peak reserved by the GPU's timing: {format_bytes(low)} (GPU keeps up; the "
                    f"verdict's) to {format_bytes(high)} (CPU a launch queue ahead)"
                )
                if self.usable_bytes is not None and high > self.usable_bytes:
                    # CUDACachingAllocator.cpp malloc: when alloc_block fails, step 9's
                    # release_cached_blocks first runs synchronize_and_free_events, so blocks
                    # waiting on a collective's event are reused before any OOM.
                    out.append(
                        f"the upper end is above the {format_bytes(self.usable_bytes)} this GPU "
                        "lets the allocator reserve: there a real allocator synchronizes "
                        "(malloc's release_cached_blocks, synchronize_and_free_events) and "
                        "reuses the blocks waiting on collectives, so reserved stays within it"
                    )
        return out


def nccl_of(
    target: Target | None, recording: TraceRecording | Any = None
) -> tuple[NcclMemory | None, int]:
    """NCCL's device memory on rank 0 of ``target``'s layout (``None`` for one GPU), and the
    bytes of it that come off what the allocator may reserve, with the recording's own memory
    outside the allocator (``TraceRecording.outside_allocator``: async TP's symmetric-memory
    workspace, ``prediction/tracing/async_tp.py``).

    Those are all of it, unless the caller stated the memory outside PyTorch itself
    (``--context-overhead``: ``Target.cuda_context`` is then ``None``), which then includes it.
    """
    recorded = sum(n for _, n, _ in getattr(recording, "outside_allocator", ()))
    if target is not None and target.cuda_context is None:
        recorded = 0
    if target is None or target.parallel is None or target.parallel.world_size < 2:
        return None, recorded
    sizes, names = target.parallel.mesh_shape
    settings = target.nccl
    per_node = DEFAULT_GPUS_PER_NODE if settings is None else settings.gpus_per_node
    comms = communicators_of(tuple(zip(names, sizes, strict=True)), per_node)
    memory = nccl_memory(comms, target.gpu, settings)
    return memory, (memory.total_bytes if target.cuda_context is not None else 0) + recorded


def distributed_memory(
    recording: TraceRecording | Any,
    target: Target,
    nccl: NcclMemory | None,
    lower_reserved_bytes: int,
    lower_allocated_bytes: int,
    usable_bytes: int | None = None,
) -> DistributedMemory | None:
    """The record for a prediction of ``recording`` on ``target``; ``None`` for a one-GPU step.

    Args:
        recording: the recording (``collective_ids`` and ``timing_note`` are read if there).
        target: the machine (its allocator settings and torch version replay the upper end).
        nccl: what :func:`nccl_of` gave for it.
        lower_reserved_bytes: the replay's peak reserved (the required bytes where it OOMs).
        lower_allocated_bytes: the replay's peak allocated.
        usable_bytes: what the allocator may reserve on ``target`` (said beside an upper end
            above it).
    """
    note = getattr(recording, "timing_note", None)
    recorded = tuple(getattr(recording, "outside_allocator", ()))
    if nccl is None and note is None and not recorded:
        return None
    given = target.cuda_context is None  # --context-overhead: all memory outside PyTorch
    context = "as given (--context-overhead), NCCL included" if given else (
        "core/gpus/overhead.py cuda_context"
    )
    outside: list[tuple[str, int, str]] = [("CUDA context", target.context_overhead_bytes, context)]
    if nccl is not None:
        outside.extend(
            (f"{what} (within the --context-overhead given)" if given else what, n, source)
            for what, n, source in nccl.lines
        )
    outside.extend(
        (f"{what} (within the --context-overhead given)" if given else what, n, source)
        for what, n, source in recorded
    )
    reserved = allocated = None
    if note is not None:
        reserved = (lower_reserved_bytes, lower_reserved_bytes)
        allocated = (lower_allocated_bytes, lower_allocated_bytes)
        ids = getattr(recording, "collective_ids", None)
        if ids:
            step_starts = tuple(recording.step_starts)
            upper_events = delayed_frees(recording.events, step_starts, ids)
            # Unlimited capacity: at the upper end a real allocator near capacity would
            # synchronize and reuse the waiting blocks; this says how high reserved may go.
            upper = replay_for_prediction(
                upper_events,
                step_starts,
                target.allocator_config,
                capacity_bytes=UNLIMITED_CAPACITY_BYTES,
                reserved_outside_bytes=0,
                torch_version=target.torch_version,
                max_points=1,
            )
            reserved = (lower_reserved_bytes, upper.peak_reserved_bytes)
            allocated = (lower_allocated_bytes, upper.peak_allocated_bytes)
    return DistributedMemory(
        outside_lines=tuple(outside),
        nccl_bytes=0 if nccl is None else nccl.total_bytes,
        nccl_notes=() if nccl is None else nccl.notes,
        reserved_range_bytes=reserved,
        allocated_range_bytes=allocated,
        timing_note=note,
        usable_bytes=usable_bytes,
        off_usable_bytes=nccl_of(target, recording)[1],
    )

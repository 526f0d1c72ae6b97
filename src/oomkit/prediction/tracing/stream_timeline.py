"""The GPU's timeline of collectives: which frees wait on the GPU, and the range that makes.

PyTorch's caching allocator decides on the CPU, in program order: ``malloc`` and ``free`` run when
Python calls them, however far the GPU trails. A freed block is reusable at once by its own
stream (the stream's order protects it), so for memory only the frees that wait on a *CUDA
event* depend on the GPU's timing: blocks another stream used through ``record_stream``, whose
free records an event on that stream and completes when ``process_events`` finds it done
(CUDACachingAllocator.cpp ``free`` -> ``insert_events``; ``malloc`` -> ``process_events``).

What FSDP2 and ProcessGroupNCCL do about it:

- FSDP2 never calls ``record_stream``; it keeps Python references and waits on events instead
  (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py, "[Note: Overlapping all-gather
  copy-in and all-gather]": ``comm_ctx.all_gather_state`` holds the previous all-gather output
  until the next copy-in; ``reduce_scatter_states`` holds the reduce-scatter input until the next
  group's ``post_backward``). Those frees happen where the recorder sees them.
- ProcessGroupNCCL before torch 2.8 ran even ``async_op=False`` collectives on its internal NCCL
  stream and called ``recordStream(ncclStream)`` on every input and output
  (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp ``collective``: "Both inputs and outputs
  are created on a worker stream and used in different ncclStreams. Hence, both must record the
  ncclStream"), unless ``TORCH_NCCL_AVOID_RECORD_STREAMS=1``. From 2.8 it launches them on the
  current stream and uses no ``record_stream`` (pytorch/pytorch#148590, "[PGNCCL] Launch kernel
  on current stream & remove record_stream entirely", kept out of 2.7 by #150352).

Point-to-point ops are another matter: ProcessGroupNCCL's ``pointToPoint`` calls
``recordStream`` with its NCCL stream on every send and receive tensor in every version read
(2.6, and after #148590 for 2.8+), inside ``batch_isend_irecv``'s coalescing too, and
``TORCH_NCCL_AVOID_RECORD_STREAMS`` has no effect on them (pytorch/pytorch#132292): an
``isend``'s caller need not ``wait()``, so only the stream record keeps its buffer safe.

So with torch 2.8 and later, for a job without point-to-point ops, the allocator sees the same
requests in the same order whether the GPU keeps up or not: the two ends of the range are one
figure. Before 2.8, and for a pipeline's sends and receives on every version, a block a
collective used is reusable only once the GPU passed the collective:

- lower end (the GPU keeps up): its event is done by the next ``malloc``: the recorded order.
- upper end (the CPU far ahead, or collectives slow): the GPU trails the CPU by about a full
  CUDA launch queue (:data:`GPU_LAG_ALLOCATIONS` requests), so the block comes back that many
  allocations later, and at the latest at the end of the step.

:class:`CollectiveUses` notes which allocations the ``torch.distributed`` collectives and
point-to-point ops touch while a step is recorded; the recording carries them
(``TraceRecording.collective_ids``), and the prediction replays the upper end with their frees
moved (``core/trace/delayed_frees.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator, Mapping
from typing import Any

from oomkit.core.allocator.versions import parse_torch_version
from oomkit.core.target import Target
from oomkit.core.trace.delayed_frees import GPU_LAG_ALLOCATIONS
from oomkit.prediction.tracing.emulation import EmulationContext, OpEmulation
from oomkit.prediction.tracing.recorder import Tracer
from oomkit.prediction.tracing.recording import TraceRecording
from oomkit.prediction.tracing.storages import tensor_storage

__all__ = [
    "COLLECTIVE_FUNCTIONS",
    "FUNCTIONAL_COLLECTIVES",
    "GPU_LAG_ALLOCATIONS",
    "P2P_FUNCTIONS",
    "CollectiveUses",
    "records_nccl_stream",
    "timing_note",
    "with_timeline",
]

# The torch.distributed functions whose tensors ProcessGroupNCCL records on its stream (before
# 2.8): FSDP2's all-gather / reduce-scatter (_fsdp_collectives.py DefaultAllGather,
# DefaultReduceScatter: all_gather_single / reduce_scatter_single), HSDP's all_reduce, and the
# tensor forms other code calls.
COLLECTIVE_FUNCTIONS = (
    "all_gather_single",
    "all_gather_into_tensor",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_reduce",
    "broadcast",
)

# The torch.distributed point-to-point ops (pipelining's stage.py / schedules.py ``_batch_p2p``
# send and receive activations and their gradients through them): ProcessGroupNCCL.cpp
# ``pointToPoint`` records its NCCL stream on each tensor unconditionally, in 2.6 and after
# pytorch/pytorch#148590 (2.8+) alike, whatever TORCH_NCCL_AVOID_RECORD_STREAMS says (it only warns
# that the flag does not apply to P2P), batched ops under ``batch_isend_irecv``'s coalescing too
# (benchmarks/data/torchtitan_405b_1f1b_gap.md, section 6). So these are noted on every version.
P2P_FUNCTIONS = ("send", "recv", "isend", "irecv", "batch_isend_irecv")

# DTensor's collectives (torch/distributed/_functional_collectives.py: torch.ops._c10d_functional):
# ProcessGroupNCCL ran them as async work on its stream, and before 2.8 recorded that stream on
# their inputs and outputs too (torch/csrc/distributed/c10d/Functional.cpp -> the process group).
FUNCTIONAL_COLLECTIVES = tuple(
    f"_c10d_functional.{name}.default"
    for name in (
        "all_gather_into_tensor",
        "all_gather_into_tensor_coalesced",
        "all_reduce",
        "all_reduce_coalesced",
        "all_to_all_single",
        "broadcast",
        "reduce_scatter_tensor",
        "reduce_scatter_tensor_coalesced",
    )
)
_WAIT_TENSOR = "_c10d_functional.wait_tensor.default"
# Functional.cpp all_reduce / broadcast run on a clone of their input (``input.clone()``, then the
# in-place collective): the process group sees only the output, noted at wait_tensor.
_ON_A_CLONE = frozenset(
    f"_c10d_functional.{name}.default" for name in ("all_reduce", "all_reduce_coalesced", "broadcast")
)

# torch before this records the NCCL stream on collectives' tensors (see the module doc).
_NO_RECORD_STREAM_FROM = (2, 8)
_DEVICE_TYPE = "meta"  # the recorder's storages stand for CUDA memory on meta (storages.py)


def records_nccl_stream(torch_version: str | None, avoid_record_streams: bool | None) -> bool:
    """Whether ProcessGroupNCCL of ``torch_version`` calls ``record_stream`` on collectives'
    tensors (``None``: the newest release, which does not)."""
    if torch_version is None or avoid_record_streams:
        return False
    return parse_torch_version(torch_version)[:2] < _NO_RECORD_STREAM_FROM


class CollectiveUses:
    """Notes the allocations that ``torch.distributed`` collectives read or write.

    Args:
        tracer: the recorder whose allocations are noted (by recording id); ``None``: given
            later through :meth:`attach` (the recorder takes :meth:`emulations` when made).
    """

    def __init__(self, tracer: Tracer | None = None) -> None:
        self._tracer = tracer
        self.ids: set[int] = set()  # collectives' (record_stream before 2.8 only)
        self.p2p_ids: set[int] = set()  # point-to-point ops' (record_stream on every version)
        self.calls = 0

    def attach(self, tracer: Tracer) -> None:
        """Note the allocations of ``tracer``."""
        self._tracer = tracer

    def emulations(self, base: Mapping[str, OpEmulation]) -> dict[str, OpEmulation]:
        """Emulations that note DTensor's functional collectives: their inputs when issued
        (except those that work on a clone), their outputs at ``wait_tensor`` (recorded by
        then); then each runs ``base``'s own emulation, or the op.

        Args:
            base: the emulations the recorder has otherwise (``COLLECTIVE_EMULATIONS``' own
                ``wait_tensor``).
        """

        def noting(inner: OpEmulation | None, inputs: bool) -> OpEmulation:
            def emulation(ctx: EmulationContext) -> Any:
                self.calls += 1
                if inputs:
                    self._note(list(ctx.args))
                return ctx.run() if inner is None else inner(ctx)

            return emulation

        names = (*FUNCTIONAL_COLLECTIVES, _WAIT_TENSOR)
        return {name: noting(base.get(name), name not in _ON_A_CLONE) for name in names}

    def _note(self, value: Any, into: set[int] | None = None) -> None:
        if self._tracer is None:
            return
        ids = self.ids if into is None else into
        if isinstance(value, (list, tuple)):
            for item in value:
                self._note(item, ids)
            return
        storage = tensor_storage(value, _DEVICE_TYPE)
        if storage is None:
            return
        # The recorder's storage table (storages.py): the allocation this storage is bound to.
        alloc = self._tracer._table.lookup(storage)
        if alloc is not None:
            ids.add(alloc.alloc_id)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """While open, each function in :data:`COLLECTIVE_FUNCTIONS` and :data:`P2P_FUNCTIONS`
        notes its tensors (a ``batch_isend_irecv``: each ``P2POp``'s ``tensor``).

        The point-to-point ops are replaced in ``torch.distributed`` and in
        ``distributed_c10d`` alike, by one wrapper each: ``P2POp`` accepts only the ops
        ``distributed_c10d`` itself names (``_check_op``: ``op not in [isend, irecv]``), and
        ``batch_isend_irecv`` (``op.op is isend``) and pipelining's ``_batch_p2p``
        (``{p.op for p in p2p_ops} == {dist.isend}``) compare by identity, so a ``P2POp`` made
        while open with ``dist.isend`` / ``dist.irecv`` is built and sent as without the
        wrappers.
        """
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        uses = self
        patched: list[tuple[Any, str, Any]] = []  # (module, name, original)

        def wrap(original: Any, into: set[int], p2p_list: bool) -> Any:
            @functools.wraps(original)
            def noting(*args: Any, **kwargs: Any) -> Any:
                uses.calls += 1
                values = [*args, *kwargs.values()]
                if p2p_list:  # batch_isend_irecv(p2p_op_list): the P2POps' tensors
                    values = [getattr(op, "tensor", None) for op in (values[0] if values else [])]
                uses._note(values, into)
                return original(*args, **kwargs)

            return noting

        for name in COLLECTIVE_FUNCTIONS:
            if hasattr(dist, name):
                original = getattr(dist, name)
                patched.append((dist, name, original))
                setattr(dist, name, wrap(original, self.ids, p2p_list=False))
        for name in P2P_FUNCTIONS:
            if not hasattr(distributed_c10d, name):
                continue
            original = getattr(distributed_c10d, name)
            wrapper = wrap(original, self.p2p_ids, p2p_list=name == "batch_isend_irecv")
            for module in (dist, distributed_c10d):
                patched.append((module, name, getattr(module, name)))
                setattr(module, name, wrapper)
        try:
            yield
        finally:
            for module, name, original in reversed(patched):
                setattr(module, name, original)


def timing_note(
    torch_version: str | None, recorded: bool, collective_allocations: int, p2p_allocations: int = 0
) -> str:
    """What the prediction says about the GPU's timeline of collectives, in words.

    Args:
        torch_version: the target's torch version (``None``: the newest).
        recorded: whether ProcessGroupNCCL records its stream on collectives' tensors
            (:func:`records_nccl_stream`).
        collective_allocations: how many allocations the collectives used.
        p2p_allocations: how many allocations the point-to-point ops used (their frees wait on
            the GPU on every version).
    """
    bounds = (
        "the lower end assumes the GPU keeps up (reusable by the next request), the upper end a "
        f"GPU that trails by a full launch queue ({GPU_LAG_ALLOCATIONS} allocations, at most to "
        "the step's end); the verdict uses the lower end: near capacity the allocator "
        "synchronizes and reuses those blocks (CUDACachingAllocator.cpp malloc -> "
        "release_cached_blocks -> synchronize_and_free_events)"
    )
    p2p = (
        f"ProcessGroupNCCL's pointToPoint calls record_stream on the {p2p_allocations} "
        "allocation(s) the point-to-point ops (the pipeline's sends and receives) used, on every "
        "torch version and whatever TORCH_NCCL_AVOID_RECORD_STREAMS says (pytorch/pytorch#132292)"
    )
    if not recorded and not p2p_allocations:
        return (
            "collectives and the GPU's timing: the caching allocator sees the same requests "
            "however far the CPU runs ahead: FSDP2 holds references rather than record_stream "
            "(_fsdp_param_group.py), and ProcessGroupNCCL of torch "
            f"{torch_version or '2.8+'} runs async_op=False collectives on the current stream "
            "without record_stream and keeps async ones' tensors (DTensor's) to their wait, a "
            "point of the program (pytorch/pytorch#148590), so the range is one figure"
        )
    if not recorded:
        return (
            f"collectives and the GPU's timing: torch {torch_version or '2.8+'}'s "
            "ProcessGroupNCCL runs collectives without record_stream (pytorch/pytorch#148590), "
            f"but {p2p}, so each of those is reusable only once the GPU passed its send or "
            f"receive and the range's ends differ by them: {bounds}"
        )
    also = f"; and {p2p}" if p2p_allocations else ""
    return (
        f"collectives and the GPU's timing: torch {torch_version}'s ProcessGroupNCCL calls "
        f"record_stream on the {collective_allocations} allocation(s) collectives used{also}, "
        f"so each is reusable only once the GPU passed its collective; {bounds}"
    )


def with_timeline(
    recording: TraceRecording, uses: CollectiveUses, target: Target | None
) -> TraceRecording:
    """``recording`` with its upper end (where timing matters on ``target``) and its note.

    Args:
        recording: a distributed step's recording (its events in the recorded order: the
            lower end).
        uses: what the collectives and point-to-point ops used while it was recorded.
        target: the machine; its torch version and ``nccl.avoid_record_streams`` say whether
            ProcessGroupNCCL records its stream on collectives' tensors (``None``: the newest
            torch, which does not); point-to-point ops' tensors wait on every version.
    """
    version = None if target is None else target.torch_version
    nccl = None if target is None else target.nccl
    recorded = records_nccl_stream(version, None if nccl is None else nccl.avoid_record_streams)
    waiting = (uses.ids if recorded else set()) | uses.p2p_ids
    ids = frozenset(waiting) if waiting else None
    note = timing_note(version, recorded, len(uses.ids), len(uses.p2p_ids))
    return dataclasses.replace(recording, collective_ids=ids, timing_note=note)

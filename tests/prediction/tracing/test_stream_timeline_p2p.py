"""Point-to-point ops on the GPU's timeline: their frees wait on every torch version, to the byte.

ProcessGroupNCCL's ``pointToPoint`` records its NCCL stream on every send and receive tensor in
2.6 and after pytorch/pytorch#148590 alike (benchmarks/data/torchtitan_405b_1f1b_gap.md, section
6), so a pipeline's buffers make a range even on torch 2.8+.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from oomkit.core.gpus.nccl import NcclSettings
from oomkit.core.target import ParallelLayout, Target
from oomkit.prediction.predictor import predict_recording
from oomkit.prediction.tracing.distributed import fake_process_group, trace_distributed_step
from oomkit.prediction.tracing.stream_timeline import CollectiveUses, timing_note

torch = pytest.importorskip("torch")

MIB = 1 << 20
P = 4 * MIB  # each send / receive buffer: fp32, a large-pool block of a 20 MiB segment
Q = 16 * MIB  # allocated after both are freed: fits the 20 MiB segment only once they are back
SEGMENT = 20 * MIB  # CUDACachingAllocator.cpp get_allocation_size: kLargeBuffer below 10 MiB

WAYS = ("isend_irecv", "send_recv", "batch_isend_irecv")


def _build(way: str, all_reduce: bool = False) -> Any:
    """A step that sends one P buffer to rank 1 and receives one from it, frees both, then
    allocates Q (``all_reduce``: an all-reduce of a P buffer instead of the P2P ops)."""

    def build(mesh: Any) -> tuple[Any, ...]:
        import torch.distributed as dist

        def step() -> None:
            sent = torch.ones(P // 4)
            received = torch.empty(P // 4)
            if all_reduce:
                dist.all_reduce(sent)
            elif way == "isend_irecv":
                dist.isend(sent, dst=1).wait()
                dist.irecv(received, src=1).wait()
            elif way == "send_recv":
                dist.send(sent, dst=1)
                dist.recv(received, src=1)
            else:
                ops = [dist.P2POp(dist.isend, sent, 1), dist.P2POp(dist.irecv, received, 1)]
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
                del ops  # the P2POps hold the tensors
            del sent, received
            torch.empty(Q // 4)

        return step, ()

    return build


def _predict(way: str, torch_version: str, avoid: bool | None = None, all_reduce: bool = False):
    target = dataclasses.replace(
        Target.resolve("h100", torch_version=torch_version),
        parallel=ParallelLayout(pp=2),
        nccl=NcclSettings(avoid_record_streams=avoid),
    )
    recording = trace_distributed_step(
        _build(way, all_reduce), world_size=2, target=target, emulations={}
    )
    return recording, predict_recording(recording, target=target)


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("torch_version", ["2.13", "2.6"])
def test_p2p_buffers_wait_on_every_torch_version(way: str, torch_version: str) -> None:
    """The send and receive buffers are the waiting ids on 2.13 and 2.6; the lower end reuses
    their 20 MiB segment for Q, the upper end holds them to the step's end (+2P allocated, a
    second segment of Q for reserved)."""
    recording, prediction = _predict(way, torch_version)
    buffers = [e.address for e in recording.events if e.action == "alloc" and e.size == P]
    assert len(buffers) == 2
    assert recording.collective_ids == frozenset(buffers)
    assert prediction.peak_allocated_bytes == Q  # lower end: P + P, freed, then Q
    assert prediction.peak_reserved_bytes == SEGMENT
    distributed = prediction.distributed
    assert distributed is not None
    assert distributed.allocated_range_bytes == (Q, Q + 2 * P)
    assert distributed.reserved_range_bytes == (SEGMENT, SEGMENT + Q)
    note = distributed.timing_note or ""
    assert "pointToPoint calls record_stream on the 2 allocation(s)" in note
    assert "range is one figure" not in note


def test_avoid_record_streams_leaves_p2p_waiting() -> None:
    """TORCH_NCCL_AVOID_RECORD_STREAMS=1 on torch 2.6 does not reach pointToPoint."""
    recording, prediction = _predict("isend_irecv", "2.6", avoid=True)
    assert recording.collective_ids is not None and len(recording.collective_ids) == 2
    assert prediction.distributed is not None
    assert prediction.distributed.allocated_range_bytes == (Q, Q + 2 * P)


def test_a_collective_only_step_on_new_torch_is_one_figure() -> None:
    """The same step with an all-reduce in place of the P2P ops: torch 2.13 one figure, torch
    2.6 the all-reduced buffer (P) held to the step's end."""
    recording, prediction = _predict("", "2.13", all_reduce=True)
    assert recording.collective_ids is None
    assert prediction.distributed is not None
    assert prediction.distributed.allocated_range_bytes == (Q, Q)
    assert "range is one figure" in (recording.timing_note or "")
    recording, prediction = _predict("", "2.6", all_reduce=True)
    assert recording.collective_ids is not None and len(recording.collective_ids) == 1
    assert prediction.distributed is not None
    assert prediction.distributed.allocated_range_bytes == (Q, Q + P)


def test_p2p_op_is_built_and_sent_with_the_wrappers_installed() -> None:
    """While installed, dist.isend / dist.irecv are distributed_c10d's own (P2POp's _check_op,
    batch_isend_irecv's ``op.op is isend``), a P2POp of either builds, any other op is still
    refused, and leaving restores the originals."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    originals = {name: getattr(dist, name) for name in ("isend", "irecv", "batch_isend_irecv")}
    uses = CollectiveUses()
    with fake_process_group(2), uses.installed():
        for name in originals:
            assert getattr(dist, name) is getattr(distributed_c10d, name)
            assert getattr(dist, name) is not originals[name]
            assert getattr(dist, name).__name__ == name  # coalescing's mixed-types message
        tensor = torch.empty(4)
        assert dist.P2POp(dist.isend, tensor, 1).op is distributed_c10d.isend
        assert dist.P2POp(dist.irecv, tensor, 1).op is distributed_c10d.irecv
        with pytest.raises(ValueError, match="Invalid ``op``"):
            dist.P2POp(dist.all_reduce, tensor, 1)
        ops = [dist.P2POp(dist.isend, tensor, 1), dist.P2POp(dist.irecv, torch.empty(4), 1)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        assert uses.calls == 3  # batch_isend_irecv, then its isend and irecv
    for name, original in originals.items():
        assert getattr(dist, name) is original
        assert getattr(distributed_c10d, name) is original


def test_timing_note_names_both_kinds() -> None:
    """Old torch with collectives and P2P: both counts said; neither: one figure."""
    both = timing_note("2.6", True, 3, 2)
    assert "record_stream on the 3 allocation(s) collectives used" in both
    assert "pointToPoint calls record_stream on the 2 allocation(s)" in both
    assert "range is one figure" in timing_note("2.13", False, 0, 0)
    new = timing_note("2.13", False, 0, 5)
    assert "torch 2.13's ProcessGroupNCCL runs collectives without record_stream" in new
    assert "the range's ends differ by them" in new

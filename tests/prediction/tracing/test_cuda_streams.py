"""A script's own CUDA streams: each its own pool of cached blocks, to the byte."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oomkit.core.gpus import GpuSpec
from oomkit.core.target import Target
from oomkit.prediction.predictor import predict_recording
from oomkit.prediction.tracing import trace_step
from oomkit.prediction.tracing.cuda_device import as_one_cuda_gpu

MiB = 2**20
TARGET = Target.resolve(GpuSpec("test GPU", 4096 * MiB, 0))


def _four_mib() -> torch.Tensor:
    return torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")


def _prefetch_step(side: bool):
    """A 4 MiB batch freed on the default stream, the next one copied on `s` (or not), then
    a third on the default stream."""
    seen = {}

    def step() -> None:
        s = torch.cuda.Stream()
        a = _four_mib()
        del a
        with torch.cuda.stream(s if side else None):
            b = _four_mib()
            seen["current"] = torch.cuda.current_stream()
        b.record_stream(torch.cuda.current_stream())
        torch.cuda.current_stream().wait_stream(s)
        del b
        c = _four_mib()
        seen["stream"] = s
        del c

    return step, seen


@pytest.mark.parametrize("side", [False, True])
def test_a_side_stream_keeps_its_own_blocks(side):
    """4 MiB requests take 20 MiB segments (ref §3, kLargeBuffer). On one stream the three
    reuse one segment: 20 MiB reserved. The side stream's request cannot take the default
    stream's cached block (a pool per stream): 40 MiB."""
    step, seen = _prefetch_step(side)
    recording = trace_step(step, target=TARGET)
    streams = [e.stream for e in recording.events if e.action == "alloc"]
    assert (streams[1] != 0) is side and streams[0] == streams[2] == 0
    prediction = predict_recording(recording, target=TARGET)
    assert prediction.peak_reserved_bytes == (40 if side else 20) * MiB
    assert (seen["current"] is seen["stream"]) is side


def test_stream_objects_answer_as_torch_s_do():
    """query, synchronize, events, `with s:`, set_stream and default_stream, then all undone."""
    with as_one_cuda_gpu():
        s = torch.cuda.Stream(priority=-1)
        default = torch.cuda.default_stream()
        assert torch.cuda.current_stream() is default and s is not default
        assert s.query() is True and s.synchronize() is None
        assert s.record_event().query() is True
        with s:
            assert torch.cuda.current_stream() is s
        torch.cuda.set_stream(s)
        assert torch.cuda.current_stream() is s
        torch.cuda.set_stream(default)
    with pytest.raises(RuntimeError):
        torch.cuda.Stream()  # a CPU build's own error again


@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=8))
def test_each_request_carries_the_stream_current_when_made(which):
    """Requests made under nested stream contexts carry the innermost one's id; distinct
    streams have distinct ids, the default 0."""

    def step() -> None:
        streams = [None, torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()]
        kept = []
        for index in which:
            with torch.cuda.stream(streams[index]):
                kept.append(torch.empty(512, dtype=torch.uint8, device="cuda"))
        del kept

    recording = trace_step(step, target=TARGET)
    ids = [e.stream for e in recording.events if e.action == "alloc"]
    assert [i == 0 for i in ids] == [w == 0 for w in which]
    by_stream = {}
    for index, stream_id in zip(which, ids, strict=True):
        by_stream.setdefault(index, set()).add(stream_id)
    assert all(len(found) == 1 for found in by_stream.values())
    assert len({next(iter(found)) for found in by_stream.values()}) == len(by_stream)


PREFETCHER = '''
import torch


class Prefetcher:
    """The data prefetcher of NVIDIA's ImageNet example: the next batch copied on a stream."""

    def __init__(self, batches):
        self.batches = iter(batches)
        self.stream = torch.cuda.Stream()
        self.preload()

    def preload(self):
        self.next = next(self.batches, None)
        if self.next is not None:
            with torch.cuda.stream(self.stream):
                self.next = self.next.cuda(non_blocking=True)

    def get(self):
        torch.cuda.current_stream().wait_stream(self.stream)
        batch = self.next
        if batch is not None:
            batch.record_stream(torch.cuda.current_stream())
        self.preload()
        return batch


model = torch.nn.Linear(256, 128).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = Prefetcher([torch.randn(48, 256) for _ in range(4)])
batch = loader.get()
while batch is not None:
    model(batch).sum().backward()
    opt.step()
    opt.zero_grad()
    batch = loader.get()
'''


def test_a_prefetcher_script_copies_its_batches_on_its_stream(tmp_path):
    """Every 48 x 256 fp32 batch (48 KiB) is requested on the prefetcher's stream; the model's
    requests (none of that size) on the default one."""
    from oomkit.prediction.tracing.script_run import record_script

    (tmp_path / "train.py").write_text(PREFETCHER)
    run = record_script(tmp_path / "train.py", steps=3, target=TARGET)
    batches = {e.stream for e in run.recording.events if e.action == "alloc" and e.size == 49152}
    others = {e.stream for e in run.recording.events if e.action == "alloc" and e.size != 49152}
    assert len(batches) == 1 and batches != {0}
    assert others == {0}

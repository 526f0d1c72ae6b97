"""Labelled OOM cases: small programs run through the simulated allocator and written as snapshots.

Each case records a PyTorch-style device trace (``alloc`` / ``free_requested`` /
``free_completed`` / ``segment_*`` / ``oom`` with ``device_free``) while the simulated caching
allocator serves it, then writes the final segments and the trace with ``write_snapshot``, as
``torch.cuda.memory._dump_snapshot`` would in the except handler of the OOM.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from oomkit.core.allocator import (
    AllocatorConfig,
    CachingAllocator,
    SimulatedOutOfMemoryError,
    round_size,
)
from oomkit.core.gpus import GpuSpec
from oomkit.core.snapshot import write_snapshot
from oomkit.core.trace import Frame, TraceEvent

MiB = 2**20
GiB = 2**30
CONTEXT = 400 * MiB
GPU_8G = GpuSpec("test 8 GiB", 8 * GiB, CONTEXT)


def frames(line: int, name: str = "step") -> tuple[Frame, ...]:
    """Frames as PyTorch records them: C++ first, then torch's Python, then the user's file."""
    return (
        Frame("CUDACachingAllocator.cpp", 0, "c10::cuda::CUDACachingAllocator::malloc"),
        Frame("/usr/lib/python3/site-packages/torch/nn/functional.py", 2100, "linear"),
        Frame("/home/user/train.py", line, name),
    )


class Recorder:
    """A simulated device that records the trace PyTorch's memory history would."""

    def __init__(
        self, capacity_bytes: int = 8 * GiB, outside_bytes: int = CONTEXT, conf: str = ""
    ) -> None:
        self.conf = conf
        self.allocator = CachingAllocator(
            AllocatorConfig.parse(conf), capacity_bytes, reserved_outside_bytes=outside_bytes
        )
        self.events: list[TraceEvent] = []
        self.sizes: dict[int, int] = {}

    def _segments(self, before: int) -> None:
        for action, address, size in self.allocator.segment_log[before:]:
            self.events.append(TraceEvent(action, address, size))

    def alloc(self, nbytes: int, line: int = 10) -> int | None:
        """Allocate; on OOM record the ``oom`` entry (rounded size, device_free) and return None."""
        before = len(self.allocator.segment_log)
        try:
            ptr = self.allocator.malloc(nbytes)
        except SimulatedOutOfMemoryError:
            self._segments(before)
            free = self.allocator.device_free_bytes
            self.events.append(TraceEvent("oom", free, round_size(nbytes), frames=frames(line)))
            return None
        self._segments(before)
        self.events.append(TraceEvent("alloc", ptr, nbytes, frames=frames(line)))
        self.sizes[ptr] = nbytes
        return ptr

    def free(self, ptr: int) -> None:
        """Free now (no cross-stream use): free_requested then free_completed."""
        nbytes = self.sizes.pop(ptr)
        self.events.append(TraceEvent("free_requested", ptr, nbytes))
        before = len(self.allocator.segment_log)
        self.allocator.free(ptr)
        self._segments(before)
        self.events.append(TraceEvent("free_completed", ptr, nbytes))

    def write(self, path: Path) -> Path:
        # set_per_process_memory_fraction is not in the recorded settings: leave it out.
        conf = "" if "per_process_memory_fraction" in self.conf else self.conf
        settings = {"PYTORCH_CUDA_ALLOC_CONF": conf}
        return write_snapshot(path, self.allocator.snapshot(), {0: self.events}, settings)


def shortage(path: Path) -> Path:
    """7 GiB of parameters on an 8 GiB GPU, then 1 GiB more."""
    rec = Recorder()
    for i in range(7):
        rec.alloc(GiB, line=5 + i)
    assert rec.alloc(GiB, line=20) is None
    return rec.write(path)


def fragmentation(path: Path) -> Path:
    """Seven 1 GiB segments each keep a 600 MiB tensor; 2 GiB cannot be found in the gaps."""
    rec = Recorder()
    blocks = [rec.alloc(GiB, line=5) for _ in range(7)]
    for block in blocks:
        rec.free(block)
    for _ in blocks:
        rec.alloc(600 * MiB, line=8)
    assert rec.alloc(2 * GiB, line=12) is None
    return rec.write(path)


def outside_pytorch(path: Path) -> Path:
    """Another process holds 3 GiB; 4 GiB of tensors and a 2 GiB request do not fit."""
    rec = Recorder(outside_bytes=3 * GiB + CONTEXT)
    for _ in range(4):
        rec.alloc(GiB, line=5)
    assert rec.alloc(2 * GiB, line=9) is None
    return rec.write(path)


def fraction_limit(path: Path) -> Path:
    """A memory fraction of 0.5 (4 GiB) refuses 2 GiB on top of 3 GiB while the GPU has room."""
    rec = Recorder(capacity_bytes=8 * GiB, conf="per_process_memory_fraction:0.5")
    for _ in range(3):
        rec.alloc(GiB, line=5)
    assert rec.alloc(2 * GiB, line=9) is None
    return rec.write(path)


def request_exceeds_device(path: Path) -> Path:
    """One 16 GiB request on an 8 GiB GPU."""
    rec = Recorder()
    rec.alloc(GiB, line=5)
    assert rec.alloc(16 * GiB, line=7) is None
    return rec.write(path)


def leak(path: Path) -> Path:
    """A training loop that keeps 256 MiB (a loss with its graph) every iteration."""
    rec = Recorder()
    rec.alloc(GiB, line=3)  # parameters
    for _ in range(40):
        act = rec.alloc(GiB, line=10)
        if act is None:
            break
        tmp = rec.alloc(512 * MiB, line=11)
        if tmp is None:
            break
        rec.free(tmp)
        if rec.alloc(256 * MiB, line=12) is None:  # history.append(loss): never freed
            break
        rec.free(act)
    else:
        raise AssertionError("the leak case never ran out of memory")
    return rec.write(path)


def transient_spike(path: Path) -> Path:
    """Steady 3 GiB steps, then one step builds 3 GiB of temporaries and asks 3 GiB more."""
    rec = Recorder()
    rec.alloc(2 * GiB, line=3)  # parameters
    for _ in range(3):
        act = rec.alloc(GiB, line=10)
        rec.free(act)
    temps = [rec.alloc(1536 * MiB, line=20) for _ in range(2)]
    assert rec.alloc(3 * GiB, line=21) is None
    for temp in temps:  # the exception unwinds the step: its temporaries are freed
        rec.free(temp)
    return rec.write(path)


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[Path], Path]
    expected: str
    memory_fraction: float | None = None
    top_remedy: str = ""  # how the first remedy's title starts


CASES: tuple[Case, ...] = (
    Case("shortage", shortage, "shortage", top_remedy="reduce memory per step"),
    Case("fragmentation", fragmentation, "fragmentation", top_remedy="expandable segments"),
    Case(
        "outside_pytorch",
        outside_pytorch,
        "outside_pytorch",
        top_remedy="free the memory held outside PyTorch",
    ),
    Case(
        "fraction_limit",
        fraction_limit,
        "fraction_limit",
        memory_fraction=0.5,
        top_remedy="raise the per-process memory fraction",
    ),
    Case(
        "request_exceeds_device",
        request_exceeds_device,
        "request_exceeds_device",
        top_remedy="check the shape",
    ),
    Case("leak", leak, "leak", top_remedy="stop the leak at /home/user/train.py:12"),
    Case(
        "transient_spike",
        transient_spike,
        "transient_spike",
        top_remedy="compute the short-lived temporary in chunks",
    ),
)


def fragmented_oom_message() -> str:
    """PyTorch's OOM message for 2 GiB on an 8 GiB device (400 MiB outside) whose 7 GiB cache
    holds seven 600 MiB tensors, one per 1 GiB segment: 2.90 GiB free in the cache, no block
    large enough (the fragmentation case of an error text)."""
    allocator = CachingAllocator(capacity_bytes=8 * GiB, reserved_outside_bytes=400 * MiB)
    blocks = [allocator.malloc(GiB) for _ in range(7)]
    for block in blocks:
        allocator.free(block)
    for _ in blocks:
        allocator.malloc(600 * MiB)
    try:
        allocator.malloc(2 * GiB)
    except SimulatedOutOfMemoryError as error:
        return str(error)
    raise AssertionError("the 2 GiB request was expected to run out of memory")

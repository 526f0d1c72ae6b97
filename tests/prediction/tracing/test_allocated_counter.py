"""``torch.cuda.memory_allocated()`` inside a recorded step reads the bytes recorded so far.

It had read 0 (a script's own `print(torch.cuda.max_memory_allocated())` printed 0.0 MiB);
now each live request counts as ``round_size`` rounds it, with a peak that
``reset_peak_memory_stats()`` restarts, and ``memory_reserved()`` reads 0 with a warning.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oomkit.core.allocator.rounding import round_size
from oomkit.core.target import Target
from oomkit.prediction.predictor import predict
from oomkit.prediction.tracing.allocated_counter import AllocatedCounter
from oomkit.prediction.tracing.cuda_device import as_one_cuda_gpu
from oomkit.prediction.tracing.step_runner import trace_step


def test_a_step_reads_its_own_recorded_bytes_and_peak():
    seen: list[object] = []

    def step() -> None:
        a = torch.empty(1000, device="cuda")  # 4,000 bytes: a 4,096-byte block
        seen.append(torch.cuda.memory_allocated())
        b = torch.empty(10, device="cuda")  # 40 bytes: 512, the smallest block
        seen.append(torch.cuda.memory_allocated())
        del a
        seen.append((torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()))
        torch.cuda.reset_peak_memory_stats()
        seen.append(torch.cuda.max_memory_allocated())
        seen.append(torch.cuda.memory_reserved())
        del b

    recording = trace_step(step, steps=2)
    assert seen == [4096, 4608, (512, 4608), 512, 0] * 2
    assert "read 10 time(s) by the step" in recording.assumptions["torch.cuda.memory_allocated()"]
    reserved = [w for w in recording.warnings if w.startswith("torch.cuda.memory_reserved()")]
    assert reserved == [
        "torch.cuda.memory_reserved() was read 2 time(s) while the step was recorded and "
        "answered 0: reserved memory is known only once the recording is replayed (the peak "
        "reserved above); memory_allocated() read the bytes recorded so far"
    ]


def test_a_step_that_reads_no_counter_states_nothing_about_them():
    recording = trace_step(lambda: torch.empty(10, device="cuda"), steps=1)
    assert "torch.cuda.memory_allocated()" not in recording.assumptions
    assert not any("memory_reserved" in w for w in recording.warnings)


def test_outside_a_recording_the_counters_read_zero():
    with as_one_cuda_gpu():
        torch.empty(1000, device="cuda")
        assert torch.cuda.memory_allocated() == 0
        assert torch.cuda.max_memory_allocated() == 0
        assert torch.cuda.memory_reserved() == 0


@dataclass
class _Alloc:
    size_bytes: int


# A program: each entry allocates a size or frees the live allocation at an index.
PROGRAMS = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(min_value=0, max_value=3 * 2**20)),
        st.tuples(st.just("free"), st.integers(min_value=0, max_value=50)),
    ),
    max_size=60,
)


@given(program=PROGRAMS, reset_at=st.integers(min_value=0, max_value=60))
def test_the_counter_is_the_rounded_live_total_and_its_running_maximum(program, reset_at):
    log: list[tuple[object, ...]] = []
    counter = AllocatedCounter(log)
    live: list[_Alloc] = []
    total = peak = 0
    for index, (kind, n) in enumerate(program):
        if index == reset_at:
            counter.reset_peak()
            peak = total
        if kind == "alloc":
            alloc = _Alloc(n)
            live.append(alloc)
            log.append(("alloc", alloc))
            total += round_size(n) if n else 0
            peak = max(peak, total)
        elif live:
            alloc = live.pop(n % len(live))
            log.append(("free", alloc, None))
            total -= round_size(alloc.size_bytes) if alloc.size_bytes else 0
        log.append(("step",)) if index % 7 == 0 else None
        if index % 3 == 0:  # read now and then: the counter catches up on what it missed
            assert counter.allocated_bytes() == total
    assert counter.allocated_bytes() == total
    assert counter.peak_allocated_bytes() == peak


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(min_value=1, max_value=2**20), min_size=1, max_size=12))
def test_in_the_small_pool_the_step_s_own_peak_is_the_replayed_one(sizes):
    """Requests of at most 1 MiB are served from the small pool, which splits off any
    remainder: the step's max_memory_allocated() is the prediction's peak allocated."""
    read: list[int] = []

    def step() -> None:
        held = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
        del held[::2]
        read.append(torch.cuda.max_memory_allocated())

    prediction = predict(step, steps=1, target=Target.resolve("h100"))
    assert read == [prediction.peak_allocated_bytes]
    assert read[0] == sum(round_size(n) for n in sizes)


def test_the_report_gives_the_counters_their_own_assumed_line():
    """Not folded into the kernels line, where the other non-value assumptions go."""
    import io

    from rich.console import Console

    from oomkit.interfaces.reports.prediction import kernels_line, render_prediction

    def step() -> None:
        torch.empty(1000, device="cuda")
        torch.cuda.max_memory_allocated()

    prediction = predict(step, steps=1, target=Target.resolve("h100"))
    assert "memory_allocated" not in kernels_line(prediction)
    out = io.StringIO()
    render_prediction(prediction, Console(file=out, width=400))
    assert "assumed: torch.cuda.memory_allocated(): read 1 time(s) by the step" in out.getvalue()

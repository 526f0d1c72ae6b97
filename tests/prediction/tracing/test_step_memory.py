"""``torch.cuda``'s memory counters inside a recorded step read the recording so far, replayed
on the simulated caching allocator.

They had read 0 (a script's own `print(torch.cuda.max_memory_allocated())` printed 0.0 MiB,
and ``torch.cuda.memory_stats()`` was empty, so torchtitan's memory monitor or a script reading
``memory_stats()["reserved_bytes.all.peak"]`` could not run as written).
"""

from __future__ import annotations

import io

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oomkit.core.target import Target
from oomkit.prediction.predictor import predict
from oomkit.prediction.tracing.cuda_device import as_one_cuda_gpu
from oomkit.prediction.tracing.step_runner import trace_step

MiB = 2**20


def test_a_step_reads_the_allocator_s_own_figures():
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
        # One 2 MiB small-pool segment holds both (CUDACachingAllocator kSmallBuffer).
        seen.append((torch.cuda.memory_reserved(), torch.cuda.max_memory_reserved()))
        stats = torch.cuda.memory_stats()
        seen.append((stats["allocated_bytes.all.current"], stats["segment.all.current"]))
        del b

    recording = trace_step(step, steps=2)
    assert seen == [4096, 4608, (512, 4608), 512, (2 * MiB, 2 * MiB), (512, 1)] * 2
    assert "read 18 time(s) by the step" in recording.assumptions["torch.cuda memory counters"]


def test_the_target_s_allocator_settings_are_the_ones_replayed():
    """Expandable segments map 20 MiB pages for the small pool too (ref §8): a 2 MiB small
    segment becomes a 20 MiB reservation's first page... read as the simulator has it."""
    read: dict[str, int] = {}

    def step() -> None:
        x = torch.empty(30 * MiB, dtype=torch.uint8, device="cuda")
        read["reserved"] = torch.cuda.memory_reserved()
        del x

    trace_step(step, steps=1, target=Target.resolve("h100"))
    classic = read["reserved"]
    trace_step(step, steps=1,
               target=Target.resolve("h100", alloc_conf="expandable_segments:True"))
    assert classic == 30 * MiB  # a large request gets a segment of its own size, 2 MiB aligned
    assert read["reserved"] == 40 * MiB  # two 20 MiB pages of the expandable segment


def test_a_request_past_any_device_is_left_out_of_the_reads_not_raised_into_the_step():
    """The simulator's own OOM (a 2 EiB meta tensor) had ended the recording in the user's
    memory_allocated() call; the prediction says where it runs out instead."""
    seen: list[int] = []

    def step() -> None:
        small = torch.empty(1000, device="cuda")
        huge = torch.empty(2**61, dtype=torch.uint8, device="cuda")
        seen.append(torch.cuda.memory_allocated())
        del huge, small

    prediction = predict(step, steps=1, target=Target.resolve("h100"))
    assert seen == [4096]
    assert not prediction.fits


def test_a_step_that_reads_no_counter_states_nothing_about_them():
    recording = trace_step(lambda: torch.empty(10, device="cuda"), steps=1)
    assert "torch.cuda memory counters" not in recording.assumptions


def test_outside_a_recording_the_counters_read_an_allocator_that_served_nothing():
    with as_one_cuda_gpu():
        torch.empty(1000, device="cuda")
        assert torch.cuda.memory_allocated() == 0
        assert torch.cuda.max_memory_reserved() == 0
        assert torch.cuda.memory_stats()["allocated_bytes.all.current"] == 0


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=1, max_value=64 * MiB), min_size=1, max_size=12),
    freed=st.sets(st.integers(min_value=0, max_value=11)),
)
def test_the_step_s_own_peaks_are_the_prediction_s(sizes, freed):
    """Any requests (small and large pools, split and whole blocks): what the step reads at
    its end is what the report says, to the byte."""
    read: list[tuple[int, int]] = []

    def step() -> None:
        held = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
        for index in sorted(freed & set(range(len(held))), reverse=True):
            del held[index]
        read.append((torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()))

    prediction = predict(step, steps=1, target=Target.resolve("h100"))
    assert read == [(prediction.peak_allocated_bytes, prediction.peak_reserved_bytes)]


def test_the_report_gives_the_counters_their_own_assumed_line():
    """Not folded into the kernels line, where the other non-value assumptions go."""
    from rich.console import Console

    from oomkit.interfaces.reports.prediction import kernels_line, render_prediction

    def step() -> None:
        torch.empty(1000, device="cuda")
        torch.cuda.max_memory_allocated()

    prediction = predict(step, steps=1, target=Target.resolve("h100"))
    assert "memory counters" not in kernels_line(prediction)
    out = io.StringIO()
    render_prediction(prediction, Console(file=out, width=400))
    assert "assumed: torch.cuda memory counters: read 1 time(s) by the step" in out.getvalue()


def test_mem_get_info_is_the_total_less_the_context_and_what_is_reserved():
    """cudaMemGetInfo's free memory: the device's total less the CUDA context and what the
    caching allocator holds reserved so far (a 30 MiB request: a 30 MiB segment, kept cached
    after its free). It had read the whole memory free, so a script sizing its batch from it
    sized it as on an empty GPU."""
    read: list[tuple[int, int]] = []

    def step() -> None:
        read.append(torch.cuda.mem_get_info())
        x = torch.empty(30 * MiB, dtype=torch.uint8, device="cuda")
        read.append(torch.cuda.mem_get_info())
        del x
        read.append(torch.cuda.mem_get_info(0))

    target = Target.resolve("rtx4090")
    gpu = target.gpu
    trace_step(step, steps=1, target=target)
    usable = gpu.total_memory_bytes - gpu.context_overhead_bytes
    assert gpu.context_overhead_bytes > 0
    assert read == [
        (usable, gpu.total_memory_bytes),
        (usable - 30 * MiB, gpu.total_memory_bytes),
        (usable - 30 * MiB, gpu.total_memory_bytes),  # freed into the cache, still reserved
    ]


def test_mem_get_info_outside_a_recording_and_past_the_memory():
    """Outside a recorder nothing is reserved: free is the total less the context. A step
    past the GPU's memory (the replay has no limit) reads 0 free, never a negative number."""
    gpu = Target.resolve("h100", context_overhead_bytes=500 * MiB).gpu
    with as_one_cuda_gpu(gpu):
        assert torch.cuda.mem_get_info() == (gpu.total_memory_bytes - 500 * MiB,
                                             gpu.total_memory_bytes)
    read: list[int] = []

    def step() -> None:
        x = torch.empty(gpu.total_memory_bytes, dtype=torch.uint8, device="cuda")
        read.append(torch.cuda.mem_get_info()[0])
        del x

    trace_step(step, steps=1, target=Target.resolve("h100", context_overhead_bytes=500 * MiB))
    assert read == [0]


def test_empty_cache_in_a_step_releases_the_cached_blocks_in_the_reads_and_the_report():
    """A 30 MiB block freed into the cache cannot serve a 40 MiB request: without emptying,
    the step reserves 70 MiB at its peak; with torch.cuda.empty_cache() between them the
    30 MiB segment goes back to the device (release_cached_blocks) and the peak is 40 MiB. It
    had done nothing, so a script that empties its cache was predicted as one that does not."""
    read: list[int] = []

    def step(empty: bool) -> None:
        a = torch.empty(30 * MiB, dtype=torch.uint8, device="cuda")
        del a
        if empty:
            torch.cuda.empty_cache()
        read.append(torch.cuda.memory_reserved())
        b = torch.empty(40 * MiB, dtype=torch.uint8, device="cuda")
        del b

    target = Target.resolve("h100")
    kept = predict(lambda: step(False), steps=1, target=target)
    emptied = predict(lambda: step(True), steps=1, target=target)
    assert read == [30 * MiB, 0]
    assert kept.peak_reserved_bytes == 70 * MiB
    assert emptied.peak_reserved_bytes == 40 * MiB
    recording = trace_step(lambda: step(True), steps=2, target=target)
    assert [e.action for e in recording.events].count("empty_cache") == 2


def _test_gpu(total_mib: int) -> Target:
    from oomkit.core.gpus import GpuSpec

    return Target.resolve(GpuSpec("test GPU", total_mib * MiB, 0))


def test_a_memory_fraction_set_by_the_step_limits_the_replay():
    """set_per_process_memory_fraction(0.5) on 100 MiB: the allocator may reserve
    round(0.5 * 100 MiB) = 50 MiB (setMemoryFraction), so 40 MiB live and a 20 MiB request
    run out of memory there, and the usable memory is 50 MiB; without the call both fit in
    100 MiB. It had raised AttributeError (torch._C._cuda_setMemoryFraction, absent on a CPU
    build), so a script that set it could not be predicted."""
    read: list[float] = []

    def step(fraction: float | None) -> None:
        read.append(torch.cuda.get_per_process_memory_fraction())
        if fraction is not None:
            torch.cuda.set_per_process_memory_fraction(fraction)
            read.append(torch.cuda.get_per_process_memory_fraction())
        a = torch.empty(40 * MiB, dtype=torch.uint8, device="cuda")
        b = torch.empty(20 * MiB, dtype=torch.uint8, device="cuda")
        del a, b

    limited = predict(lambda: step(0.5), steps=1, target=_test_gpu(100))
    assert read == [1.0, 0.5]
    assert (limited.fits, limited.usable_bytes, limited.required_bytes) == (False, 50 * MiB, 60 * MiB)
    assert limited.oom is not None
    assert limited.assumptions["memory fraction"] == (
        "torch.cuda.set_per_process_memory_fraction(0.5): the replay limits the allocator to "
        "that share of the GPU's total memory from the start"
    )
    from rich.console import Console

    from oomkit.interfaces.reports.prediction import render_prediction

    out = io.StringIO()
    render_prediction(limited, Console(file=out, width=400))
    assert "assumed: memory fraction: torch.cuda.set_per_process_memory_fraction(0.5)" in (
        out.getvalue()
    )
    free = predict(lambda: step(None), steps=1, target=_test_gpu(100))
    assert (free.fits, free.usable_bytes, free.peak_reserved_bytes) == (True, 100 * MiB, 60 * MiB)
    assert "memory fraction" not in free.assumptions


def test_a_memory_fraction_set_after_allocating_says_those_are_held_to_it():
    """Set after a request: the replay applies it from the start and says so."""

    def step() -> None:
        a = torch.empty(10 * MiB, dtype=torch.uint8, device="cuda")
        torch.cuda.set_per_process_memory_fraction(0.9)
        del a

    recording = trace_step(step, steps=1, target=_test_gpu(100))
    assert recording.memory_fraction == 0.9
    assert recording.assumptions["memory fraction"].endswith(
        "(the step set it after allocating; those allocations are held to it too here)"
    )


def test_torch_s_own_checks_of_the_fraction_run_and_its_hook_is_removed_after():
    """torch/cuda/memory.py checks the argument before the hook: an int is a TypeError, 1.5 a
    ValueError, as on a GPU. Outside the recording torch._C is as it was (a CPU build has no
    _cuda_setMemoryFraction)."""
    import pytest

    had = hasattr(torch._C, "_cuda_setMemoryFraction")
    with as_one_cuda_gpu(_test_gpu(100).gpu):
        with pytest.raises(TypeError, match="must be `float`"):
            torch.cuda.set_per_process_memory_fraction(1)
        with pytest.raises(ValueError, match="Invalid fraction value: 1.5"):
            torch.cuda.set_per_process_memory_fraction(1.5)
    assert hasattr(torch._C, "_cuda_setMemoryFraction") == had

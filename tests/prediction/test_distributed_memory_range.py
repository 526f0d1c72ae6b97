"""The timing range's two ends are replays of the same requests: the later frees' end can
reserve less, and the report then says which end is which (exact bytes)."""

from __future__ import annotations

from types import SimpleNamespace

from oomkit.core.target import Target
from oomkit.core.trace import TraceEvent
from oomkit.prediction._replay import replay_for_prediction
from oomkit.prediction.distributed_memory import distributed_memory
from oomkit.units import format_bytes

MIB = 1 << 20
TAGS = (("category", "activation"), ("phase", "forward"))


def _alloc(ident: int, size: int) -> TraceEvent:
    return TraceEvent("alloc", ident, size, tags=TAGS)


def _free(ident: int, size: int) -> tuple[TraceEvent, TraceEvent]:
    return (
        TraceEvent("free_requested", ident, size, tags=TAGS),
        TraceEvent("free_completed", ident, size, tags=TAGS),
    )


# Step 1: a 20 MiB block (a collective's output) is freed, then a 12 MiB block is made; step 2
# makes another 20 MiB block. All three are large requests (over 1 MiB): CUDACachingAllocator.cpp
# get_allocation_size rounds them to 2 MiB, so each new segment is its request's size.
EVENTS = (
    _alloc(1, 20 * MIB),
    *_free(1, 20 * MIB),
    _alloc(2, 12 * MIB),
    _alloc(3, 20 * MIB),
)
STEP_STARTS = (0, 4)


def _recording() -> SimpleNamespace:
    return SimpleNamespace(
        events=EVENTS,
        step_starts=STEP_STARTS,
        collective_ids=frozenset({1}),
        timing_note="block 1 waits on a collective's event",
        outside_allocator=(),
    )


def test_later_frees_can_reserve_less_and_the_report_says_which_end_is_which() -> None:
    """Freed at once (the lower end), block 1's 20 MiB segment is split for the 12 MiB request
    (get_free_block's best fit; the 8 MiB rest is over kSmallSize, so it splits), and step 2's
    20 MiB needs a new segment: 40 MiB reserved. Freed a launch queue later (at the end of step
    1: fewer than 1024 allocations follow), the 12 MiB request gets a segment of its own and
    step 2 reuses the whole 20 MiB one: 32 MiB. The pair stays (keeps up, trails)."""
    target = Target.resolve("h100")
    lower = replay_for_prediction(
        EVENTS,
        STEP_STARTS,
        target.allocator_config,
        capacity_bytes=1 << 40,
        reserved_outside_bytes=0,
        torch_version=target.torch_version,
    )
    assert (lower.peak_reserved_bytes, lower.peak_allocated_bytes) == (40 * MIB, 32 * MIB)
    memory = distributed_memory(
        _recording(), target, None, lower.peak_reserved_bytes, lower.peak_allocated_bytes
    )
    assert memory is not None
    assert memory.reserved_range_bytes == (40 * MIB, 32 * MIB)
    # The upper end counts block 1 as allocated until its late free: 20 + 12 MiB, then the
    # 12 + 20 MiB of step 2.
    assert memory.allocated_range_bytes == (32 * MIB, 32 * MIB)
    (said,) = [line for line in memory.lines() if line.startswith("peak reserved")]
    assert said == (
        f"peak reserved by the GPU's timing: {format_bytes(40 * MIB)} if the GPU keeps up "
        f"(the verdict's), {format_bytes(32 * MIB)} if the CPU is a launch queue ahead: the "
        "later frees change which cached segments the allocator splits and reuses"
    )

"""Replay an oomkit trace (requests only) through the simulated allocator."""

from __future__ import annotations

from collections.abc import Iterable

from oomkit.core.allocator import AllocatorConfig, CachingAllocator, SimulatedOutOfMemoryError
from oomkit.errors import TraceFormatError
from oomkit.core.replay._ids import FreeTracker
from oomkit.core.replay.result import ReplayResult, stats_fields
from oomkit.core.trace import TraceEvent

__all__ = ["simulate_events", "DEFAULT_CAPACITY_BYTES"]

# An 80 GB A100/H100 as the default device when the user names none (the what-if capacity of
# ../shared/ref/cuda-caching-allocator.md §15.7).
DEFAULT_CAPACITY_BYTES = 80 * 2**30


def simulate_events(
    events: Iterable[TraceEvent],
    config: AllocatorConfig | None = None,
    capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
    torch_version: str | None = None,
    reserved_outside_bytes: int = 0,
) -> ReplayResult:
    """Replay the requests of a trace and return what the allocator did.

    Requests are ``alloc`` (the ``address`` field is the allocation's id in the trace),
    ``free_requested`` (the program dropped the tensor) and ``free_completed`` (the block became
    reusable; both come together for a same-stream free, as in PyTorch's traces), and
    ``empty_cache``. Segment and ``oom`` entries are decisions, not requests, and are skipped.

    Args:
        events: the trace, in order; it is consumed once, so a generator works.
        config: allocator settings; ``None`` is PyTorch's default.
        capacity_bytes: device memory as ``cudaMemGetInfo`` reports its total.
        torch_version: the PyTorch version whose behaviour to model; ``None`` is the newest.
        reserved_outside_bytes: device memory used outside this allocator (CUDA context etc.).

    Returns:
        The replay's record. On an OOM the replay stops at that request and ``oom`` is set.

    Raises:
        TraceFormatError: the trace frees an id it never allocated, or allocates a live id twice.
    """
    config = config if config is not None else AllocatorConfig()
    allocator = CachingAllocator(
        config,
        capacity_bytes=capacity_bytes,
        reserved_outside_bytes=reserved_outside_bytes,
        torch_version=torch_version,
    )
    frees = FreeTracker()
    live = frees.live  # trace id -> simulated pointer
    malloc = allocator.malloc
    free = allocator.free
    count = 0
    oom_index: int | None = None
    oom_message: str | None = None
    for count, event in enumerate(events, start=1):  # noqa: B007 - count is used after the loop
        action = event.action
        if action == "alloc":
            if event.address in live:
                raise TraceFormatError(
                    f"event {count}: id {event.address:#x} is allocated twice without a free; "
                    "each alloc needs a distinct id while it is live."
                )
            try:
                live[event.address] = malloc(event.size, event.stream)
            except SimulatedOutOfMemoryError as exc:
                oom_index, oom_message = count - 1, str(exc)
                break
        elif action == "free_requested":
            frees.request(count, event.address)
        elif action == "free_completed":
            ptr = frees.complete(count, event.address)
            if ptr:
                free(ptr)
        elif action == "empty_cache":
            allocator.empty_cache()
    stats = allocator.memory_stats()
    return ReplayResult(
        events=count,
        **stats_fields(stats),
        segment_events=tuple(allocator.segment_log),
        final_segments=tuple(allocator.snapshot()),
        memory_stats=stats,
        oom=oom_index is not None,
        oom_event_index=oom_index,
        oom_message=oom_message,
        alloc_conf=str(config),
        torch_version=torch_version,
    )

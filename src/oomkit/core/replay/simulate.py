"""Replay an oomkit trace (requests only) through the simulated allocator."""

from __future__ import annotations

from collections.abc import Iterable

from oomkit.core.allocator import DEFAULT_CAPACITY_BYTES, AllocatorConfig, CachingAllocator
from oomkit.core.replay.engine import ReplayEngine
from oomkit.core.replay.result import ReplayResult
from oomkit.core.trace import TraceEvent

__all__ = ["simulate_events"]

# DEFAULT_CAPACITY_BYTES: an 80 GB A100/H100 as the device when the user names none (the
# what-if capacity of ../shared/ref/cuda-caching-allocator.md §15.7).


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
        TraceFormatError: the trace frees an id it never allocated, or allocates an id that is
            still live or awaiting its ``free_completed``; the message names the event's
            0-based index.
    """
    config = config if config is not None else AllocatorConfig()
    allocator = CachingAllocator(
        config,
        capacity_bytes=capacity_bytes,
        reserved_outside_bytes=reserved_outside_bytes,
        torch_version=torch_version,
    )
    engine = ReplayEngine(allocator)
    engine.run(events)
    return engine.result(alloc_conf=str(config), torch_version=torch_version)

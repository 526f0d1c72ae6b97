"""The record every replay or simulation returns."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["SegmentEvent", "Divergence", "ReplayResult"]

# One allocator segment decision, as PyTorch's trace names them:
# ("segment_alloc" | "segment_free" | "segment_map" | "segment_unmap", address, size_bytes).
SegmentEvent = tuple[str, int, int]


@dataclass(frozen=True)
class Divergence:
    """The first place where the simulator's segment decisions differ from the recording."""

    segment_event_index: int
    trace_event_index: int | None
    expected: SegmentEvent | None
    actual: SegmentEvent | None
    context: tuple[str, ...] = ()


@dataclass(frozen=True)
class ReplayResult:
    """What replaying a trace (recorded or synthetic) through the simulator produced.

    ``peak_*`` are the simulator's own peaks over the replay. ``oom_*`` is set when a request
    could not be served; ``oom_message`` is the message PyTorch would print.
    """

    events: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    final_allocated_bytes: int
    final_reserved_bytes: int
    num_device_alloc: int
    num_device_free: int
    num_alloc_retries: int
    segment_events: tuple[SegmentEvent, ...]
    final_segments: tuple[dict, ...]
    memory_stats: dict[str, int]
    oom: bool = False
    oom_event_index: int | None = None
    oom_message: str | None = None
    alloc_conf: str = ""
    # Verification against a recording (None when there was nothing to compare).
    segment_events_recorded: int | None = None
    segment_events_matched: int | None = None
    final_state_matches: bool | None = None
    first_divergence: Divergence | None = None
    # Recorded allocs that the simulator served at another address (verify mode).
    allocs_misplaced: int | None = None
    # Recorded allocs whose block address the simulator's placement was checked against.
    allocs_checked: int | None = None
    # How many readings of the trace's ambiguous points verify replayed, keeping the best.
    readings_tried: int | None = None
    recorded_peak_reserved_bytes: int | None = None
    torch_version: str | None = None
    warnings: tuple[str, ...] = field(default_factory=tuple)

    @property
    def verified(self) -> bool | None:
        """Whether verify mode checked anything: ``False`` when the trace held no segment
        decision and no block placement to compare (0 of 0 is not a match); ``None`` outside
        verify mode."""
        if self.segment_events_recorded is None:
            return None
        return self.segment_events_recorded + (self.allocs_checked or 0) > 0

    @property
    def reproduced(self) -> bool:
        """Verify checked something and every decision, placement and the final state matched."""
        return (
            self.verified is True
            and self.first_divergence is None
            and self.final_state_matches is not False
            and not self.allocs_misplaced
        )

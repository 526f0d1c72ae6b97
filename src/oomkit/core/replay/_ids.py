"""Trace ids to simulated pointers, for replays of request-only traces (synthetic or traced)."""

from __future__ import annotations

from oomkit.errors import TraceFormatError

__all__ = ["FreeTracker"]


class FreeTracker:
    """The two-phase free of a trace id: ``free_requested`` then ``free_completed``.

    A block becomes reusable at ``free_completed``, not ``free_requested`` (issue 2 §3); a
    ``free_completed`` with no request before it frees a live id in one step.
    ``live`` maps ids to pointers; callers add to it on ``alloc`` (kept inline: the hot path).
    """

    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.pending: dict[int, int] = {}

    def request(self, index: int, address: int) -> None:
        """``free_requested`` of ``address`` at event ``index``."""
        ptr = self.live.pop(address, None)
        if ptr is None:
            raise _not_live(index, address, "free_requested")
        self.pending[address] = ptr

    def complete(self, index: int, address: int) -> int:
        """``free_completed`` of ``address`` at event ``index``: the pointer to free (0 for none)."""
        ptr = self.pending.pop(address, None)
        if ptr is None:
            ptr = self.live.pop(address, None)
            if ptr is None:
                raise _not_live(index, address, "free_completed")
        return ptr


def _not_live(index: int, address: int, action: str) -> TraceFormatError:
    return TraceFormatError(
        f"event {index}: {action} of id {address:#x}, which is not live. Check that the trace "
        "holds the matching alloc."
    )

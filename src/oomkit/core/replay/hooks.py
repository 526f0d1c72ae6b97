"""What a replay adds to the one replay loop (:class:`~oomkit.core.replay.engine.ReplayEngine`).

Kept apart from the loop: a compiled build (``scripts/compile_allocator.py``) compiles the loop
with the allocator, and these hooks stay a plain Python class that verification, prediction and
tests subclass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from oomkit.core.allocator import SimulatedOutOfMemoryError
from oomkit.core.trace import TraceEvent
from oomkit.errors import OomkitError, TraceFormatError

__all__ = ["ReplayHooks", "overridden"]


class ReplayHooks:
    """What a replay adds to :class:`ReplayEngine`'s loop; override what you need.

    The defaults replay a request-only trace strictly: an id that is not live, or an alloc of a
    live id, raises ``TraceFormatError``; segment and ``oom`` entries are decisions, not
    requests, and are skipped; an out-of-memory stops the replay and is its outcome.
    ``after_alloc``, ``after_event`` and ``completes_later`` are called only when
    :meth:`uses` says so (by default: when a subclass overrides them), so a replay without them
    pays nothing per event.
    """

    def uses(self, name: str) -> bool:
        """Whether the engine must call the per-event hook ``name`` (``after_alloc``,
        ``after_event`` or ``completes_later``); default: when a subclass overrides it."""
        return getattr(type(self), name) is not getattr(ReplayHooks, name)

    def misplaced(self, index: int, event: TraceEvent, ptr: int) -> None:
        """With ``check_addresses``: the alloc at ``index`` was served at ``ptr``, not at the
        recorded ``event.address``."""

    def after_alloc(self, index: int, event: TraceEvent, ptr: int) -> None:
        """An ``alloc`` at trace ``index`` was served at simulated pointer ``ptr``."""

    def after_event(self, index: int, event: TraceEvent) -> None:
        """Event ``index`` was fed (not called for the event that stopped the replay)."""

    def unknown_id(self, index: int, event: TraceEvent) -> None:
        """A free of an id that is not live. Return to skip the event."""
        raise TraceFormatError(
            f"event {index}: {event.action} of id {event.address:#x}, which is not live. "
            "Check that the trace holds the matching alloc."
        )

    def duplicate_alloc(self, index: int, event: TraceEvent) -> None:
        """An alloc of an id that is still live or awaiting its ``free_completed``.

        Return to serve it anyway (the id then names the new block).
        """
        raise TraceFormatError(
            f"event {index}: id {event.address:#x} is allocated twice without a free; "
            "each alloc needs a distinct id while it is live."
        )

    def completes_later(self, index: int) -> bool:
        """Deferred-free replays only: whether the ``free_completed`` at ``index`` is left to the
        next request's Step 9 synchronize (§4.2) instead of completing here."""
        return False

    def segment_release(self, index: int, event: TraceEvent) -> None:
        """A recorded ``segment_free`` / ``segment_unmap`` (§15.3); skipped by default."""

    def oom_event(self, index: int, event: TraceEvent) -> None:
        """A recorded ``oom`` entry (§15.11); skipped by default."""

    def out_of_memory(
        self, index: int, event: TraceEvent, error: SimulatedOutOfMemoryError
    ) -> bool:
        """The simulator could not serve event ``index``; the replay stops there.

        Returns:
            True when this is the replay's outcome (``ReplayEngine.oom_index`` is set).
        """
        return True

    def failed(self, index: int, event: TraceEvent, error: OomkitError) -> None:
        """Event ``index`` raised another oomkit error; re-raised unless overridden (then the
        replay stops there)."""
        raise error


def overridden(hooks: ReplayHooks, name: str) -> Callable[..., Any] | None:
    """The hook's bound method, or None when the hooks do not use it (bound once, not per event)."""
    if not hooks.uses(name):
        return None
    method: Callable[..., Any] = getattr(hooks, name)
    return method

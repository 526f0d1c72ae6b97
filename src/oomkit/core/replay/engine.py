"""The one replay loop: trace events fed to a ``CachingAllocator``, with hooks for what differs.

Every replay (``simulate_events``, ``replay_snapshot``, the predictor's pass) runs this loop. It
resolves trace ids (recorded addresses or synthetic ids) to simulated pointers once, frees in two
phases (``free_requested`` / ``free_completed``), stops at the first request the simulator cannot
serve, and leaves the rest to a :class:`ReplayHooks` object: verification against a recording,
per-event accounting, what an unknown id or an ``oom`` entry means.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from oomkit.core.allocator import CachingAllocator, SimulatedOutOfMemoryError
from oomkit.core.replay.result import ReplayResult
from oomkit.core.trace import TraceEvent
from oomkit.errors import OomkitError, TraceFormatError

__all__ = ["CREATE", "RELEASE", "SEGMENT_ACTIONS", "ReplayEngine", "ReplayHooks", "gc_paused"]

# The segment decisions PyTorch's trace records (ref §15.1): creations and releases.
CREATE = ("segment_alloc", "segment_map")
RELEASE = ("segment_free", "segment_unmap")
SEGMENT_ACTIONS = CREATE + RELEASE


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


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while open (back on after, if it was on).

    A replay makes and drops blocks, pool entries and records by the thousand; each collection
    those allocations trigger walks every object the process holds, the loaded trace included
    (issue 41: 10-17% of a real-trace verify's CPU, measured with perf). Nothing a replay
    computes depends on it, and its garbage has no cycles (a merged or released block is
    referenced by nothing): reference counting frees it as before.
    """
    paused = gc.isenabled()
    if paused:
        gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()


def _overridden(hooks: ReplayHooks, name: str) -> Callable[..., Any] | None:
    """The hook's bound method, or None when the hooks do not use it (bound once, not per event)."""
    if not hooks.uses(name):
        return None
    method: Callable[..., Any] = getattr(hooks, name)
    return method


class ReplayEngine:
    """Feeds trace events to one allocator; ``live`` / ``pending`` map trace ids to pointers.

    Two free semantics, by ``deferred_frees``:

    - ``False`` (oomkit's request-only traces, issue 2 §3): the block stays allocated until its
      ``free_completed``; a ``free_completed`` without a request frees a live id in one step.
    - ``True`` (PyTorch's recorded traces, §15.8): ``free_requested`` frees with
      ``deferred=True`` (allocated drops now) and ``free_completed`` makes the block reusable;
      a request directly followed by its own completion is one plain free. Needs a sequence
      of events (it looks one event ahead).

    Two per-event duties are done in the loop itself rather than through a hook call (a replay
    runs them millions of times): with ``check_addresses`` an alloc served elsewhere than its
    recorded address calls ``hooks.misplaced``; with ``log_index`` the trace index at which
    each new entry of the allocator's ``segment_log`` came is appended to it. ``current`` is
    the index of the event being fed, for allocator callbacks during it: set before every event
    that may call into them (an alloc, a release, an ``oom``, ``empty_cache``; a free never
    obtains memory), not per free, which is most of a trace.
    """

    def __init__(
        self,
        allocator: CachingAllocator,
        hooks: ReplayHooks | None = None,
        *,
        deferred_frees: bool = False,
        check_addresses: bool = False,
        log_index: list[int] | None = None,
    ) -> None:
        self.allocator = allocator
        self.hooks = hooks if hooks is not None else ReplayHooks()
        self.deferred_frees = deferred_frees
        self.check_addresses = check_addresses
        self.log_index = log_index
        self.current = 0
        self.live: dict[int, int] = {}  # trace id -> simulated pointer, live blocks
        self.pending: dict[int, int] = {}  # freed, waiting for free_completed
        self.replayed = 0  # events fed, the one that stopped the replay included
        self.oom_index: int | None = None
        self.oom_error: SimulatedOutOfMemoryError | None = None

    def run(self, events: Iterable[TraceEvent]) -> None:
        """Feed ``events`` in order (consumed once) until they end or one stops the replay.

        Python's cyclic garbage collector is paused meanwhile (:func:`gc_paused`).
        """
        with gc_paused():
            self._feed(events)

    def _feed(self, events: Iterable[TraceEvent]) -> None:
        """:meth:`run`'s loop."""
        hooks = self.hooks
        after_alloc = _overridden(hooks, "after_alloc")
        after_event = _overridden(hooks, "after_event")
        completes_later = _overridden(hooks, "completes_later")
        check = self.check_addresses
        log_index = self.log_index
        allocator = self.allocator
        segment_log = allocator.segment_log
        logged = len(segment_log)
        malloc, free, complete_free = allocator.malloc, allocator.free, allocator.complete_free
        live, pending = self.live, self.pending
        deferred = self.deferred_frees
        if deferred and not isinstance(events, Sequence):
            events = tuple(events)
        seq: Sequence[TraceEvent] = events if isinstance(events, Sequence) else ()
        n = len(seq)
        numbered = enumerate(events)
        index = -1
        event: Any = None
        ptr: int | None
        try:
            for index, event in numbered:
                action = event.action
                if action == "alloc":
                    self.current = index
                    address = event.address
                    if address in live or address in pending:
                        hooks.duplicate_alloc(index, event)
                    ptr = malloc(event.size, event.stream)
                    live[address] = ptr
                    if check and ptr != address:
                        hooks.misplaced(index, event, ptr)
                    if after_alloc is not None:
                        after_alloc(index, event, ptr)
                elif action == "free_requested":
                    ptr = live.pop(event.address, None)
                    if ptr is None:
                        hooks.unknown_id(index, event)
                    elif not deferred:
                        pending[event.address] = ptr
                    elif (
                        index + 1 < n
                        and (nxt := seq[index + 1]).action == "free_completed"
                        and nxt.address == event.address
                    ):
                        # Its own completion comes next: one free, unless that completion is
                        # left to the next request's Step 9 (then deferred, completed there).
                        # (A free never logs a segment event: memory is only released by
                        # malloc's Step 9 and empty_cache, so no log_index check here.)
                        if completes_later is None:
                            free(ptr)
                        else:
                            free(ptr, deferred=completes_later(index + 1))
                        if after_event is None:
                            # The completion changes nothing: the checks below are done.
                            index, event = next(numbered)
                            continue
                        after_event(index, event)
                        index, event = next(numbered)
                    else:
                        free(ptr, deferred=True)
                        pending[event.address] = ptr
                elif action == "free_completed":
                    ptr = pending.pop(event.address, None)
                    if deferred:
                        if ptr is None:
                            hooks.unknown_id(index, event)
                        elif completes_later is None or not completes_later(index):
                            # §15.8: a deferred free completes here, not at its free_requested.
                            complete_free(ptr)
                    else:
                        if ptr is None:
                            ptr = live.pop(event.address, None)
                        if ptr is None:
                            hooks.unknown_id(index, event)
                        else:
                            free(ptr)
                else:
                    self.current = index
                    if action == "empty_cache":
                        # oomkit's own action (traces from its tracer); PyTorch never records it.
                        allocator.empty_cache()
                    elif action in RELEASE:
                        hooks.segment_release(index, event)
                    elif action == "oom":
                        hooks.oom_event(index, event)
                # segment_alloc / segment_map happen inside malloc; "snapshot" carries no
                # request (§15.9).
                if log_index is not None and len(segment_log) != logged:
                    log_index.extend([index] * (len(segment_log) - logged))
                    logged = len(segment_log)
                if after_event is not None:
                    after_event(index, event)
        except SimulatedOutOfMemoryError as exc:
            self._note_log(index, logged)
            if hooks.out_of_memory(index, event, exc):
                self.oom_index, self.oom_error = index, exc
        except OomkitError as exc:
            self._note_log(index, logged)
            hooks.failed(index, event, exc)
        self.replayed = index + 1
        self.current = max(index, 0)

    def _note_log(self, index: int, logged: int) -> None:
        """Segment events logged during the event that stopped the replay came at ``index``."""
        log = self.allocator.segment_log
        if self.log_index is not None and len(log) != logged:
            self.log_index.extend([index] * (len(log) - logged))

    def result(
        self,
        *,
        alloc_conf: str,
        torch_version: str | None,
        final_segments: list[dict[str, Any]] | None = None,
        **fields: Any,
    ) -> ReplayResult:
        """The replay's record from the allocator's final state; ``fields`` adds the rest.

        ``final_segments``: ``allocator.snapshot()`` when the caller already took it.
        """
        allocator = self.allocator
        if final_segments is None:
            final_segments = allocator.snapshot()
        stats = allocator.memory_stats()
        return ReplayResult(
            events=self.replayed,
            peak_allocated_bytes=stats["allocated_bytes.all.peak"],
            peak_reserved_bytes=stats["reserved_bytes.all.peak"],
            final_allocated_bytes=stats["allocated_bytes.all.current"],
            final_reserved_bytes=stats["reserved_bytes.all.current"],
            num_device_alloc=stats["num_device_alloc"],
            num_device_free=stats["num_device_free"],
            num_alloc_retries=stats["num_alloc_retries"],
            segment_events=tuple((e[0], e[1], e[2]) for e in allocator.segment_log),
            final_segments=tuple(final_segments),
            memory_stats=stats,
            oom=self.oom_index is not None,
            oom_event_index=self.oom_index,
            oom_message=str(self.oom_error) if self.oom_error is not None else None,
            alloc_conf=alloc_conf,
            torch_version=torch_version,
            **fields,
        )

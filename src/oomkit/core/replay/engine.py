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
from itertools import islice
from typing import TYPE_CHECKING, Any

from oomkit.core.allocator import CachingAllocator, SimulatedOutOfMemoryError
from oomkit.core.allocator.block import Block
from oomkit.core.replay.columns import (
    ALLOC,
    CHECKED_ALLOC,
    FREE_COMPLETED,
    FREE_REQUESTED,
    TraceColumns,
    trace_columns,
)
from oomkit.core.replay.hooks import ReplayHooks, overridden
from oomkit.core.replay.result import ReplayResult
from oomkit.core.trace import TraceEvent
from oomkit.errors import AllocatorUsageError, OomkitError, TraceFormatError

if TYPE_CHECKING:
    # Native 64-bit integers for mypyc (an annotation only: never imported at run time).
    from mypy_extensions import i64

__all__ = ["CREATE", "RELEASE", "SEGMENT_ACTIONS", "ReplayEngine", "ReplayHooks", "gc_paused"]

# The segment decisions PyTorch's trace records (ref §15.1): creations and releases.
CREATE = ("segment_alloc", "segment_map")
RELEASE = ("segment_free", "segment_unmap")
SEGMENT_ACTIONS = CREATE + RELEASE
# A trace given as an iterator is read this many events at a time.
_CHUNK_EVENTS = 65_536


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


class ReplayEngine:
    """Feeds trace events to one allocator; trace ids resolve to simulated pointers.

    Two free semantics, by ``deferred_frees``:

    - ``False`` (oomkit's request-only traces, issue 2 §3): the block stays allocated until its
      ``free_completed``; a ``free_completed`` without a request frees a live id in one step.
    - ``True`` (PyTorch's recorded traces, §15.8): ``free_requested`` frees with
      ``deferred=True`` (allocated drops now) and ``free_completed`` makes the block reusable;
      a request directly followed by its own completion is one plain free. Needs a sequence
      of events (it looks one event ahead).

    The loop reads the trace as integer columns (``columns.py``): an id is a slot, and a slot's
    block is ``live_blocks[slot]`` while it is live and ``pending_blocks[slot]`` while its free
    waits for ``free_completed`` (None: none). The loop keeps the allocator's block objects
    (``serve_block``) and hands them back (``free_served``, ``complete_served``), so a free
    looks nothing up by address (issue 41). A 0-byte alloc has no block (malloc returns
    address 0, DeviceCachingAllocator::malloc's nullptr): its slot is in ``null_live`` /
    ``null_pending`` instead, and its frees are the allocator's ``free(0)`` /
    ``complete_free(0)``. :meth:`hold` states what was live or pending before the run (a
    replay's seeded state); ``live`` and ``pending`` read them back by trace id.

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
        self.hooks: ReplayHooks = hooks if hooks is not None else ReplayHooks()
        self.deferred_frees = deferred_frees
        self.check_addresses = check_addresses
        self.log_index = log_index
        self.current = 0
        # Trace id -> its block, live or pending before the run (hold()).
        self._held_live: dict[Any, Block] = {}
        self._held_pending: dict[Any, Block] = {}
        self._slot_of: dict[Any, int] = {}  # trace id -> slot, of the trace run
        self.live_blocks: list[Block | None] = []  # slot -> its block while live, else None
        # slot -> its block while its free is pending, else None
        self.pending_blocks: list[Block | None] = []
        # Slots live / pending with a 0-byte alloc (address 0, no block).
        self.null_live: set[int] = set()
        self.null_pending: set[int] = set()
        self.replayed = 0  # events fed, the one that stopped the replay included
        self.oom_index: int | None = None
        self.oom_error: SimulatedOutOfMemoryError | None = None

    def run(self, events: Iterable[TraceEvent], columns: TraceColumns | None = None) -> None:
        """Feed ``events`` in order (consumed once) until they end or one stops the replay.

        Args:
            events: the trace; a sequence, or any iterable (read in chunks) unless
                ``deferred_frees`` (which looks one event ahead).
            columns: ``trace_columns(events)`` when the caller keeps them (a snapshot replayed
                many times); else built here.

        Python's cyclic garbage collector is paused meanwhile (:func:`gc_paused`).
        """
        with gc_paused():
            if columns is not None and isinstance(events, Sequence):
                self._feed_all(events, columns)
            elif isinstance(events, Sequence) or self.deferred_frees:
                seq = events if isinstance(events, Sequence) else tuple(events)
                self._feed_all(seq, trace_columns(seq))
            else:
                self._feed_chunks(iter(events))

    def hold(self, trace_id: int, ptr: int, *, pending: bool = False) -> None:
        """Before :meth:`run`: ``trace_id`` is live at ``ptr`` (``pending``: freed, waiting for
        its ``free_completed``), as a replay's seeded state is.

        Raises:
            AllocatorUsageError: the allocator has no active block at ``ptr``.
        """
        self._hold_block(trace_id, ptr, self.allocator.active_block(ptr), pending)

    def hold_seeded(self, held: Sequence[tuple[int, bool]]) -> None:
        """:meth:`hold` for each ``(address, pending)`` of a seeded start state, with the
        address as its id; a pending block is first freed with its completion deferred (§15.8).
        One call per replay, not two per block from interpreted code (issue 41).

        The blocks are found without asking the allocator by address (it would keep its map
        by address for the whole replay, ``active_blocks.py``): seeding an allocator that held
        nothing made them active in the order ``held`` lists them (segment by segment, in
        address order), which is checked block by block; otherwise a map made here finds them.
        """
        allocator = self.allocator
        active = allocator.active_blocks.values()
        in_order = len(active) == len(held)
        j = 0
        while in_order and j < len(held):
            in_order = active[j].ptr == held[j][0]
            j += 1
        found: list[Block | None] = []
        if in_order:
            found.extend(active)
        else:
            by_address = {block.ptr: block for block in active}
            found = [by_address.get(address) for address, _ in held]
        for j in range(len(held)):
            address, pending = held[j]
            block = found[j]
            if pending and block is not None:
                allocator.free_served(block, True)
            self._hold_block(address, address, block, pending)

    def _hold_block(self, trace_id: Any, ptr: int, block: Block | None, pending: bool) -> None:
        """:meth:`hold` of the active ``block`` found at ``ptr`` (None: none there)."""
        if block is None:
            raise AllocatorUsageError(
                f"hold: the allocator has no block at {ptr:#x} for id {trace_id!r}; hold only "
                "addresses it handed out (or seeded) and has not freed."
            )
        (self._held_pending if pending else self._held_live)[trace_id] = block

    @property
    def live(self) -> dict[Any, int]:
        """Trace id -> simulated pointer of every live id (a new dict)."""
        return self._by_id(self._held_live, self.live_blocks, self.null_live)

    @property
    def pending(self) -> dict[Any, int]:
        """Trace id -> simulated pointer of every id whose free waits for its completion."""
        return self._by_id(self._held_pending, self.pending_blocks, self.null_pending)

    def _by_id(
        self, held: dict[Any, Block], blocks: list[Block | None], null: set[int]
    ) -> dict[Any, int]:
        out = {key: block.ptr for key, block in held.items()}
        for key, slot in self._slot_of.items():
            block = blocks[slot]
            if block is not None:
                out[key] = block.ptr
            elif slot in null:
                out[key] = 0
        return out

    def _feed_all(self, events: Sequence[TraceEvent], columns: TraceColumns) -> None:
        """Feed a whole trace given with its columns."""
        self._hold(columns.slot_of)
        self._feed(events, columns, 0)

    def _feed_chunks(self, events: Iterator[TraceEvent]) -> None:
        """Feed an iterable in chunks (memory stays bounded by a chunk's columns)."""
        slot_of: dict[Any, int] = {}
        base = 0
        held = False
        while True:
            chunk = tuple(islice(events, _CHUNK_EVENTS))
            columns = trace_columns(chunk, slot_of)
            if not held:
                # Ids the seeded state holds get their slots before the trace names them.
                for key in (*self._held_live, *self._held_pending):
                    slot_of.setdefault(key, len(slot_of))
                self._hold(slot_of)
                held = True
            if not self._feed(chunk, columns, base) or len(chunk) < _CHUNK_EVENTS:
                return
            base += len(chunk)

    def _hold(self, slot_of: dict[Any, int]) -> None:
        """Size the slot lists for ``slot_of`` and move the held ids into them (an id the
        trace never names cannot be freed by it: it stays held)."""
        self._slot_of = slot_of
        self._grow(len(slot_of))
        for held, blocks in (
            (self._held_live, self.live_blocks),
            (self._held_pending, self.pending_blocks),
        ):
            for key in [key for key in held if key in slot_of]:
                blocks[slot_of[key]] = held.pop(key)

    def _feed(self, events: Sequence[TraceEvent], columns: TraceColumns, base: int) -> bool:
        """:meth:`run`'s loop over ``events`` (trace indices from ``base``); False when an
        event stopped the replay."""
        hooks = self.hooks
        after_alloc = overridden(hooks, "after_alloc")
        after_event = overridden(hooks, "after_event")
        completes_later = overridden(hooks, "completes_later")
        check = self.check_addresses
        log_index = self.log_index
        allocator = self.allocator
        segment_log = allocator.segment_log
        logged = len(segment_log)
        self._grow(len(columns.slot_of))
        live = self.live_blocks
        pending = self.pending_blocks
        null_live = self.null_live
        null_pending = self.null_pending
        # Whether a 0-byte alloc may be live or pending (a native flag, not a set's truth
        # value, on every alloc and completion); once set it stays set for this call.
        nulls = len(null_live) + len(null_pending) > 0
        deferred = self.deferred_frees
        actions = columns.actions
        slots = columns.slots
        addresses = columns.addresses
        sizes = columns.sizes
        streams = columns.streams
        # Native 64-bit positions (compiled: the column reads index with machine integers, no
        # tagged-integer arithmetic per event, issue 41).
        n: i64 = len(actions)
        index = base - 1
        i: i64 = 0
        k: i64 = 0  # allocs fed: their index in sizes, streams and addresses
        slot: i64 = 0
        completed = False  # the event is the completion of the free just done
        try:
            for i in range(n):
                index = base + i
                action = actions[i]
                if completed:
                    # It changes nothing: its request freed the block (see below).
                    completed = False
                elif action == ALLOC or action == CHECKED_ALLOC:
                    self.current = index
                    slot = slots[i]
                    if (
                        live[slot] is not None
                        or pending[slot] is not None
                        or (nulls and (slot in null_live or slot in null_pending))
                    ):
                        hooks.duplicate_alloc(index, events[i])
                    if action == ALLOC:
                        served = allocator.serve_block(sizes[k], streams[k])
                        ptr = served.ptr
                        misplaced = ptr != addresses[k]
                        live[slot] = served
                        if nulls:
                            null_live.discard(slot)
                    else:
                        # Its own values (Any: not read as ints), for malloc's checks to judge.
                        unchecked: Any = events[i]
                        ptr = allocator.malloc(unchecked.size, unchecked.stream)
                        misplaced = ptr != unchecked.address
                        self._served_checked(slot, ptr)
                        nulls = nulls or ptr == 0
                    k += 1
                    if check and misplaced:
                        hooks.misplaced(index, events[i], ptr)
                    if after_alloc is not None:
                        after_alloc(index, events[i], ptr)
                elif action == FREE_REQUESTED:
                    slot = slots[i]
                    block = live[slot]
                    if block is None:
                        if nulls and slot in null_live:
                            completed = self._null_free_requested(
                                i, index, slot, actions, slots, completes_later
                            )
                        else:
                            hooks.unknown_id(index, events[i])
                    else:
                        live[slot] = None
                        if not deferred:
                            pending[slot] = block
                        elif i + 1 < n and actions[i + 1] == FREE_COMPLETED and slots[i + 1] == slot:
                            # Its own completion comes next: one free, unless that completion is
                            # left to the next request's Step 9 (then deferred, completed there).
                            # (A free never logs a segment event: memory is only released by
                            # malloc's Step 9 and empty_cache, so no log_index check here.)
                            if completes_later is None:
                                allocator.free_served(block)
                            else:
                                allocator.free_served(block, bool(completes_later(index + 1)))
                            completed = True
                        else:
                            allocator.free_served(block, True)
                            pending[slot] = block
                elif action == FREE_COMPLETED:
                    slot = slots[i]
                    block = pending[slot]
                    pending[slot] = None
                    if block is None and nulls:
                        self._null_free_completed(index, events[i], slot, completes_later)
                    elif deferred:
                        if block is None:
                            hooks.unknown_id(index, events[i])
                        elif completes_later is None or not completes_later(index):
                            # §15.8: a deferred free completes here, not at its free_requested.
                            allocator.complete_served(block)
                    else:
                        if block is None:
                            block = live[slot]
                            live[slot] = None
                        if block is None:
                            hooks.unknown_id(index, events[i])
                        else:
                            allocator.free_served(block)
                else:
                    self.current = index
                    event = events[i]
                    name: Any = event.action
                    if name == "empty_cache":
                        # oomkit's own action (traces from its tracer); PyTorch never records it.
                        allocator.empty_cache()
                    elif name == "allocator_settings":
                        # oomkit's own too: torch.cuda.memory._set_allocator_settings(text) at
                        # this point (AllocatorConfig runtime update of the live allocator).
                        allocator.set_allocator_settings(_setting_of(event))
                    elif name in RELEASE:
                        hooks.segment_release(index, event)
                    elif name == "oom":
                        hooks.oom_event(index, event)
                    # segment_alloc / segment_map happen inside malloc; "snapshot" carries no
                    # request (§15.9).
                if log_index is not None and action != FREE_REQUESTED and action != FREE_COMPLETED:
                    # A free never logs a segment event (memory is released only by malloc's
                    # Step 9 and empty_cache): only the other events are checked (issue 41).
                    if len(segment_log) != logged:
                        log_index.extend([index] * (len(segment_log) - logged))
                        logged = len(segment_log)
                if after_event is not None:
                    after_event(index, events[i])
        except SimulatedOutOfMemoryError as exc:
            self._stopped(index, logged)
            if hooks.out_of_memory(index, events[i], exc):
                self.oom_index, self.oom_error = index, exc
            return False
        except OomkitError as exc:
            self._stopped(index, logged)
            hooks.failed(index, events[i], exc)
            return False
        self.replayed = index + 1
        self.current = max(index, 0)
        return True

    def _grow(self, slots: int) -> None:
        """Room in the slot lists for ``slots`` ids."""
        grow = slots - len(self.live_blocks)
        if grow > 0:
            none: list[Block | None] = [None] * grow
            self.live_blocks.extend(none)
            self.pending_blocks.extend(none)

    # A 0-byte alloc (CHECKED_ALLOC, rare): address 0, no block. These keep the rules of the
    # loop above for a slot whose pointer is 0, with the allocator's public free(0) (a no-op,
    # like freeing nullptr) and complete_free(0) (there is nothing pending at 0: it raises).

    def _served_checked(self, slot: int, ptr: int) -> None:
        """A checked alloc of ``slot`` was served at ``ptr`` (0 for 0 bytes)."""
        if ptr == 0:
            self.null_live.add(slot)
            self.live_blocks[slot] = None
        else:
            self.null_live.discard(slot)
            self.live_blocks[slot] = self.allocator.active_block(ptr)

    def _null_free_requested(
        self,
        i: int,
        index: int,
        slot: int,
        actions: list[int],
        slots: list[int],
        completes_later: Callable[[int], bool] | None,
    ) -> bool:
        """The free_requested of a 0-byte alloc's slot; True when its own completion comes next
        and was done with it (deferred frees)."""
        self.null_live.discard(slot)
        allocator = self.allocator
        if not self.deferred_frees:
            self.null_pending.add(slot)
            return False
        if i + 1 < len(actions) and actions[i + 1] == FREE_COMPLETED and slots[i + 1] == slot:
            if completes_later is None:
                allocator.free(0)
            else:
                allocator.free(0, deferred=bool(completes_later(index + 1)))
            return True
        allocator.free(0, deferred=True)
        self.null_pending.add(slot)
        return False

    def _null_free_completed(
        self,
        index: int,
        event: TraceEvent,
        slot: int,
        completes_later: Callable[[int], bool] | None,
    ) -> None:
        """A free_completed whose slot has no pending block (while 0-byte allocs are live or
        pending): the loop's rules for a pending pointer of 0 or none."""
        allocator = self.allocator
        if slot in self.null_pending:
            self.null_pending.discard(slot)
            if not self.deferred_frees:
                allocator.free(0)
            elif completes_later is None or not completes_later(index):
                allocator.complete_free(0)
            return
        if self.deferred_frees:
            self.hooks.unknown_id(index, event)
            return
        block = self.live_blocks[slot]
        self.live_blocks[slot] = None
        if block is not None:
            allocator.free_served(block)
        elif slot in self.null_live:
            self.null_live.discard(slot)
            allocator.free(0)
        else:
            self.hooks.unknown_id(index, event)

    def _stopped(self, index: int, logged: int) -> None:
        """Event ``index`` stopped the replay: the record of how far it went."""
        self._note_log(index, logged)
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


def _setting_of(event: TraceEvent) -> str:
    """The settings text of an ``allocator_settings`` event (its ``setting`` tag)."""
    setting = event.tag("setting")
    if setting is None:
        raise TraceFormatError(
            "an allocator_settings event has no 'setting' tag (the text passed to "
            "torch.cuda.memory._set_allocator_settings): the trace is damaged; record it again"
        )
    return setting

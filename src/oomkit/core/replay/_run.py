"""One pass of a recorded trace through the simulator (ref §15), for ``replay_snapshot``.

``Run`` is the :class:`~oomkit.core.replay.engine.ReplayEngine`'s hooks for a recording: it
seeds the reconstructed starting state, answers the allocator's ``device_malloc`` and
``segment_address`` callbacks (from the recording in verify mode, from the capacity and synthetic
addresses in a what-if), replays release runs and ``oom`` entries, and notes where the simulator
disagrees with the recording.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter

from oomkit.core.allocator import AllocatorConfig, CachingAllocator, SimulatedOutOfMemoryError
from oomkit.core.replay._compare import (
    SegmentKey,
    first_divergence,
    first_segment_difference,
    seed_segment_keys,
    seed_segments_as_dicts,
    simulated_segment_keys,
)
from oomkit.core.replay._prepared import SeedPlan, seed_plan
from oomkit.core.replay.columns import TraceColumns
from oomkit.core.replay.engine import CREATE, RELEASE, ReplayEngine, ReplayHooks
from oomkit.core.replay.reconstruct import SeedSegment, StartState
from oomkit.core.replay.result import Divergence, ReplayResult, SegmentEvent
from oomkit.core.trace import TraceEvent
from oomkit.errors import OomkitError

__all__ = ["Run"]

# cudaMalloc returns 2 MiB-aligned addresses for these sizes; synthetic segments keep that.
_SYNTHETIC_ALIGN_BYTES = 2 * 2**20
_ACTION = attrgetter("action")


class Run(ReplayHooks):
    """One pass over a recorded trace: the allocator, its oracle callbacks and the engine."""

    def __init__(
        self,
        events: Sequence[TraceEvent],
        start: StartState,
        config: AllocatorConfig,
        *,
        capacity_bytes: int,
        torch_version: str | None,
        recorded: Sequence[tuple[int, SegmentEvent]],
        verify: bool,
        flipped: frozenset[int] = frozenset(),
        groups: dict[int, int] | None = None,
        allocs: int | None = None,
        reserved_outside_bytes: int = 0,
        columns: TraceColumns | None = None,
        final_keys: tuple[Sequence[SeedSegment], list[SegmentKey]] | None = None,
        seed: SeedPlan | None = None,
    ) -> None:
        self.events = events
        self.columns = columns  # trace_columns(events), kept by the caller
        # (final, seed_segment_keys(final)), kept by the caller (final_matches).
        self.final_keys = final_keys
        self.allocs = allocs  # alloc entries in events, when the caller counted them
        # Ambiguous points (release runs and completion groups, by first trace index) replayed
        # with their other reading (_verify_run).
        self.flipped = flipped
        self.groups = groups or {}
        # A flipped completion group leaves its frees pending until the next request's Step 9.
        self._sync_first = False
        self.problems = 0  # misplaced allocs, served ooms, an early stop
        self.first_problem_index: int | None = None
        self.start = start
        self.config = config
        self.verify = verify
        self.torch_version = torch_version
        self.recorded = [r for _, r in recorded]
        self.recorded_index = [i for i, _ in recorded]
        self.warnings: list[str] = []
        self.current = 0  # trace index of the event being replayed
        self.misplaced_count = 0  # allocs the simulator placed elsewhere than the recording
        self.readings_tried = 1  # replays _verify_run ran to pick this one (itself included)
        self.log_index: list[int] = []  # trace index at which each simulated segment event came
        # The first synthetic address, found when a segment first needs one (a verify run that
        # follows its recording never does; finding it reads the whole trace).
        self._next_synthetic: int | None = None
        self.allocator = CachingAllocator(
            config,
            capacity_bytes=capacity_bytes,
            reserved_outside_bytes=reserved_outside_bytes,
            torch_version=torch_version,
            device_malloc=self._device_malloc if verify else None,
            segment_address=self._segment_address,
        )
        self.engine = ReplayEngine(
            self.allocator,
            self,
            deferred_frees=True,
            check_addresses=verify,
            log_index=self.log_index,
        )
        if seed is None:
            seed = seed_plan(start, [ev for ev in events if ev.action in CREATE])
        self._seed(seed)

    # -- oracle callbacks -------------------------------------------------------------------

    def _expected_creation(self) -> SegmentEvent | None:
        """The recorded creation the simulator should make now, if the recording made one."""
        k = len(self.allocator.segment_log)
        if k < len(self.recorded):
            rec = self.recorded[k]
            if rec[0] in CREATE and self.recorded_index[k] < self.engine.current:
                return rec
        return None

    def _device_malloc(self, size_bytes: int) -> bool:
        # §15.4: whether a cudaMalloc or page map succeeded is a fact of the recording: it did
        # when the recording shows a creation for this request that the simulator has not made.
        if self._sync_first:
            # The recording completed frees in this request's Step 9: the first attempt failed.
            self._sync_first = False
            return False
        return self._expected_creation() is not None

    def _segment_address(self, size_bytes: int, expandable: bool) -> int:
        # §15.5: addresses from the trace's segment_alloc (or an expandable reservation's first
        # segment_map); new segments of a what-if go above every recorded address.
        if self.verify:
            rec = self._expected_creation()
            if rec is not None:
                return rec[1]
        address = self._next_synthetic
        if address is None:
            address = _synthetic_base(self.start, self.events)
        step = -(-size_bytes // _SYNTHETIC_ALIGN_BYTES) * _SYNTHETIC_ALIGN_BYTES
        self._next_synthetic = address + step
        return address

    # -- starting state ---------------------------------------------------------------------

    def _seed(self, plan: SeedPlan) -> None:
        for base, stream, is_small, first_run in plan.reservations:
            try:
                self.allocator.seed_reservation(base, stream, is_small=is_small, first_run=first_run)
            except OomkitError as refusal:
                self.warnings.append(f"reservation at {base:#x} could not be seeded: {refusal}")
        refused = self.allocator.seed_segments(plan.rows, plan.checks)
        if not any(refused):
            self.engine.hold_seeded(plan.held_all)
            return
        # The live blocks of the segments seeded, held in one call (as hold_seeded expects).
        held: list[tuple[int, bool]] = []
        for seg, exc, seg_held in zip(self.start.segments, refused, plan.held, strict=True):
            if exc is not None:
                self.warnings.append(f"segment at {seg.address:#x} could not be seeded: {exc}")
            else:
                held.extend(seg_held)
        self.engine.hold_seeded(held)

    # -- the replay: engine hooks -----------------------------------------------------------

    def replay(self) -> None:
        self.engine.run(self.events, self.columns)

    def uses(self, name: str) -> bool:
        # The engine keeps log_index and checks addresses itself; the per-alloc and per-free
        # hooks matter only when a completion group is replayed with its other reading.
        if name == "after_event":
            return False
        if name in ("after_alloc", "completes_later"):
            return bool(self.flipped)
        return super().uses(name)

    def after_alloc(self, index: int, event: TraceEvent, ptr: int) -> None:
        self._sync_first = False

    def misplaced(self, index: int, event: TraceEvent, ptr: int) -> None:
        self.misplaced_count += 1
        self._problem(index)
        if not self._misplaced_warned:
            self._misplaced_warned = True
            self.warnings.append(
                f"event {index}: the simulator placed an alloc of {event.size:,} B at {ptr:#x}, "
                f"the recording at {event.address:#x}"
            )

    def duplicate_alloc(self, index: int, event: TraceEvent) -> None:
        # A recorded address names whichever block the recording put there last.
        pass

    def completes_later(self, index: int) -> bool:
        if self.groups.get(index, -1) in self.flipped:
            # Completed by the next request's Step 9 synchronize (see _verify_run).
            self._sync_first = True
            return True
        return False

    def segment_release(self, index: int, event: TraceEvent) -> None:
        # §15.3: a run of releases with no request between them is one cache release
        # (empty_cache or the OOM path); only its first event triggers it.
        first = index == 0 or self.events[index - 1].action not in RELEASE
        # After frees that the next request's Step 9 completes, its releases are Step 9's
        # too: they come after its failed cache lookup, so they are left to its malloc.
        if (
            first
            and not self._sync_first
            and self._left_to_malloc(index) == (index in self.flipped)
        ):
            self.allocator.release_cached_blocks()

    def oom_event(self, index: int, event: TraceEvent) -> None:
        # §15.11: the request the program never got. Verify expects it to fail again; a
        # what-if retries it (running out stops the replay) and, if it is served now, frees it
        # at once.
        a = self.allocator
        try:
            ptr = a.malloc(event.size, event.stream)
        except SimulatedOutOfMemoryError:
            if not self.verify:
                raise
            return
        finally:
            self._sync_first = False
        a.free(ptr)
        if self.verify:
            self._problem(index)
            self.warnings.append(
                f"event {index}: the recording ran out of memory for {event.size:,} B but the "
                "simulator served it"
            )

    def out_of_memory(
        self, index: int, event: TraceEvent, error: SimulatedOutOfMemoryError
    ) -> bool:
        if not self.verify:
            return True
        self._problem(index)
        self.warnings.append(
            f"event {index}: the simulator ran out of memory where the recording did not "
            f"({event.action} of {event.size:,} B); the replay stopped there"
        )
        return False

    def failed(self, index: int, event: TraceEvent, error: OomkitError) -> None:
        self._problem(index)
        self.warnings.append(f"event {index}: {error}; the replay stopped there")

    def _left_to_malloc(self, i: int) -> bool:
        """Whether the release run at ``i`` is left to the next request's own malloc.

        With ``max_split_size`` set, a release run that ends in a creation or an ``oom`` may be
        Step 8 freeing only oversize blocks (§15.3); in verify mode the simulator's malloc,
        refused cudaMalloc until it has released what the recording did, reproduces Step 8 and
        Step 9 exactly. Everything else is replayed as release_cached_blocks.
        """
        if not self.verify or self.config.max_split_size_bytes is None:
            return False
        j = i
        events = self.events
        while j < len(events) and events[j].action in RELEASE:
            j += 1
        return j < len(events) and events[j].action in (*CREATE, "oom")

    _misplaced_warned = False
    _unknown_warned = False
    _final_matches: tuple[Sequence[SeedSegment], bool] | None = None
    _snapshot: list[dict] | None = None

    def unknown_id(self, index: int, event: TraceEvent) -> None:
        if not self._unknown_warned:
            self._unknown_warned = True
            self.warnings.append(
                f"event {index}: {event.action} of {event.address:#x}, which the replay does "
                "not hold live; it was skipped"
            )

    # -- the record ---------------------------------------------------------------------------

    def _problem(self, i: int) -> None:
        self.problems += 1
        if self.first_problem_index is None:
            self.first_problem_index = i

    def final_matches(self, final: Sequence[SeedSegment]) -> bool:
        """Whether the simulator's segments equal the snapshot's final ones.

        Asked once the replay has ended (``score``, ``first_problem``, ``result``), so the answer
        is kept: normalising thousands of segments twice per run cost more than the replay.
        """
        if self._final_matches is None or self._final_matches[0] is not final:
            known = self.final_keys
            expected = (
                known[1] if known is not None and known[0] is final else seed_segment_keys(final)
            )
            matches = simulated_segment_keys(self.final_snapshot()) == expected
            self._final_matches = (final, matches)
        return self._final_matches[1]

    def close(self) -> None:
        """Free the allocator's state and the final snapshot now: once the record is built, or
        when this run is not the one kept. (A run is a reference cycle, its engine's hooks, so
        what it holds would otherwise wait for a garbage collection, walked by it.)

        The cycles through this run end here too: its engine's hooks (this run) and its
        allocator's device callbacks (its bound methods). Dropped, the run, its start state, trace
        columns and final keys go by reference counting as the caller lets go of it, not at the
        next collection, which walked them all (issue 41: 4,700 objects per real-trace verify).
        """
        self.allocator.close()
        self.engine.hooks = ReplayHooks()
        self._snapshot = None
        self._final_matches = None

    def final_snapshot(self) -> list[dict]:
        """``allocator.snapshot()`` once the replay has ended, computed once."""
        if self._snapshot is None:
            self._snapshot = self.allocator.snapshot()
        return self._snapshot

    def score(self, final: Sequence[SeedSegment]) -> tuple[int, int, bool]:
        """How well the replay agrees with the recording; higher is better."""
        matched, _ = self.compare()
        return matched, -self.problems, self.final_matches(final)

    def first_problem(self, final: Sequence[SeedSegment]) -> int | None:
        """The trace index where the replay first disagrees with the recording, or None."""
        _, divergence = self.compare()
        found = [
            i
            for i in (
                divergence.trace_event_index if divergence is not None else None,
                self.first_problem_index,
            )
            if i is not None
        ]
        if found:
            return min(found)
        if divergence is None and not self.final_matches(final):
            return len(self.events) - 1 if self.events else None
        return None

    def compare(self) -> tuple[int, Divergence | None]:
        """How many recorded segment events the simulator matched in order, and the first miss."""
        return first_divergence(
            self.recorded,
            self.recorded_index,
            [tuple(e) for e in self.allocator.segment_log],  # type: ignore[misc]
            self.log_index,
            self.events,
        )

    def _allocs_replayed(self) -> int:
        """How many alloc entries the replay fed (counted by the caller when it fed them all)."""
        replayed = self.engine.replayed
        if self.allocs is not None and replayed == len(self.events):
            return self.allocs
        return list(map(_ACTION, self.events[:replayed])).count("alloc")

    def result(
        self,
        final: Sequence[SeedSegment],
        recorded_peak: int,
        warnings: tuple[str, ...],
        *,
        compare: bool,
    ) -> ReplayResult:
        verify_fields: dict = {}
        if self.verify and compare:
            matched, divergence = self.compare()
            difference = (
                None
                if self.final_matches(final)
                else first_segment_difference(
                    tuple(self.final_snapshot()), seed_segments_as_dicts(final)
                )
            )
            if difference is not None:
                warnings = (*warnings, f"final state differs: {difference}")
            verify_fields = {
                "segment_events_recorded": len(self.recorded),
                "segment_events_matched": matched,
                "final_state_matches": difference is None,
                "first_divergence": divergence,
                "allocs_misplaced": self.misplaced_count,
                # Every alloc replayed had its placement compared (the engine's check_addresses).
                "allocs_checked": self._allocs_replayed(),
                "readings_tried": self.readings_tried,
            }
        return self.engine.result(
            final_segments=self.final_snapshot(),
            alloc_conf=str(self.config),
            torch_version=self.torch_version,
            recorded_peak_reserved_bytes=recorded_peak,
            warnings=warnings,
            **verify_fields,
        )


def _synthetic_base(start: StartState, events: Sequence[TraceEvent]) -> int:
    """The first synthetic segment address: above every recorded address (§15.5)."""
    top = 0
    for seg in start.segments:
        top = max(top, seg.address + seg.total_size)
    for ev in events:
        # An oom entry's address field is device_free, not an address. (No max(): per event.)
        if ev.action != "oom" and ev.address + ev.size > top:
            top = ev.address + ev.size
    return -(-top // _SYNTHETIC_ALIGN_BYTES) * _SYNTHETIC_ALIGN_BYTES + _SYNTHETIC_ALIGN_BYTES

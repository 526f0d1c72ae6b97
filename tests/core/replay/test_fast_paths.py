"""The optimised replay paths against plain ones: every segment decision must be the same.

The optimisations of issue 19 are checked against straightforward versions written here:
the address-ordered index that seeding uses for its overlap check (against a scan of every held
block), the engine's in-loop bookkeeping (against the per-event hooks it replaced),
replay_snapshot's one-pass bookkeeping (completion groups, the allocs above hidden blocks, the
final-state keys) against scans of the whole trace, and the allocator's written-out malloc and
free against the plain paths.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _shared_snapshots import SHARED_FILES, needs_shared
from hypothesis import given, settings
from hypothesis import strategies as st

from oomkit.core.allocator import AllocatorConfig, CachingAllocator
from oomkit.core.replay._compare import (
    normalise_segments,
    seed_segment_keys,
    seed_segments_as_dicts,
    simulated_segment_keys,
)
from oomkit.core.replay._prepared import completion_groups as _completion_groups
from oomkit.core.replay._recorded import final_segments_for
from oomkit.core.replay._run import Run
from oomkit.core.replay.columns import CHECKED_ALLOC, trace_columns
from oomkit.core.replay.engine import SEGMENT_ACTIONS, ReplayHooks
from oomkit.core.replay.reconstruct import _first_alloc_addresses, _FirstAllocs, _walk
from oomkit.core.replay.snapshot_replay import replay_snapshot
from oomkit.core.snapshot import load_snapshot
from oomkit.core.trace import TraceEvent
from oomkit.errors import AllocatorUsageError

MiB = 2**20
BASE = 0x7000_0000_0000

# ---------------------------------------------------------------------------------------------
# Seeding: index vs a plain scan


def _plain_overlap(allocator: CachingAllocator, address: int, size: int) -> bool:
    """The straightforward check: does [address, +size) overlap any block the allocator holds?"""
    end = address + size
    return any(b.ptr < end and address < b.ptr + b.size for b in allocator._held_blocks())


def _seed(allocator: CachingAllocator, address: int, size: int, small: bool) -> bool:
    try:
        allocator.seed_segment(
            address, size, 0, is_small=small, blocks=[(address, size, size // 2, True)]
        )
    except AllocatorUsageError as exc:
        assert "overlaps" in str(exc)
        return False
    return True


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["seed", "malloc", "free", "empty_cache"]),
            st.integers(0, 63),  # 2 MiB slot
            st.integers(1, 6),  # length in slots
        ),
        max_size=40,
    )
)
def test_seed_overlap_index_decides_as_a_plain_scan(ops):
    """Seeding accepts and refuses exactly the ranges a scan of every held block would, even
    with mallocs, frees and releases between seeds (the index is rebuilt after them)."""
    # New segments go to the lowest free addresses of the seeded range (as cudaMalloc reuses
    # freed ranges), so seeds and segments interleave.
    def place(size: int, expandable: bool) -> int:
        address = BASE
        while _plain_overlap(a, address, size):
            address += 2 * MiB
        return address

    a = CachingAllocator(capacity_bytes=2**40, segment_address=place)
    live: list[int] = []
    decisions = []
    for op, slot, length in ops:
        if op == "seed":
            address, size = BASE + slot * 2 * MiB, length * 2 * MiB
            expected = not _plain_overlap(a, address, size)
            decisions.append((address, size, expected))
            assert _seed(a, address, size, small=False) == expected
        elif op == "malloc":
            live.append(a.malloc(length * 3 * MiB))
        elif op == "free" and live:
            a.free(live.pop(slot % len(live)))
        elif op == "empty_cache":
            a.empty_cache()
    held = sorted((b.ptr, b.ptr + b.size) for b in a._held_blocks())
    for (_start, end), (nxt, _) in zip(held, held[1:], strict=False):
        assert end <= nxt  # never two holders of one byte
    accepted = [d for d in decisions if d[2]]
    for address, size, _ in accepted:
        assert any(s <= address and address + size <= e for s, e in _runs(held))


def _runs(held: list[tuple[int, int]]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for start, end in held:
        if runs and runs[-1][1] == start:
            runs[-1] = (runs[-1][0], end)
        else:
            runs.append((start, end))
    return runs


def test_seeding_many_segments_visits_no_held_block_per_segment():
    """Seeding 2,000 segments never walks the held blocks (the quadratic scan of issue 19)."""
    a = CachingAllocator(capacity_bytes=2**44)
    walks = [0]
    held = a._seed_target.held_blocks

    def counting():
        walks[0] += 1
        return held()

    object.__setattr__(a._seed_target, "held_blocks", counting)
    for k in range(2_000):
        address = BASE + k * 4 * MiB
        a.seed_segment(address, 2 * MiB, 0, is_small=True, blocks=[(address, 2 * MiB, 0, False)])
    assert walks[0] == 1
    assert a.memory_stats()["segment.all.current"] == 2_000
    with pytest.raises(AllocatorUsageError, match=f"at {BASE + 1_000 * 4 * MiB:#x}"):
        a.seed_segment(BASE + 1_000 * 4 * MiB + MiB, MiB, 0, is_small=True,
                       blocks=[(BASE + 1_000 * 4 * MiB + MiB, MiB, 0, True)])
    a.malloc(30 * MiB)  # a new segment: the next seed rebuilds the index once
    a.seed_segment(BASE - 2 * MiB, 2 * MiB, 0, is_small=True, blocks=[(BASE - 2 * MiB, 2 * MiB, 0, False)])
    assert walks[0] == 2


# ---------------------------------------------------------------------------------------------
# The engine: in-loop bookkeeping vs the per-event hooks


class _PlainRun(Run):
    """Run with the engine's in-loop duties done the plain way: a hook call per event."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.engine.log_index = None
        self.engine.check_addresses = False
        self._logged = len(self.allocator.segment_log)

    def uses(self, name: str) -> bool:
        return ReplayHooks.uses(self, name)

    def _plain_note(self, index: int) -> None:
        k = len(self.allocator.segment_log)
        self.log_index.extend([index] * (k - self._logged))
        self._logged = k

    def after_event(self, index: int, event: TraceEvent) -> None:
        self._plain_note(index)

    def after_alloc(self, index: int, event: TraceEvent, ptr: int) -> None:
        self._sync_first = False
        if self.verify and ptr != event.address:
            self.misplaced(index, event, ptr)

    def completes_later(self, index: int) -> bool:
        return super().completes_later(index)

    def out_of_memory(self, index, event, error):
        self._plain_note(index)
        return super().out_of_memory(index, event, error)

    def failed(self, index, event, error):
        self._plain_note(index)
        super().failed(index, event, error)


def _both(monkeypatch, path: Path, **kwargs):
    from oomkit.core.replay import snapshot_replay

    snapshot = load_snapshot(path)
    device = snapshot.devices()[0] if snapshot.devices() else 0
    runs = {}
    for label, cls in (("fast", Run), ("plain", _PlainRun)):
        made: list[Run] = []

        def factory(*a, _cls=cls, _made=made, **k):
            run = _cls(*a, **k)
            _made.append(run)
            return run

        monkeypatch.setattr(snapshot_replay, "Run", factory)
        result = replay_snapshot(snapshot, device, **kwargs)
        runs[label] = (result, made)
    return runs


@needs_shared
@pytest.mark.parametrize("path", SHARED_FILES, ids=lambda p: p.name)
def test_fast_and_plain_engine_make_every_segment_decision_alike(monkeypatch, path):
    """Verify and an expandable what-if of every shared snapshot: the same segment decisions,
    at the same trace indices, the same misplaced allocs, warnings and final state."""
    for kwargs in ({"verify": True}, {"config": AllocatorConfig.parse("expandable_segments:True")}):
        runs = _both(monkeypatch, path, **kwargs)
        (fast, fast_runs), (plain, plain_runs) = runs["fast"], runs["plain"]
        assert len(fast_runs) == len(plain_runs) >= 1
        for f, p in zip(fast_runs, plain_runs, strict=True):
            assert f.allocator.segment_log == p.allocator.segment_log
            assert f.log_index == p.log_index
            assert len(f.log_index) == len(f.allocator.segment_log)
            assert (f.misplaced_count, f.problems) == (p.misplaced_count, p.problems)
        assert fast == plain


# ---------------------------------------------------------------------------------------------
# One-pass bookkeeping of replay_snapshot vs plain scans of the whole trace


def _plain_completion_groups(events: list[TraceEvent]) -> dict[int, int]:
    """The straightforward scan: every run of free_completed followed by a segment event/oom."""
    groups: dict[int, int] = {}
    i = 0
    while i < len(events):
        if events[i].action != "free_completed":
            i += 1
            continue
        j = i
        while j < len(events) and events[j].action == "free_completed":
            j += 1
        if j < len(events) and events[j].action in (*SEGMENT_ACTIONS, "oom"):
            for k in range(i, j):
                groups[k] = i
        i = j
    return groups


def _plain_later_allocs(events: list[TraceEvent], hidden: list[int]) -> dict[int, set]:
    """For each hidden block, every (index, address) of an alloc strictly above it and below the
    next hidden block: a scan of every alloc per block."""
    ordered = sorted(hidden)
    out = {}
    for k, h in enumerate(ordered):
        hi = ordered[k + 1] if k + 1 < len(ordered) else None
        out[h] = {
            (i, ev.address)
            for i, ev in enumerate(events)
            if ev.action == "alloc" and ev.address > h and (hi is None or ev.address < hi)
        }
    return out


_ACTIONS = ["alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "oom"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(_ACTIONS), st.integers(0, 40)), max_size=60))
def test_completion_groups_from_marks_equal_a_plain_scan(entries):
    """The completion groups found by walking back from each segment event or oom are exactly
    those of a forward scan of the whole trace."""
    events = [TraceEvent(a, 512 * k, 512) for a, k in entries]
    assert _completion_groups(events) == _plain_completion_groups(events)
    marks = [i for i, ev in enumerate(events) if ev.action in (*SEGMENT_ACTIONS, "oom")]
    assert _completion_groups(events, marks) == _plain_completion_groups(events)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(_ACTIONS), st.integers(0, 40)), max_size=60),
    st.lists(st.integers(0, 40), max_size=8, unique=True),
)
def test_later_allocs_by_bisect_equal_a_plain_scan(entries, hidden_slots):
    """The allocs listed above each hidden block (one bisect per alloc) are those a scan of
    every alloc per block finds, in trace order."""
    events = [TraceEvent(a, 512 * k, 512) for a, k in entries]
    hidden = [512 * k for k in hidden_slots]
    found = _first_alloc_addresses(events, hidden)
    plain = _plain_later_allocs(events, hidden) if hidden else {}
    assert {h: set(v) for h, v in found.items()} == plain
    for listed in found.values():
        assert [i for i, _ in listed] == sorted(i for i, _ in listed)


@needs_shared
@pytest.mark.parametrize("path", SHARED_FILES, ids=lambda p: p.name)
def test_final_state_keys_equal_the_normalised_dicts(path):
    """The verify's final-state keys (no dicts, no conversions) equal normalise_segments of the
    dicts, for the simulator's final state and for the recorded one."""
    snapshot = load_snapshot(path)
    device = snapshot.devices()[0] if snapshot.devices() else 0
    final, _ = final_segments_for(snapshot, device)
    assert seed_segment_keys(final) == normalise_segments(seed_segments_as_dicts(final))
    result = replay_snapshot(snapshot, device, verify=True)
    simulated = [dict(seg) for seg in result.final_segments]
    assert simulated_segment_keys(simulated) == normalise_segments(simulated)
    if final:
        assert len(seed_segment_keys(final)) == len(final)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(_ACTIONS), st.integers(0, 40)), max_size=60),
    st.integers(0, 42),
    st.integers(0, 42),
)
def test_earliest_alloc_in_a_gap_equals_a_plain_scan(entries, lo_slot, hi_slot):
    """_FirstAllocs.earliest_in (first index per address, one bisect) finds the alloc a scan of
    every alloc in trace order finds first in [start, end)."""
    events = [TraceEvent(a, 512 * k, 512) for a, k in entries]
    start, end = 512 * min(lo_slot, hi_slot), 512 * max(lo_slot, hi_slot)
    plain = next(
        ((i, ev.address) for i, ev in enumerate(events)
         if ev.action == "alloc" and start <= ev.address < end),
        None,
    )
    assert _FirstAllocs(events).earliest_in(start, end) == plain


# ---------------------------------------------------------------------------------------------
# Seeding: one stats increase per segment vs one per block


def _plain_seed_stats(segments, max_split: int) -> dict[str, int]:
    """The seeded stats as a per-block loop of increase_stat gives them (current and peak)."""
    from oomkit.core.allocator import stats as st

    stats = st.AllocatorStats()
    for small, blocks in segments:
        kind = st.SMALL_POOL if small else st.LARGE_POOL
        stats.up(kind, st.SEGMENT, 1)
        if sum(b[1] for b in blocks) >= max_split:
            stats.up_all(st.OVERSIZE_SEGMENTS, 1)
        for _ptr, size, requested, allocated in blocks:
            if allocated:
                for i in (st.ALLOCATION, st.ACTIVE):
                    stats.up(kind, i, 1)
                for i in (st.ALLOCATED_BYTES, st.ACTIVE_BYTES):
                    stats.up(kind, i, size)
                stats.up(kind, st.REQUESTED_BYTES, requested)
                if size >= max_split:
                    stats.up_all(st.OVERSIZE_ALLOCATIONS, 1)
            elif len(blocks) > 1:
                stats.up(kind, st.INACTIVE_SPLIT, 1)
                stats.up(kind, st.INACTIVE_SPLIT_BYTES, size)
    out = st.build_memory_stats(stats.lists, dict.fromkeys(st.COUNTERS, 0), -1)
    return {k: v for k, v in out.items() if k.endswith((".current", ".peak")) and "reserved" not in k}


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.booleans(), st.lists(st.tuples(st.integers(1, 12), st.booleans()), min_size=1, max_size=5)),
        min_size=1,
        max_size=6,
    ),
    st.sampled_from(["", "max_split_size_mb:24"]),
)
def test_seeded_stats_equal_a_per_block_loop(layout, setting):
    """Seeding counts allocated, active, requested, inactive-split and oversize stats (current
    and peak) exactly as one increase per block does."""
    allocator = CachingAllocator(AllocatorConfig.parse(setting))
    segments = []
    address = BASE
    for small, parts in layout:
        unit = 512 if small else MiB * 2
        blocks, ptr, prev_free = [], address, False
        for units, allocated in parts:
            if not allocated and prev_free:
                allocated = True  # free neighbours are always merged
            blocks.append((ptr, units * unit, units * unit - 1, allocated))
            ptr += units * unit
            prev_free = not allocated
        total = ptr - address
        allocator.seed_segment(address, total, 0, is_small=small, blocks=blocks)
        segments.append((small, blocks))
        address += -(-total // (20 * MiB)) * 20 * MiB
    max_split = 24 * MiB if setting else 2**64
    got = {k: v for k, v in allocator.memory_stats().items() if k in _plain_seed_stats(segments, max_split)}
    assert got == _plain_seed_stats(segments, max_split)


# ---------------------------------------------------------------------------------------------
# The reconstruction's backward walk: what it notes on the way vs plain forward scans


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([*_ACTIONS, "segment_map", "segment_unmap", "snapshot"]),
                          st.integers(0, 40)), max_size=80))
def test_walk_notes_marks_allocs_and_first_allocs_as_plain_scans(entries):
    """The backward walk's segment/oom positions, alloc count and first-alloc index equal a
    forward scan for each (what _prepare and the hidden-block queries read instead of passes
    over the whole trace)."""
    events = [TraceEvent(a, 2 * MiB * k, 2 * MiB) for a, k in entries]
    walk = _walk((), events)
    marked = (*SEGMENT_ACTIONS, "oom")
    assert list(reversed(walk.marks)) == [i for i, ev in enumerate(events) if ev.action in marked]
    assert walk.allocs == sum(ev.action == "alloc" for ev in events)
    assert walk.first_alloc == _FirstAllocs(events).first_index
    made = _FirstAllocs.from_first_index(walk.first_alloc)
    assert made.addresses == _FirstAllocs(events).addresses


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([*_ACTIONS, "segment_map", "snapshot", "empty_cache"]),
            st.integers(0, 40),
            st.sampled_from([2 * MiB, 0, 512]),
        ),
        max_size=80,
    )
)
def test_columns_from_the_walk_equal_the_columns_read_from_the_trace(entries):
    """The action codes and alloc events the backward walk notes make the same trace columns
    as trace_columns reading every event (zero-byte allocs still left to malloc's checks)."""
    events = [TraceEvent(a, 2 * MiB * k, size) for a, k, size in entries]
    walk = _walk((), events)
    fast = trace_columns(events, actions=walk.actions, allocs=walk.alloc_events)
    plain = trace_columns(events)
    for name in ("actions", "slots", "sizes", "streams", "addresses", "slot_of"):
        assert getattr(fast, name) == getattr(plain, name), name
    zero_byte_allocs = sum(a == "alloc" and size == 0 for a, _, size in entries)
    assert fast.actions.count(CHECKED_ALLOC) == zero_byte_allocs


@settings(max_examples=100, deadline=None)
@given(
    st.integers(0, 2**48),
    st.integers(1, 2**40),
    st.integers(0, 2**40),
    st.sampled_from(["active_allocated", "active_pending_free", "inactive"]),
)
def test_new_seed_block_is_the_dataclass_record(address, size, requested, state):
    """new_seed_block (slots set directly) makes the record SeedBlock(...) makes: equal, same
    hash and repr, and still frozen."""
    import dataclasses

    from oomkit.core.replay.reconstruct import SeedBlock, new_seed_block

    fast, plain = new_seed_block(address, size, requested, state), SeedBlock(address, size, requested, state)
    assert type(fast) is SeedBlock
    assert fast == plain and hash(fast) == hash(plain) and repr(fast) == repr(plain)
    assert dataclasses.astuple(fast) == (address, size, requested, state)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.size = 1  # type: ignore[misc]


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 2**48), st.integers(1, 2**40), st.integers(0, 8), st.booleans(), st.booleans())
def test_new_seed_segment_is_the_dataclass_record(address, total, stream, small, expandable):
    """new_seed_segment makes the record SeedSegment(...) makes: equal, same hash, frozen."""
    import dataclasses

    from oomkit.core.replay.reconstruct import SeedBlock, SeedSegment, new_seed_segment

    blocks = (SeedBlock(address, total, 0, "inactive"),)
    fast = new_seed_segment(address, total, stream, small, expandable, blocks)
    plain = SeedSegment(address, total, stream, small, expandable, blocks)
    assert type(fast) is SeedSegment and fast == plain and hash(fast) == hash(plain)
    assert fast.end == address + total
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.stream = 1  # type: ignore[misc]

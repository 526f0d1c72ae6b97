"""Replaying recorded snapshots: verify against the recording, and what-if (ref §15)."""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import pytest
from _shared_snapshots import SHARED_FILES, SHARED_SNAPSHOTS
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from oomkit.core.allocator import AllocatorConfig, CachingAllocator, SimulatedOutOfMemoryError
from oomkit.core.replay import UnknownDeviceError, replay_snapshot
from oomkit.core.replay._prepared import reservation_bases
from oomkit.core.replay.reconstruct import SeedSegment, StartState
from oomkit.core.snapshot import load_snapshot, write_snapshot
from oomkit.core.trace import TraceEvent
from oomkit.errors import AllocatorUsageError

MiB = 2**20
# The hand-built recordings model a pre-2026 release: equal-size ties go to the lowest address.
VERSION = "2.5"


# ---------------------------------------------------------------------------------------------
# The real snapshots in ../shared/snapshots


SHARED = SHARED_SNAPSHOTS
# Recorded segment events (segment_alloc/free/map/unmap) per file, from the README's counts.
SEGMENT_EVENTS = {
    "3e8aa21ab5__mem_snapshots_cuda_single_step.pickle": 1,
    "3e8aa21ab5__mem_snapshots_inference2_peso_oct.pickle": 39,
    "3e8aa21ab5__mem_snapshots_traditional_single_step.pickle": 4,
    "b6026285a7__my_snapshot.pickle": 14,
    "752276c112__my_snapshot.pickle": 21,
    "d47727a245__my_snapshot.pickle": 27,
    "db23ad8d0e__my_snapshot.pickle": 20,
    "e67173f362__my_snapshot.pickle": 48,
}


@pytest.mark.skipif(not SHARED_FILES, reason=f"no shared snapshots at {SHARED}")
@pytest.mark.parametrize("path", SHARED_FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_shared_snapshot_is_reproduced_exactly(path):
    """Every recorded segment decision, every alloc address and the final state are reproduced."""
    snapshot = load_snapshot(path)
    for device in snapshot.devices():
        result = replay_snapshot(snapshot, device, verify=True)
        assert result.first_divergence is None, result.first_divergence
        assert result.final_state_matches is True
        assert result.segment_events_recorded == SEGMENT_EVENTS.get(path.name, 0)
        assert result.segment_events_matched == result.segment_events_recorded
        assert result.allocs_misplaced == 0
        assert result.events == len(snapshot.device_traces.get(device, ()))


# ---------------------------------------------------------------------------------------------
# Hand-built recordings: a simulated program, recorded the way PyTorch records its trace


class Recording:
    """Drives a simulated allocator as a program would, and keeps the trace PyTorch would write.

    Segment events come from the allocator's own log, in the order PyTorch records them
    (releases and creations of a malloc before its ``alloc``, §4.2).
    """

    def __init__(
        self, config: str = "", capacity_bytes: int = 80 * 2**30, version: str = VERSION
    ) -> None:
        self.version = version
        self.config = AllocatorConfig.parse(config, version)
        self.allocator = CachingAllocator(
            self.config, capacity_bytes=capacity_bytes, torch_version=version
        )
        self.events: list[TraceEvent] = []
        self._logged = 0
        self._live: dict[int, tuple[int, int]] = {}  # ptr -> (request, stream)
        self._pending: dict[int, tuple[int, int]] = {}  # ptr -> (request, stream)
        self._stream_at: dict[int, int] = {}  # segment (or mapped range) address -> stream

    def _segments(self, stream: int) -> None:
        # PyTorch records each segment event with the segment's stream: creations happen on
        # the requesting stream; a release names the stream its segment was created on.
        for action, address, size in self.allocator.segment_log[self._logged :]:
            if action in ("segment_alloc", "segment_map"):
                self._stream_at[address] = stream
                seg_stream = stream
            else:
                seg_stream = self._stream_at[max(a for a in self._stream_at if a <= address)]
            self.events.append(
                TraceEvent(action=action, address=address, size=size, stream=seg_stream)
            )
        self._logged = len(self.allocator.segment_log)

    def malloc(self, nbytes: int, stream: int = 0) -> int | None:
        syncs = self._syncs() if self._pending else 0
        try:
            ptr = self.allocator.malloc(nbytes, stream)
        except SimulatedOutOfMemoryError as exc:
            self._synchronized(syncs)
            self._segments(stream)
            self.events.append(
                TraceEvent(action="oom", address=exc.free_bytes, size=exc.rounded_bytes, stream=stream)
            )
            return None
        self._synchronized(syncs)
        self._segments(stream)
        self.events.append(TraceEvent(action="alloc", address=ptr, size=nbytes, stream=stream))
        self._live[ptr] = (nbytes, stream)
        return ptr

    def _syncs(self) -> int:
        return self.allocator.memory_stats()["num_sync_all_streams"]

    def _synchronized(self, before: int) -> None:
        # Step 9 synchronizes every stream first: pending frees complete, recorded before the
        # releases (§4.2).
        if self._pending and self._syncs() > before:
            for ptr, (nbytes, stream) in self._pending.items():
                self.events.append(
                    TraceEvent(action="free_completed", address=ptr, size=nbytes, stream=stream)
                )
            self._pending.clear()

    def free(self, ptr: int, *, deferred: bool = False) -> None:
        nbytes, stream = self._live.pop(ptr)
        self.events.append(TraceEvent(action="free_requested", address=ptr, size=nbytes, stream=stream))
        self.allocator.free(ptr, deferred=deferred)
        if deferred:
            self._pending[ptr] = (nbytes, stream)
        else:
            self.events.append(TraceEvent(action="free_completed", address=ptr, size=nbytes, stream=stream))

    def complete(self, ptr: int) -> None:
        """The events a deferred free waited on completed (a no-op once synchronized)."""
        if ptr not in self._pending:
            return
        nbytes, stream = self._pending.pop(ptr)
        self.allocator.complete_free(ptr)
        self.events.append(TraceEvent(action="free_completed", address=ptr, size=nbytes, stream=stream))

    def empty_cache(self) -> None:
        # empty_cache synchronizes first: pending frees complete (free_completed), then release.
        for ptr in list(self._pending):
            self.complete(ptr)
        self.allocator.release_cached_blocks()
        self._segments(0)

    def start_recording(self) -> None:
        """Forget everything so far: the trace will begin mid-run (§15.1)."""
        self.events.clear()

    def settings(self) -> dict:
        c = self.config
        return {
            "PYTORCH_CUDA_ALLOC_CONF": str(c),
            "max_split_size": -1 if c.max_split_size_bytes is None else c.max_split_size_bytes,
            "garbage_collection_threshold": c.garbage_collection_threshold,
            "expandable_segments": c.expandable_segments,
            "release_lock_on_cudamalloc": False,
            "roundup_power2_divisions": {str(1 << k): d for k, d in enumerate(c.roundup_power2_divisions)},
        }

    def snapshot(self, tmp_path: Path, *, settings: bool = True):
        path = tmp_path / "recorded.pickle"
        write_snapshot(
            path,
            self.allocator.snapshot(),
            {0: list(self.events)},
            self.settings() if settings else None,
        )
        return load_snapshot(path)


def verify(snapshot, version=VERSION):
    result = replay_snapshot(snapshot, 0, verify=True, torch_version=version)
    assert result.first_divergence is None, result.first_divergence
    assert not any("simulator" in w for w in result.warnings), result.warnings
    assert result.final_state_matches is True
    assert result.segment_events_matched == result.segment_events_recorded
    assert result.allocs_misplaced == 0
    return result


def test_mid_run_start_with_hidden_block_sizes(tmp_path):
    """A trace that starts mid-run, freeing blocks whose true size it never shows, is exact."""
    rec = Recording()
    a = rec.malloc(5 * MiB)  # new 20 MiB segment S: [a 5 | free 15]
    b = rec.malloc(10 * MiB)  # [a 5 | b 10 | free 5]
    rec.free(a)  # [free 5 | b 10 | free 5]
    # 4 MiB takes the lowest 5 MiB block whole (a 1 MiB leftover is not split): 5 MiB.
    h = rec.malloc(4 * MiB)
    rec.free(b)  # [h 5 | free 15]
    big = rec.malloc(30 * MiB)  # its own 30 MiB segment
    keep = rec.malloc(6 * MiB + 1)  # lands in S's free 15 MiB block
    rec.start_recording()
    rec.free(big)  # freed during the trace: hidden size
    c = rec.malloc(3 * MiB)  # must land right after keep: reveals nothing new
    rec.free(h)  # hidden 5 MiB block freed
    d = rec.malloc(25 * MiB)  # reuses big's cached segment
    rec.empty_cache()
    rec.malloc(40 * MiB)  # a new segment during the trace
    del c, d, keep
    snapshot = rec.snapshot(tmp_path)
    result = verify(snapshot)
    assert result.segment_events_recorded == 1
    assert any("hidden" in w for w in result.warnings)


def test_alloc_inside_the_assumed_gap_reveals_a_hidden_size(tmp_path):
    """A live-at-start block larger than its rounded request is sized from a later alloc."""
    rec = Recording()
    a = rec.malloc(5 * MiB)
    b = rec.malloc(10 * MiB)
    rec.free(a)
    h = rec.malloc(4 * MiB)  # 5 MiB block: [h 5 | b 10 | free 5]
    rec.free(b)  # [h 5 | free 15]
    rec.start_recording()
    c = rec.malloc(3 * MiB)  # at S + 5 MiB; a 4 MiB guess for h would put it at S + 4 MiB
    rec.free(h)
    del c
    verify(rec.snapshot(tmp_path))


def test_unrecorded_empty_cache_is_inferred(tmp_path):
    """A run of segment_free events with no request between them replays as a cache release."""
    rec = Recording()
    blocks = [rec.malloc(n * MiB) for n in (12, 14, 16, 1)]
    rec.start_recording()
    for ptr in blocks[:3]:
        rec.free(ptr)
    rec.empty_cache()  # not in the trace: only three segment_free events
    rec.malloc(14 * MiB)
    result = verify(rec.snapshot(tmp_path))
    assert [e[0] for e in result.segment_events] == ["segment_free"] * 3 + ["segment_alloc"]


def test_oom_path_release_and_recorded_oom_are_reproduced(tmp_path):
    """cudaMalloc outcomes come from the trace: an OOM-path release and a recorded OOM."""
    rec = Recording(capacity_bytes=100 * MiB)
    x = rec.malloc(40 * MiB)
    y = rec.malloc(40 * MiB)
    rec.free(x)
    # 50 MiB: the cached 40 MiB is too small, cudaMalloc fails, Step 9 frees x's segment.
    z = rec.malloc(50 * MiB)
    assert z is not None
    assert rec.malloc(30 * MiB) is None  # a recorded oom
    rec.free(y)
    snapshot = rec.snapshot(tmp_path)
    result = verify(snapshot)
    actions = [e.action for e in snapshot.device_traces[0]]
    assert "oom" in actions
    assert result.segment_events_recorded == sum(a.startswith("segment_") for a in actions)


def test_deferred_frees_complete_at_free_completed(tmp_path):
    """A pending block is not reused until its recorded free_completed."""
    rec = Recording()
    a = rec.malloc(8 * MiB)
    rec.start_recording()
    b = rec.malloc(8 * MiB)
    rec.free(a, deferred=True)  # waits on another stream's work
    c = rec.malloc(4 * MiB)  # cannot take a's block
    rec.complete(a)
    d = rec.malloc(4 * MiB)  # now it can
    rec.free(b, deferred=True)  # still pending at the end
    del c, d
    snapshot = rec.snapshot(tmp_path)
    states = {b["state"] for s in rec.allocator.snapshot() for b in s["blocks"]}
    assert "active_pending_free" in states
    verify(snapshot)


@pytest.mark.parametrize("cached_small_segment", [False, True])
def test_frees_completed_by_the_oom_path_are_not_reused_first(tmp_path, cached_small_segment):
    """A pending free completed by Step 9's synchronize comes after the failed cache lookup."""
    rec = Recording(capacity_bytes=(30 if not cached_small_segment else 41) * MiB)
    a = rec.malloc(9 * MiB)  # a 20 MiB segment: [a 9 | 11 free]
    rec.malloc(10 * MiB)  # takes the 11 MiB whole (1 MiB leftover): [a 9 | 11]
    if cached_small_segment:
        rec.free(rec.malloc(1000))  # a cached 2 MiB segment that Step 9 can release
    rec.start_recording()
    rec.free(a, deferred=True)
    # 8 MiB: nothing free (a is pending) and a 20 MiB cudaMalloc fails; Step 9 completes a and
    # releases what it can, then retries. a's 9 MiB block is not looked at again: an OOM
    # without the cached segment, a new segment with it.
    rec.malloc(8 * MiB)
    snapshot = rec.snapshot(tmp_path)
    actions = [e.action for e in snapshot.device_traces[0]]
    if cached_small_segment:
        assert actions == [
            "free_requested", "free_completed", "segment_free", "segment_alloc", "alloc"
        ]
    else:
        assert actions == ["free_requested", "free_completed", "oom"]
    verify(snapshot)


def test_pending_free_from_before_the_trace(tmp_path):
    """A free_completed whose free_requested predates the trace completes a seeded pending block."""
    rec = Recording()
    a = rec.malloc(3 * MiB)
    rec.malloc(2 * MiB)
    rec.free(a, deferred=True)
    rec.start_recording()
    rec.complete(a)
    rec.malloc(3 * MiB)
    verify(rec.snapshot(tmp_path))


def test_expandable_segments_are_reproduced(tmp_path):
    """Maps, unmaps and a mid-run start under expandable_segments:True."""
    rec = Recording("expandable_segments:True")
    a = rec.malloc(5 * MiB)
    b = rec.malloc(30 * MiB)
    s = rec.malloc(4096)
    rec.start_recording()
    c = rec.malloc(50 * MiB)  # grows the segment past b
    d = rec.malloc(6 * MiB)
    rec.free(b)
    rec.free(c)
    rec.empty_cache()  # unmaps the whole pages of the free range
    rec.malloc(8 * MiB)
    rec.free(a)
    del d, s
    snapshot = rec.snapshot(tmp_path)
    result = verify(snapshot)
    assert {e[0] for e in result.segment_events} >= {"segment_map", "segment_unmap"}


def test_max_split_size_release_is_step_8(tmp_path):
    """With max_split_size set, an OOM-path release of oversize blocks only is reproduced."""
    rec = Recording("max_split_size_mb:30", capacity_bytes=200 * MiB)
    big = [rec.malloc(40 * MiB) for _ in range(3)]
    small = rec.malloc(25 * MiB)
    rec.start_recording()
    rec.free(big[0])
    rec.free(big[1])
    rec.free(small)
    # 60 MiB: nothing cached fits, cudaMalloc fails; Step 8 frees the two 40 MiB oversize
    # blocks and the retry succeeds, so the cached 26 MiB segment stays (empty_cache would not).
    rec.malloc(60 * MiB)
    snapshot = rec.snapshot(tmp_path)
    result = verify(snapshot)
    assert [(e[0], e[2]) for e in result.segment_events] == [
        ("segment_free", 40 * MiB), ("segment_free", 40 * MiB), ("segment_alloc", 60 * MiB)
    ]


def test_a_reservation_whose_first_pages_were_unmapped_before_recording_maps_them_again(tmp_path):
    """empty_cache unmapped the reservation's first 20 MiB page before the recording began; the
    recorded request maps it again (the lowest unmapped range with room, ref §8.3). The replay
    seeds the reservation from its base, below its lowest run at the start (§15.5), and maps
    there too; seeded from the run, it mapped 20 MiB above the run instead (found by the
    property test below: malloc 20 MiB - 511 B and 5 MiB + 1 B, free the first, empty_cache)."""
    rec = Recording("expandable_segments:True")
    first = rec.malloc(20 * MiB - 511)
    rec.malloc(5 * MiB + 1)
    rec.free(first)
    rec.empty_cache()
    rec.start_recording()
    again = rec.malloc(15 * MiB + 1)
    assert again == first
    result = verify(rec.snapshot(tmp_path))
    assert list(result.segment_events) == [("segment_map", first, 20 * MiB)]
    assert result.events == 2 and result.allocs_misplaced == 0


_BASE = 0x7F0000000000


def _start(*segments: tuple[int, int, bool]) -> StartState:
    """A start state of empty segments: (address, size, expandable), stream 0, large pool."""
    return StartState(
        segments=tuple(
            SeedSegment(address, size, 0, False, expandable, ((address, size, 0, False),))
            for address, size, expandable in segments
        ),
        hidden_blocks=0,
        warnings=(),
    )


def _event(action: str, address: int, size: int, stream: int = 0) -> TraceEvent:
    return TraceEvent(action=action, address=address, size=size, stream=stream)


def test_reservation_base_is_the_lowest_map_of_the_stream_and_pool_below_the_first_run():
    start = _start((_BASE + 40 * MiB, 20 * MiB, True))
    maps = [_event("segment_map", _BASE + 20 * MiB, 20 * MiB), _event("segment_map", _BASE, 20 * MiB)]
    assert reservation_bases(start, maps) == ((_BASE, 0, False, _BASE + 40 * MiB),)
    # A map above the first run, on another stream, or of small-pool pages says nothing.
    others = [
        _event("segment_map", _BASE + 60 * MiB, 20 * MiB),
        _event("segment_map", _BASE, 20 * MiB, stream=7),
        _event("segment_map", _BASE, 2 * MiB),
    ]
    assert reservation_bases(start, others) == ()


def test_no_reservation_base_across_a_classic_segment():
    """A reservation is one range of addresses: a cudaMalloc segment between the map and the
    first run (held at the start, or created in the trace) means the map is another's."""
    maps = [_event("segment_map", _BASE, 20 * MiB)]
    held = _start((_BASE + 20 * MiB, 2 * MiB, False), (_BASE + 40 * MiB, 20 * MiB, True))
    assert reservation_bases(held, maps) == ()
    run = _start((_BASE + 40 * MiB, 20 * MiB, True))
    made = [_event("segment_alloc", _BASE + 20 * MiB, 2 * MiB), *maps]
    assert reservation_bases(run, made) == ()


def test_seed_reservation_refuses_a_base_not_whole_pages_below_or_already_reserved():
    allocator = CachingAllocator(AllocatorConfig.parse("expandable_segments:True", VERSION))
    with pytest.raises(AllocatorUsageError, match="whole 20971520-byte pages below"):
        allocator.seed_reservation(_BASE + MiB, 0, is_small=False, first_run=_BASE + 40 * MiB)
    with pytest.raises(AllocatorUsageError, match="must be ints; got '0x7f'"):
        allocator.seed_reservation("0x7f", 0, is_small=False, first_run=_BASE + 40 * MiB)
    allocator.seed_reservation(_BASE, 0, is_small=False, first_run=_BASE + 40 * MiB)
    with pytest.raises(AllocatorUsageError, match="meets the reservation at 0x7f0000000000"):
        allocator.seed_reservation(_BASE + 20 * MiB, 0, is_small=False, first_run=_BASE + 40 * MiB)


_SIZES = st.one_of(
    st.integers(1, 300_000),  # small pool
    st.integers(1, 40 * MiB),
    # Around the rounding and split boundaries: 1 MiB leftovers, 10 MiB, 20 MiB segments.
    st.sampled_from(
        [k * MiB + d for k in (2, 4, 5, 10, 19, 20, 21, 30) for d in (-513, -1, 0, 1, 512 * 1024)]
    ),
)
_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("malloc"), _SIZES, st.sampled_from([0, 0, 0, 7])),
        st.tuples(st.sampled_from(["free", "free", "defer", "complete"]), st.integers(0, 99), st.just(0)),
        st.tuples(st.just("empty_cache"), st.just(0), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=_OPS,
    cut=st.integers(0, 60),
    conf=st.sampled_from(["", "expandable_segments:True", "max_split_size_mb:25"]),
    capacity=st.sampled_from([80 * 2**30, 150 * MiB]),
)
# Found by CI's run (2026-12-02): two empty_cache() calls, each right before a new segment,
# under max_split_size; reading the first as empty_cache alone moved the divergence to the
# second and scored lower, so the search had stopped (snapshot_replay._verify_run).
@example(
    ops=[("malloc", 1, 0), ("free", 0, 0), ("empty_cache", 0, 0), ("malloc", 1, 0),
         ("free", 0, 0), ("malloc", 1, 7), ("empty_cache", 0, 0), ("malloc", 1, 0),
         ("free", 0, 0), ("empty_cache", 0, 0)],
    cut=0,
    conf="max_split_size_mb:25",
    capacity=80 * 2**30,
)
def test_any_recorded_program_is_reproduced_from_any_starting_point(ops, cut, conf, capacity):
    """A random program, recorded from a random point on, replays exactly (§15.1-§15.8)."""
    rec = Recording(conf, capacity_bytes=capacity)
    live: list[int] = []
    pending: list[int] = []
    for k, (name, arg, stream) in enumerate(ops):
        if k == cut:
            rec.start_recording()
        if name == "malloc":
            ptr = rec.malloc(arg, stream)
            if ptr is not None:
                live.append(ptr)
        elif name in ("free", "defer") and live:
            ptr = live.pop(arg % len(live))
            rec.free(ptr, deferred=name == "defer")
            if name == "defer":
                pending.append(ptr)
        elif name == "complete" and pending:
            rec.complete(pending.pop(arg % len(pending)))
        elif name == "empty_cache":
            pending.clear()
            rec.empty_cache()
    with tempfile.TemporaryDirectory() as folder:
        snapshot = rec.snapshot(Path(folder))
    verify(snapshot)


# ---------------------------------------------------------------------------------------------
# What-if replays


def _growing(tmp_path):
    """A recording whose buffers grow step by step, each one freed before the next."""
    rec = Recording()
    keep = rec.malloc(MiB + 1)
    for n in (30, 40, 50, 60):
        ptr = rec.malloc(n * MiB)
        rec.free(ptr)
    del keep
    return rec.snapshot(tmp_path)


def test_what_if_expandable_reserves_less(tmp_path):
    """Growing buffers fit in one expandable segment; the recording's peak is reported beside."""
    snapshot = _growing(tmp_path)
    recorded = replay_snapshot(snapshot, verify=True, torch_version=VERSION)
    what_if = replay_snapshot(
        snapshot, config=AllocatorConfig.parse("expandable_segments:True"), torch_version=VERSION
    )
    assert not what_if.oom
    assert what_if.recorded_peak_reserved_bytes == recorded.peak_reserved_bytes == 200 * MiB
    assert {e[0] for e in what_if.segment_events} == {"segment_map"}
    assert what_if.peak_reserved_bytes == 80 * MiB  # four 20 MiB pages hold the 60 MiB buffer
    assert what_if.segment_events_recorded is None


def test_what_if_max_split_size_ooms_at_the_exact_request(tmp_path):
    """A capacity too small for the recorded requests ends the replay at the first failure."""
    rec = Recording()
    for _ in range(10):
        rec.malloc(100 * MiB)
    snapshot = rec.snapshot(tmp_path)
    result = replay_snapshot(
        snapshot,
        config=AllocatorConfig.parse("max_split_size_mb:200"),
        capacity_bytes=550 * MiB,
        torch_version=VERSION,
    )
    assert result.oom
    # Events alternate segment_alloc, alloc: the sixth alloc is trace event 11.
    assert result.oom_event_index == 11
    assert result.events == 12
    assert result.oom_message.startswith("CUDA out of memory. Tried to allocate 100.00 MiB")
    assert result.peak_reserved_bytes == 500 * MiB
    assert result.recorded_peak_reserved_bytes == 1000 * MiB


def test_what_if_expandable_ooms_at_the_exact_request(tmp_path):
    """Under expandable segments the same requests fail where the pages run out."""
    rec = Recording()
    for _ in range(10):
        rec.malloc(100 * MiB)
    result = replay_snapshot(
        rec.snapshot(tmp_path),
        config=AllocatorConfig.parse("expandable_segments:True"),
        capacity_bytes=550 * MiB,
        torch_version=VERSION,
    )
    assert result.oom and result.oom_event_index == 11


def test_what_if_retries_a_recorded_oom(tmp_path):
    """A recorded oom is retried; served under the new capacity, it is freed at once."""
    rec = Recording(capacity_bytes=100 * MiB)
    x = rec.malloc(60 * MiB)
    assert rec.malloc(60 * MiB) is None
    rec.free(x)
    snapshot = rec.snapshot(tmp_path)
    result = replay_snapshot(snapshot, capacity_bytes=200 * MiB, torch_version=VERSION)
    assert not result.oom
    assert result.events == len(snapshot.device_traces[0])
    assert result.peak_allocated_bytes == 120 * MiB
    assert result.final_allocated_bytes == 0
    tight = replay_snapshot(snapshot, capacity_bytes=100 * MiB, torch_version=VERSION)
    assert tight.oom and tight.oom_event_index == 2


def test_what_if_new_segments_go_above_every_recorded_address(tmp_path):
    """Synthetic addresses never collide with recorded ones (§15.5)."""
    snapshot = _growing(tmp_path)
    top = max(e.address + e.size for e in snapshot.device_traces[0])
    result = replay_snapshot(snapshot, config=AllocatorConfig.parse("max_split_size_mb:100"),
                             torch_version=VERSION)
    created = [e for e in result.segment_events if e[0] == "segment_alloc"]
    assert created and all(address >= top for _, address, _ in created)


def test_what_if_step_8_keeps_split_oversize_blocks_of_the_starting_state(tmp_path):
    """Split oversize blocks inherited from the start are not released by Step 8 (§15.11)."""
    rec = Recording()
    rec.malloc(10 * MiB)  # a 100 MiB segment made by one request, then split
    big = rec.malloc(100 * MiB)
    rec.free(big)
    rec.malloc(10 * MiB)  # [10 MiB live | 90 MiB free] in the 100 MiB segment
    rec.start_recording()
    # Without max_split_size it takes the 90 MiB block; under max_split_size_mb:50 oversize
    # rule 2 refuses it, cudaMalloc fails, and Step 8 must not free the split 90 MiB block.
    rec.malloc(60 * MiB + 1)
    snapshot = rec.snapshot(tmp_path)
    result = replay_snapshot(
        snapshot,
        config=AllocatorConfig.parse("max_split_size_mb:50"),
        capacity_bytes=150 * MiB,  # 110 MiB reserved + a 62 MiB segment does not fit
        torch_version=VERSION,
    )
    segment_bases = {s.address for s in snapshot.segments} | {
        e[1] for e in result.segment_events if e[0] == "segment_alloc"
    }
    released = [e for e in result.segment_events if e[0] == "segment_free"]
    assert all(address in segment_bases for _, address, _ in released), released


def test_what_if_never_mutates_the_snapshot(tmp_path):
    """Replays read the snapshot only."""
    snapshot = _growing(tmp_path)
    before = copy.deepcopy(snapshot)
    replay_snapshot(snapshot, config=AllocatorConfig.parse("expandable_segments:True"),
                    capacity_bytes=64 * MiB, torch_version=VERSION)
    replay_snapshot(snapshot, verify=True, torch_version=VERSION)
    assert snapshot == before


# ---------------------------------------------------------------------------------------------
# Edges


def test_segments_only_snapshot_reports_the_seeded_state(tmp_path):
    """Without a trace nothing is replayed; the final state is the seeded one."""
    rec = Recording()
    rec.malloc(3 * MiB)
    rec.malloc(1000)
    rec.start_recording()
    snapshot = rec.snapshot(tmp_path)
    result = replay_snapshot(snapshot, verify=True, torch_version=VERSION)
    assert result.events == 0
    assert result.segment_events_recorded == 0
    assert result.final_state_matches is True
    assert sorted(s["total_size"] for s in result.final_segments) == [2 * MiB, 20 * MiB]
    assert result.final_reserved_bytes == 22 * MiB
    assert "trace is empty: only the final state was read" in result.warnings


def test_recorded_setting_is_read_from_the_snapshot(tmp_path):
    """The recorded settings, including options only the PYTORCH_CUDA_ALLOC_CONF string names."""
    # max_non_split_rounding_mb exists from PR #136174 (≈2.6) on.
    rec = Recording("max_split_size_mb:25,max_non_split_rounding_mb:40", version="2.9")
    rec.malloc(30 * MiB)
    result = verify(rec.snapshot(tmp_path), version="2.9")
    assert result.alloc_conf == str(rec.config)
    assert "max_non_split_rounding_mb:40" in result.alloc_conf


def test_a_divergence_is_located_with_context(tmp_path):
    """A recorded decision the simulator does not make is reported with the events around it."""
    rec = Recording()
    rec.malloc(3 * MiB)
    rec.malloc(30 * MiB)
    events = list(rec.events)
    # Pretend the recording's second cudaMalloc was 2 MiB larger than the rules give.
    k = [i for i, e in enumerate(events) if e.action == "segment_alloc"][1]
    events[k] = TraceEvent(action="segment_alloc", address=events[k].address, size=32 * MiB)
    path = tmp_path / "diverging.pickle"
    write_snapshot(path, rec.allocator.snapshot(), {0: events}, rec.settings())
    result = replay_snapshot(load_snapshot(path), verify=True, torch_version=VERSION)
    d = result.first_divergence
    assert (d.segment_event_index, d.trace_event_index) == (1, k)
    assert d.expected == ("segment_alloc", events[k].address, 32 * MiB)
    assert d.actual == ("segment_alloc", events[k].address, 30 * MiB)
    assert f"> [{k}] segment_alloc" in "\n".join(d.context)
    assert result.segment_events_matched == 1 and result.segment_events_recorded == 2
    assert result.final_state_matches is True


def test_a_final_state_difference_is_described(tmp_path):
    """A final state that the trace does not lead to is reported, segment and block."""
    rec = Recording()
    rec.malloc(3 * MiB)
    segments = rec.allocator.snapshot()
    rec.start_recording()
    rec.malloc(4 * MiB)  # in the trace, but not in the final state written below
    path = tmp_path / "stale.pickle"
    write_snapshot(path, segments, {0: rec.events}, rec.settings())
    result = replay_snapshot(load_snapshot(path), verify=True, torch_version=VERSION)
    assert result.first_divergence is None
    assert result.final_state_matches is False
    assert any(w.startswith("final state differs: segment 0x") for w in result.warnings)


def test_unknown_device_lists_the_devices_present(tmp_path):
    """Asking for a device the snapshot lacks names the ones it has."""
    rec = Recording()
    rec.malloc(3 * MiB)
    snapshot = rec.snapshot(tmp_path)
    with pytest.raises(UnknownDeviceError, match=r"no device 3; it holds device\(s\) 0"):
        replay_snapshot(snapshot, 3, verify=True)


def test_verify_with_a_config_is_refused(tmp_path):
    """verify replays under the recorded setting, so a what-if setting is a usage error."""
    rec = Recording()
    rec.malloc(3 * MiB)
    snapshot = rec.snapshot(tmp_path)
    with pytest.raises(ValueError, match="config must be None"):
        replay_snapshot(snapshot, verify=True, config=AllocatorConfig())


def _private_pool_trace() -> list[TraceEvent]:
    base = 0x7F00_0000_0000
    return [
        TraceEvent("alloc", base, 4_000),
        TraceEvent("alloc", base + 2**30, 3 * 2**20, tags=(("pool_id", "1,0"),)),
        TraceEvent("free_requested", base, 4_000),
        TraceEvent("free_completed", base, 4_000),
    ]


def test_private_pool_entries_are_left_out_of_a_snapshot_read_from_data():
    """An entry with a private pool_id is dropped from the replay of a snapshot the reader built
    (whose noted keys include "trace:pool_id"); a file without that key keeps every entry."""
    from oomkit.core.snapshot import Snapshot, snapshot_from_data, snapshot_to_data

    events = _private_pool_trace()
    data = snapshot_to_data([], {0: [ev for ev in events if not ev.tags]})
    private = dict(data["device_traces"][0][0], pool_id=(1, 0), addr=0x7F00_0000_0000 + 2**30)
    data["device_traces"][0].insert(1, private)
    read = snapshot_from_data(data)
    assert "trace:pool_id" in read.keys_seen
    result = replay_snapshot(read, 0, config=AllocatorConfig())
    assert result.events == 3
    assert any("1 trace event(s) of them were left out" in w for w in result.warnings)
    plain = snapshot_from_data(snapshot_to_data([], {0: [ev for ev in events if not ev.tags]}))
    assert "trace:pool_id" not in plain.keys_seen and plain.keys_seen
    result = replay_snapshot(plain, 0, config=AllocatorConfig())
    assert result.events == 3 and not any("left out" in w for w in result.warnings)
    # Built directly (no keys noted): the tagged entry is found by reading the events.
    built = Snapshot(segments=(), device_traces={0: tuple(events)})
    result = replay_snapshot(built, 0, config=AllocatorConfig())
    assert result.events == 3
    assert any("1 trace event(s) of them were left out" in w for w in result.warnings)

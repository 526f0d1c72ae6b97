"""Tests for oomkit.plan.tuning: the PYTORCH_CUDA_ALLOC_CONF sweep and its ranking."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from oomkit.core.allocator import AllocatorConfig, CachingAllocator
from oomkit.core.replay import replay_snapshot
from oomkit.core.trace import TraceEvent
from oomkit.errors import AllocatorUsageError, ConfigError, TraceFormatError
from oomkit.plan import (
    DEFAULT_GRID,
    FLAG_REASONS,
    NOT_RECOMMENDED_FLAGS,
    TuningCandidate,
    tune,
)

MiB = 2**20


def _alloc(ident: int, size: int) -> TraceEvent:
    return TraceEvent("alloc", ident, size)


def _free(ident: int, size: int) -> list[TraceEvent]:
    return [TraceEvent("free_requested", ident, size), TraceEvent("free_completed", ident, size)]


# 30 MiB is freed, then 40 MiB is asked for. Classic segments cannot grow, so the default caches
# the 30 MiB segment and makes a new 40 MiB one (70 MiB); an expandable segment maps 2 pages of
# 20 MiB for the 30 MiB and serves the 40 MiB from the same 40 MiB (§8.3).
FRAGMENTING = [_alloc(1, 30 * MiB), *_free(1, 30 * MiB), _alloc(2, 40 * MiB)]

# 100 MiB is freed, 50 MiB splits its cached block, then 100 MiB no longer fits (200 MiB by
# default). max_split_size_mb:64 keeps the 100 MiB block whole (§6 rule 1), so the second 100 MiB
# reuses it: 100 + 50 = 150 MiB.
SPLITTING = [_alloc(1, 100 * MiB), *_free(1, 100 * MiB), _alloc(2, 50 * MiB), _alloc(3, 100 * MiB)]


def _row(c: TuningCandidate) -> tuple:
    return (
        c.alloc_conf,
        c.peak_reserved_bytes,
        c.peak_allocated_bytes,
        c.device_allocs,
        c.device_frees,
        c.alloc_retries,
        c.ooms,
        c.flags,
    )


def test_expandable_segments_wins_a_fragmenting_trace():
    """expandable_segments saves exactly 30 MiB over the default; roundup:2 costs 10 MiB more."""
    result = tune(
        FRAGMENTING,
        candidates=[
            "expandable_segments:True",
            "max_split_size_mb:64",
            "roundup_power2_divisions:2",
        ],
    )
    assert [_row(c) for c in result.candidates] == [
        ("expandable_segments:True", 40 * MiB, 40 * MiB, 1, 0, 0, False, ()),
        ("", 70 * MiB, 40 * MiB, 2, 0, 0, False, ()),
        ("max_split_size_mb:64", 70 * MiB, 40 * MiB, 2, 0, 0, False, ()),
        # 30 MiB -> 32 MiB, 40 MiB -> 48 MiB with 2 divisions (§2.1).
        ("roundup_power2_divisions:2", 80 * MiB, 48 * MiB, 2, 0, 0, False, ()),
    ]
    assert result.baseline.alloc_conf == ""
    assert result.baseline.peak_reserved_bytes == 70 * MiB
    assert result.best is not None and result.best.alloc_conf == "expandable_segments:True"
    assert result.saving_bytes == 30 * MiB
    assert not result.default_is_best
    assert result.capacity_bytes == 80 * 2**30
    assert result.warnings == ()


def test_default_grid_recommends_expandable_and_flags_bad_settings():
    """On the default grid the best is expandable_segments:True; flagged settings are never best."""
    result = tune(FRAGMENTING)
    assert len(result.candidates) == len(DEFAULT_GRID) == 24
    assert result.best is not None and result.best.alloc_conf == "expandable_segments:True"
    assert result.saving_bytes == 30 * MiB
    by_conf = {c.alloc_conf: c for c in result.candidates}
    combo = by_conf["expandable_segments:True,max_split_size_mb:128"]
    assert combo.flags == ("max-split-with-expandable",)
    assert not combo.recommendable
    assert by_conf["garbage_collection_threshold:0.8"].flags == ("gc-without-fraction",)
    assert by_conf["garbage_collection_threshold:0.8,per_process_memory_fraction:0.99"].flags == ()
    # Ties keep the grid order, so the default ranks first among the 70 MiB settings.
    peaks = [c.peak_reserved_bytes for c in result.candidates]
    assert peaks == sorted(peaks)
    assert [c.alloc_conf for c in result.candidates[:7]] == [
        "expandable_segments:True",
        "expandable_segments:True,roundup_power2_divisions:4",
        "expandable_segments:True,roundup_power2_divisions:8",
        "expandable_segments:True,roundup_power2_divisions:16",
        "expandable_segments:True,max_split_size_mb:128",
        "expandable_segments:True,max_split_size_mb:512",
        "",
    ]
    assert result.candidates[-1].alloc_conf == "roundup_power2_divisions:2"


def test_default_grid_never_recommends_max_split_with_expandable():
    """No grid entry that combines the two is recommendable, whatever the numbers."""
    combos = [t for t in DEFAULT_GRID if "max_split_size_mb" in t and "expandable_segments" in t]
    assert combos
    assert "max-split-with-expandable" in NOT_RECOMMENDED_FLAGS
    assert set(FLAG_REASONS) >= NOT_RECOMMENDED_FLAGS


def test_max_split_size_wins_when_a_large_block_gets_split():
    """max_split_size_mb:64 keeps the 100 MiB block whole: 150 MiB vs 160 (expandable) vs 200."""
    result = tune(
        SPLITTING,
        candidates=["expandable_segments:True", "max_split_size_mb:64", "max_split_size_mb:128"],
    )
    assert [_row(c) for c in result.candidates] == [
        ("max_split_size_mb:64", 150 * MiB, 150 * MiB, 2, 0, 0, False, ()),
        # 100 MiB maps 5 pages; the 50 MiB free tail plus 3 more pages serve the second 100 MiB.
        ("expandable_segments:True", 160 * MiB, 150 * MiB, 2, 0, 0, False, ()),
        ("", 200 * MiB, 150 * MiB, 2, 0, 0, False, ()),
        # 100 MiB < 128 MiB is not oversize, so it splits as under the default.
        ("max_split_size_mb:128", 200 * MiB, 150 * MiB, 2, 0, 0, False, ()),
    ]
    assert result.best.alloc_conf == "max_split_size_mb:64"
    assert result.saving_bytes == 50 * MiB


def test_default_is_already_best_and_warns_when_nothing_differs():
    """A 1000-byte request reserves one 2 MiB segment under every setting."""
    events = [_alloc(1, 1000), *_free(1, 1000)]
    result = tune(events, candidates=["expandable_segments:True", "max_split_size_mb:64"])
    assert result.default_is_best
    assert result.best is result.baseline
    assert result.saving_bytes == 0
    assert [c.peak_reserved_bytes for c in result.candidates] == [2 * MiB] * 3
    assert len(result.warnings) == 1
    assert result.warnings[0].startswith("every setting gives the same result")


def test_candidates_that_run_out_of_memory_rank_last():
    """At 64 MiB, 30 + 33 MiB live fit only with plain 2 MiB segment rounding."""
    events = [_alloc(1, 30 * MiB), _alloc(2, 33 * MiB)]
    result = tune(
        events,
        64 * MiB,
        candidates=[
            "expandable_segments:True",
            "roundup_power2_divisions:2",
            "max_split_size_mb:32",
            "garbage_collection_threshold:0.8,per_process_memory_fraction:0.99",
        ],
    )
    assert [_row(c) for c in result.candidates] == [
        ("", 64 * MiB, 64 * MiB, 2, 0, 0, False, ()),
        ("max_split_size_mb:32", 64 * MiB, 64 * MiB, 2, 0, 0, False, ()),
        # The fraction allows 0.99 * 64 MiB < 64 MiB, so the 34 MiB segment is refused.
        (
            "garbage_collection_threshold:0.8,per_process_memory_fraction:0.99",
            30 * MiB,
            30 * MiB,
            1,
            0,
            1,
            True,
            (),
        ),
        # 33 MiB -> 48 MiB with 2 divisions: 32 + 48 > 64.
        ("roundup_power2_divisions:2", 32 * MiB, 32 * MiB, 1, 0, 1, True, ()),
        # Two 20 MiB pages for 30 MiB, two more for the rest of 33 MiB: 80 > 64.
        ("expandable_segments:True", 40 * MiB, 30 * MiB, 1, 0, 1, True, ()),
    ]
    assert result.default_is_best


def test_every_candidate_out_of_memory_gives_no_best():
    """When nothing fits there is no recommendation and a warning says so."""
    result = tune([_alloc(1, 30 * MiB)], 16 * MiB, candidates=["expandable_segments:True"])
    assert all(c.ooms for c in result.candidates)
    assert result.best is None
    assert result.saving_bytes == 0
    assert any(w.startswith("every setting runs out of memory") for w in result.warnings)


def test_more_retries_is_flagged_and_not_recommended():
    """roundup:2 fits 72 MiB only by flushing the cache; its lower peak is not a recommendation."""
    result = tune(
        FRAGMENTING,
        72 * MiB,
        candidates=[
            "roundup_power2_divisions:2",
            "expandable_segments:True,garbage_collection_threshold:0.8,per_process_memory_fraction:0.99",
        ],
    )
    assert [_row(c) for c in result.candidates] == [
        (
            "expandable_segments:True,garbage_collection_threshold:0.8,per_process_memory_fraction:0.99",
            40 * MiB,
            40 * MiB,
            1,
            0,
            0,
            False,
            ("gc-with-expandable",),
        ),
        # 32 MiB, then 48 MiB does not fit beside it: release the cache, retry (§4 step 9).
        ("roundup_power2_divisions:2", 48 * MiB, 48 * MiB, 2, 1, 1, False, ("more-retries",)),
        ("", 70 * MiB, 40 * MiB, 2, 0, 0, False, ()),
    ]
    assert result.default_is_best
    assert result.saving_bytes == 0


def test_progress_is_called_with_done_and_total():
    """progress(0, n) before the first replay, then progress(i, n) after each of the n."""
    calls = []
    tune(
        FRAGMENTING,
        candidates=["expandable_segments:True", "max_split_size_mb:64"],
        progress=lambda done, total: calls.append((done, total)),
    )
    assert calls == [(0, 3), (1, 3), (2, 3), (3, 3)]


def test_invalid_and_duplicate_candidates_are_skipped():
    """A setting PyTorch rejects is skipped with a warning; an equivalent setting is replayed once."""
    result = tune(
        FRAGMENTING,
        candidates=["max_split_size_mb:2", "expandable_segments:True", "expandable_segments:True"],
    )
    assert [c.alloc_conf for c in result.candidates] == ["expandable_segments:True", ""]
    assert len(result.warnings) == 1
    assert result.warnings[0].startswith(
        "skipped 1 setting(s) that the newest torch rejects: 'max_split_size_mb:2'"
    )


def test_only_invalid_candidates_is_a_config_error():
    """With nothing valid to compare, tune() says so instead of returning the default alone."""
    with pytest.raises(ConfigError, match="no candidate setting is valid"):
        tune(FRAGMENTING, candidates=["max_split_size_mb:2"])


@pytest.mark.parametrize("capacity", [0, -1, 1.5, True])
def test_bad_capacity_is_rejected(capacity):
    """The capacity must be a positive int of bytes."""
    with pytest.raises(AllocatorUsageError, match="positive number of bytes"):
        tune(FRAGMENTING, capacity)


def test_factory_is_called_once_per_candidate_and_closed():
    """A factory source gives fresh events for each replay, and each iterator is closed."""
    opened = []
    closed = []

    def factory():
        def events():
            try:
                yield from FRAGMENTING
            finally:
                closed.append(True)

        gen = events()
        opened.append(gen)
        return gen

    result = tune(factory, candidates=["expandable_segments:True"])
    assert len(opened) == 2
    assert len(closed) == 2
    assert result.best.alloc_conf == "expandable_segments:True"


def test_one_shot_iterator_is_read_once():
    """A plain iterator of events is kept, so every candidate sees all of it."""
    result = tune(iter(FRAGMENTING), candidates=["expandable_segments:True"])
    assert [c.peak_reserved_bytes for c in result.candidates] == [40 * MiB, 70 * MiB]


def test_bad_trace_raises_trace_format_error():
    """A free of an id that was never allocated is the trace's error, not a ranking."""
    with pytest.raises(TraceFormatError, match="not live"):
        tune(_free(7, MiB), candidates=["expandable_segments:True"])


def test_unknown_source_type_is_a_type_error():
    """tune() names what it accepts."""
    with pytest.raises(TypeError, match="Snapshot, a sequence of TraceEvent or a factory"):
        tune(42)  # type: ignore[arg-type]


# ------------------------------------------------------------------ PyTorch issue #123548
#
# pytorch/pytorch#123548 (reproducer in PR #193400): with max_split_size_mb:128 and
# expandable_segments:True, each cycle allocates A = 91 MiB and B = 45.5 MiB, then a 2 MiB block
# that stays alive, then frees A and B. The merged 136.5 MiB free block is >= max_split_size, so
# get_free_block refuses it to the next (smaller) A and B (§6 rule 1 applies to expandable blocks
# too), and find_expandable_block cannot grow it either: the live 2 MiB block fences it off from
# the unmapped tail. So every cycle maps fresh pages. The PR's table (16 GiB card):
#   cycle     0     20     40     60     80    100
#   allocated 66   106    146    186    226    266  MiB
#   reserved  220  2,980  5,760  8,520  11,300 14,060 MiB

_A = 91 * MiB
_B = 91 * MiB // 2  # 45.5 MiB
_FENCE = 2 * MiB


def _cycles(conf: str, cycles: int, *, live_bytes: int = 0, keep_fences: bool = True):
    """Reserved and allocated bytes after each #123548 cycle under ``conf``."""
    allocator = CachingAllocator(AllocatorConfig.parse(conf), 16 * 2**30)
    if live_bytes:
        allocator.malloc(live_bytes)
    fence = None
    out = []
    for _ in range(cycles):
        a = allocator.malloc(_A)
        b = allocator.malloc(_B)
        new_fence = allocator.malloc(_FENCE)
        allocator.free(a)
        allocator.free(b)
        if not keep_fences and fence is not None:
            allocator.free(fence)
        fence = new_fence
        out.append((allocator.memory_reserved(), allocator.memory_allocated()))
    return out


def test_issue_123548_reproduces_the_reported_table_exactly():
    """With 64 MiB live beforehand, the simulator gives the PR #193400 table to the MiB."""
    both = _cycles("max_split_size_mb:128,expandable_segments:True", 101, live_bytes=64 * MiB)
    at = [both[i] for i in range(0, 101, 20)]
    assert [r // MiB for r, _ in at] == [220, 2980, 5760, 8520, 11300, 14060]
    assert [a // MiB for _, a in at] == [66, 106, 146, 186, 226, 266]


@pytest.mark.parametrize(
    ("conf", "reserved_mib"),
    [
        ("max_split_size_mb:128", [222, 262, 302, 342, 382, 422]),
        ("expandable_segments:True", [220, 260, 300, 340, 380, 420]),
        ("", [222, 262, 302, 342, 382, 422]),
    ],
)
def test_issue_123548_each_setting_alone_grows_only_with_the_live_fences(conf, reserved_mib):
    """Alone, every 20 cycles add exactly the 40 MiB of fences kept alive, and stay < 500 MiB."""
    alone = _cycles(conf, 101, live_bytes=64 * MiB)
    at = [alone[i] for i in range(0, 101, 20)]
    assert [r // MiB for r, _ in at] == reserved_mib
    assert [a // MiB for _, a in at] == [66, 106, 146, 186, 226, 266]
    assert max(r for r, _ in alone) < 500 * MiB  # PR #193400: "under 500 MiB reserved"


def test_issue_123548_grows_without_bound_with_a_bounded_live_set():
    """Freeing the previous fence keeps 2 MiB live, yet both together grow 140 MiB per cycle."""
    both = _cycles("max_split_size_mb:128,expandable_segments:True", 6, keep_fences=False)
    assert both == [(k * 140 * MiB, 2 * MiB) for k in range(1, 7)]
    assert _cycles("max_split_size_mb:128", 6, keep_fences=False) == [(158 * MiB, 2 * MiB)] * 6
    assert _cycles("expandable_segments:True", 6, keep_fences=False) == (
        [(140 * MiB, 2 * MiB)] + [(160 * MiB, 2 * MiB)] * 5
    )
    assert _cycles("", 6, keep_fences=False) == [(158 * MiB, 2 * MiB)] * 6


def test_tune_flags_and_skips_the_issue_123548_setting():
    """tune() on the #123548 workload ranks the combination last and never recommends it."""
    events: list[TraceEvent] = []
    for cycle in range(10):
        a, b, fence = 3 * cycle + 1, 3 * cycle + 2, 3 * cycle + 3
        events += [_alloc(a, _A), _alloc(b, _B), _alloc(fence, _FENCE)]
        events += _free(a, _A) + _free(b, _B)
    conf = "expandable_segments:True,max_split_size_mb:128"
    result = tune(events, candidates=["max_split_size_mb:128", "expandable_segments:True", conf])
    last = result.candidates[-1]
    assert last.alloc_conf == conf
    assert last.flags == ("max-split-with-expandable",)
    # 140 MiB per cycle (7 pages of 20 MiB) for these first 10 cycles.
    assert last.peak_reserved_bytes == 1400 * MiB
    # Default and max_split alone: 92 + 46 MiB segments and one 20 MiB segment for the fences.
    assert [(c.alloc_conf, c.peak_reserved_bytes) for c in result.candidates[:3]] == [
        ("", 158 * MiB),
        ("max_split_size_mb:128", 158 * MiB),
        ("expandable_segments:True", 160 * MiB),
    ]
    assert result.default_is_best


# ------------------------------------------------------------------ snapshots


def _shared_snapshots() -> Path | None:
    env = os.environ.get("OOMKIT_SHARED_SNAPSHOTS")
    if env:
        return Path(env)
    here = Path(__file__).resolve()
    for parent in here.parents:
        candidate = parent.parent / "shared" / "snapshots"
        if candidate.is_dir():
            return candidate
    return None


def test_snapshot_source_replays_each_candidate_as_a_what_if():
    """A snapshot's baseline is the what-if replay under the default setting."""
    from oomkit.core.snapshot import load_snapshot

    root = _shared_snapshots()
    name = "HugePandaCoder__octree-nca-groupeq/d47727a245__my_snapshot.pickle"
    if root is None or not (root / name).is_file():
        pytest.skip("the shared snapshots are not available (set OOMKIT_SHARED_SNAPSHOTS)")
    snapshot = load_snapshot(root / name)
    device = snapshot.devices()[0]
    calls = []
    result = tune(
        snapshot,
        device=device,
        candidates=["expandable_segments:True", "max_split_size_mb:128"],
        progress=lambda d, t: calls.append((d, t)),
    )
    default = replay_snapshot(snapshot, device, config=AllocatorConfig(), capacity_bytes=80 * 2**30)
    assert result.baseline.peak_reserved_bytes == default.peak_reserved_bytes
    assert result.baseline.device_allocs == default.num_device_alloc
    assert calls[-1] == (3, 3)
    keys = [(c.ooms, c.peak_reserved_bytes, c.device_calls) for c in result.candidates]
    assert keys == sorted(keys)


def test_settings_an_older_torch_rejects_are_skipped():
    """torch 2.3 has no per_process_memory_fraction key: the 3 GC-with-fraction settings go."""
    result = tune(FRAGMENTING, torch_version="2.3")
    assert len(result.candidates) == len(DEFAULT_GRID) - 3
    assert not any("per_process_memory_fraction" in c.alloc_conf for c in result.candidates)
    # A fact about the default sweep, not a setting the user gave wrongly: one short note.
    assert result.warnings == (
        "not swept: 3 of the default settings, which torch 2.3 does not take "
        "(per_process_memory_fraction needs torch >= 2.9)",
    )
    assert result.best.alloc_conf == "expandable_segments:True"
    # Given by the caller, the same setting is a warning with PyTorch's whole reason.
    given = tune(
        FRAGMENTING, torch_version="2.3",
        candidates=["garbage_collection_threshold:0.6,per_process_memory_fraction:0.99",
                    "expandable_segments:True"],
    )
    assert given.warnings[0].startswith(
        "skipped 1 setting(s) that torch 2.3 rejects: "
        "'garbage_collection_threshold:0.6,per_process_memory_fraction:0.99'. First reason:"
    )


# ------------------------------------------------------------------ parallel sweeps


def test_parallel_sweep_of_a_snapshot_equals_the_serial_one():
    """jobs=2 replays the settings in two processes and gives the serial result, field for field."""
    from oomkit.core.snapshot import load_snapshot

    root = _shared_snapshots()
    name = "HugePandaCoder__octree-nca-groupeq/d47727a245__my_snapshot.pickle"
    if root is None or not (root / name).is_file():
        pytest.skip("the shared snapshots are not available (set OOMKIT_SHARED_SNAPSHOTS)")
    snapshot = load_snapshot(root / name)
    grid = ["", "expandable_segments:True", "max_split_size_mb:64", "roundup_power2_divisions:4"]
    serial = tune(snapshot, 8 * 2**30, device=snapshot.devices()[0], candidates=grid, jobs=1)
    seen = []
    parallel = tune(
        snapshot,
        8 * 2**30,
        device=snapshot.devices()[0],
        candidates=grid,
        jobs=2,
        progress=lambda done, total: seen.append((done, total)),
    )
    assert parallel == serial
    assert [c.alloc_conf for c in parallel.candidates] == [c.alloc_conf for c in serial.candidates]
    assert seen == [(0, 4), (1, 4), (2, 4), (3, 4), (4, 4)]


def test_parallel_sweep_of_a_trace_factory_equals_the_serial_one():
    """A lambda factory (not picklable) works in the pool: workers inherit it by fork."""
    events = FRAGMENTING + SPLITTING[:0]
    serial = tune(lambda: iter(events), 2**30, candidates=list(DEFAULT_GRID[:6]), jobs=1)
    parallel = tune(lambda: iter(events), 2**30, candidates=list(DEFAULT_GRID[:6]), jobs=3)
    assert parallel == serial


def test_parallel_sweep_raises_the_first_failing_settings_error():
    """A bad trace fails the same way in the pool as one at a time."""
    bad = [TraceEvent("free_completed", 7, 0)]
    with pytest.raises(TraceFormatError, match="not live"):
        tune(bad, 2**30, candidates=["", "expandable_segments:True"], jobs=2)


@pytest.mark.parametrize("jobs", [0, -1, 1.5, True])
def test_bad_jobs_is_rejected(jobs):
    """jobs must be a positive int (or None for one per core)."""
    with pytest.raises(AllocatorUsageError, match="jobs"):
        tune([TraceEvent("alloc", 1, 512)], 2**30, jobs=jobs)


def test_no_segment_decision_means_settings_cannot_be_compared():
    """No events: no setting makes a segment decision, so none is ranked best (issue 35)."""
    result = tune([], candidates=["expandable_segments:True", "max_split_size_mb:64"])
    assert not result.comparable
    assert result.best is None and not result.default_is_best
    assert result.saving_bytes == 0
    assert [c.device_calls for c in result.candidates] == [0, 0, 0]
    assert result.warnings[-1].startswith(
        "settings cannot be compared on this workload: no setting made a segment decision"
    )


def test_one_segment_decision_each_is_still_comparable():
    """A 1000-byte request makes one cudaMalloc under every setting: a real (tied) comparison."""
    events = [_alloc(1, 1000), *_free(1, 1000)]
    assert tune(events, candidates=["expandable_segments:True"]).comparable

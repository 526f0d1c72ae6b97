"""diagnose_snapshot: the labelled OOM cases, leak and spike detection, remedies, real snapshots."""

from __future__ import annotations

from pathlib import Path

import pytest
from cases.oom_cases import CASES, CONTEXT, GPU_8G, GiB, MiB, Recorder

from oomkit.core.snapshot import load_snapshot, write_snapshot
from oomkit.core.trace import Frame, TraceEvent
from oomkit.diagnose.snapshot_diagnosis import diagnose_snapshot
from oomkit.errors import UnknownDeviceError

SHARED = Path("/work/shared/snapshots")
REAL = sorted(SHARED.glob("*/*.p*")) if SHARED.is_dir() else []

# The exact evidence of each labelled case's main finding (see cases/oom_cases.py for the story).
EXPECTED_EVIDENCE = {
    "shortage": {
        "allocated_bytes": 7 * GiB,
        "requested_bytes": GiB,
        "available_bytes": 8 * GiB - CONTEXT,
        "shortfall_bytes": CONTEXT,
    },
    "fragmentation": {
        "reserved_unallocated_bytes": 7 * 424 * MiB,
        "requested_bytes": 2 * GiB,
        "free_bytes": 624 * MiB,
        "largest_free_block_bytes": 424 * MiB,
    },
    "outside_pytorch": {
        "outside_allocator_bytes": 8 * GiB - 624 * MiB - 4 * GiB,
        "expected_context_bytes": CONTEXT,
        "context_high_bytes": CONTEXT + 800 * MiB,
        "other_processes_bytes": 0,
    },
    "fraction_limit": {
        "allowed_bytes": 4 * GiB,
        "reserved_bytes": 3 * GiB,
        "requested_bytes": 2 * GiB,
        "free_bytes": 8 * GiB - CONTEXT - 3 * GiB,
    },
    "request_exceeds_device": {"requested_bytes": 16 * GiB, "total_bytes": 8 * GiB},
    "leak": {
        "leaked_bytes": 19 * 256 * MiB,
        "growth_per_iteration_bytes": 256 * MiB,
        "first_minimum_bytes": GiB + 256 * MiB,
        "last_minimum_bytes": 6 * GiB,
        "iterations": 20,
        "allocations_per_iteration": 3,
        "leak_site_bytes": 20 * 256 * MiB,
    },
    "transient_spike": {
        "spike_bytes": 6 * GiB,
        "steady_bytes": 2 * GiB,
        "peak_bytes": 8 * GiB,
        "transient_bytes": 3 * GiB,
        "requested_bytes": 3 * GiB,
    },
}


@pytest.fixture(scope="module")
def diagnoses(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cases")
    out = {}
    for case in CASES:
        snapshot = load_snapshot(case.build(folder / f"{case.name}.pickle"))
        out[case.name] = diagnose_snapshot(
            snapshot, gpu=GPU_8G, memory_fraction=case.memory_fraction
        )
    return out


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_labelled_case_is_classified(diagnoses, case):
    """Every labelled snapshot gets its cause first, with the exact evidence bytes."""
    diagnosis = diagnoses[case.name]
    assert diagnosis.cause == case.expected
    assert diagnosis.causes[0].cause == case.expected
    assert dict(diagnosis.causes[0].evidence_bytes) == EXPECTED_EVIDENCE[case.name]
    assert diagnosis.source == "snapshot"
    assert diagnosis.attribution is not None and diagnosis.attribution.moment == "oom"


def test_shortage_explains_the_shortfall(diagnoses):
    """Shortage: 7 GiB + 1 GiB against 7.6 GiB usable is 400 MiB over; no trace-only cause."""
    d = diagnoses["shortage"]
    assert d.causes[0].explained_bytes == 400 * MiB
    assert [f.cause for f in d.causes] == ["shortage"]
    assert d.figures_bytes["allocated_bytes"] == 7 * GiB
    assert d.figures_bytes["free_bytes"] == 624 * MiB


def test_fragmentation_top_remedy_is_priced_by_replay(diagnoses):
    """The fragmented case's top remedy is expandable segments, priced by replay, both ways set."""
    top = diagnoses["fragmentation"].remedies[0]
    assert top.title == "expandable segments"
    assert top.estimate is False and top.confidence == "high"
    assert top.saving_bytes == 2134900736
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python" in top.code
    assert 'torch.cuda.memory._set_allocator_settings("expandable_segments:True")' in top.code


def test_no_remedy_combines_max_split_with_expandable(diagnoses):
    """No offered setting pairs max_split_size_mb with expandable_segments; each saves > 0."""
    for diagnosis in diagnoses.values():
        for remedy in diagnosis.remedies:
            if "PYTORCH_CUDA_ALLOC_CONF=" in remedy.code:
                setting = remedy.code.split("PYTORCH_CUDA_ALLOC_CONF=")[1].split()[0]
                assert not ("max_split_size_mb" in setting and "expandable" in setting)
                assert remedy.saving_bytes and remedy.saving_bytes > 0


def test_fraction_limit_remedy_raises_the_fraction(diagnoses):
    """The fraction case's top remedy raises the fraction: the allocator may then use the 8 GiB
    less the CUDA context (400 MiB), 4 GiB less 400 MiB more than the 4 GiB allowed."""
    top = diagnoses["fraction_limit"].remedies[0]
    assert top.title == "raise the per-process memory fraction"
    assert top.saving_bytes == 4 * GiB - 400 * MiB


def test_leak_names_the_site_and_remedy(diagnoses):
    """The leak's top remedy stops it at train.py:12, saving the 4.75 GiB it grew."""
    d = diagnoses["leak"]
    top = d.remedies[0]
    assert top.title == "stop the leak at /home/user/train.py:12 in step"
    assert top.saving_bytes == 19 * 256 * MiB
    assert "loss.item()" in top.code
    assert "shortage" in [f.cause for f in d.causes]


def test_spike_remedy_and_attribution(diagnoses):
    """The spike: chunking saves 3/4 of 6 GiB; the largest live tensor is a 1.5 GiB temporary."""
    d = diagnoses["transient_spike"]
    assert d.remedies[0].title.startswith("compute the short-lived temporary in chunks")
    assert d.remedies[0].saving_bytes == 6 * GiB - 6 * GiB // 4
    assert d.attribution.largest_tensors[0].size_bytes == 2 * GiB
    assert [t.size_bytes for t in d.attribution.largest_tensors] == [
        2 * GiB,
        1536 * MiB,
        1536 * MiB,
    ]
    assert d.attribution.allocated_bytes == 5 * GiB


def test_no_batch_remedy_when_the_trace_cannot_tell_state_from_activations(diagnoses):
    """A trace that starts empty with no repeated iteration gets no batch-size estimate."""
    titles = [r.title for r in diagnoses["shortage"].remedies]
    assert not any("gradient-accumulation" in t for t in titles)


def test_batch_remedy_from_iterations(diagnoses):
    """The leak loop's troughs give the steady level: a 2x smaller batch saves half the rest."""
    d = diagnoses["leak"]
    batch = next(r for r in d.remedies if "gradient-accumulation" in r.title)
    need = d.figures_bytes["allocated_bytes"] + d.figures_bytes["requested_bytes"]
    activation = need - 6 * GiB
    assert batch.title == "a 2x smaller batch with 2 gradient-accumulation steps"
    assert batch.saving_bytes == activation - (activation + 1) // 2
    assert batch.estimate is True


def _loop(path: Path, *, warmup_bytes: int, leak_bytes: int, iterations: int) -> Path:
    rec = Recorder(capacity_bytes=64 * GiB)
    rec.alloc(GiB, line=3)
    for i in range(iterations):
        act = rec.alloc(512 * MiB, line=10)
        tmp = rec.alloc(128 * MiB, line=11)
        rec.free(tmp)
        if i == 0 and warmup_bytes:
            rec.alloc(warmup_bytes, line=30)  # optimizer state, made at the first step
        if leak_bytes:
            rec.alloc(leak_bytes, line=12)
        rec.free(act)
    return rec.write(path)


def test_warm_up_is_not_a_leak(tmp_path):
    """Optimizer state created in the first iteration only: no leak, and no OOM recorded."""
    snap = load_snapshot(
        _loop(tmp_path / "s.pickle", warmup_bytes=2 * GiB, leak_bytes=0, iterations=8)
    )
    d = diagnose_snapshot(snap)
    assert "leak" not in [f.cause for f in d.causes]
    assert d.attribution.moment == "peak"
    assert any("records no OOM" in w for w in d.warnings)


def test_leak_after_warm_up(tmp_path):
    """A 64 MiB leak per iteration after a 2 GiB warm-up: growth counted without the warm-up."""
    snap = load_snapshot(
        _loop(tmp_path / "s.pickle", warmup_bytes=2 * GiB, leak_bytes=64 * MiB, iterations=8)
    )
    leak = next(f for f in diagnose_snapshot(snap).causes if f.cause == "leak")
    assert leak.evidence_bytes["growth_per_iteration_bytes"] == 64 * MiB
    # 8 iterations: 7 complete windows between troughs, the first (warm-up) left out.
    assert leak.evidence_bytes["iterations"] == 6
    assert leak.evidence_bytes["leaked_bytes"] == 5 * 64 * MiB
    assert leak.evidence_bytes["first_minimum_bytes"] == GiB + 2 * GiB + 64 * MiB


def test_peak_spike_without_oom(tmp_path):
    """No OOM: a 4 GiB temporary over a 1 GiB steady level is a spike at the peak."""
    rec = Recorder(capacity_bytes=64 * GiB)
    rec.alloc(GiB, line=3)
    for _ in range(3):
        rec.free(rec.alloc(256 * MiB, line=10))
    rec.free(rec.alloc(4 * GiB, line=40))
    for _ in range(3):
        rec.free(rec.alloc(256 * MiB, line=10))
    d = diagnose_snapshot(load_snapshot(rec.write(tmp_path / "s.pickle")))
    assert d.cause == "transient_spike"
    assert d.causes[0].evidence_bytes["spike_bytes"] == 4 * GiB
    assert d.causes[0].evidence_bytes["steady_bytes"] == GiB
    assert d.figures_bytes["allocated_bytes"] == 5 * GiB


def test_empty_cache_only_where_it_returns_memory(tmp_path, diagnoses):
    """Without an OOM, wholly free cached segments are offered to empty_cache; at an OOM never."""
    rec = Recorder(capacity_bytes=64 * GiB)
    keep = rec.alloc(GiB, line=3)
    rec.free(rec.alloc(3 * GiB, line=5))
    assert keep is not None
    d = diagnose_snapshot(load_snapshot(rec.write(tmp_path / "s.pickle")), price_settings=False)
    release = next(r for r in d.remedies if r.title.startswith("release cached memory"))
    assert release.saving_bytes == 3 * GiB
    assert "torch.cuda.empty_cache()" in release.code and "gc.collect()" in release.code
    # Its bytes go to other processes, not to this one's need: it ranks after those that do.
    assert not release.lowers_peak
    assert d.remedies[-1] is release or all(not r.lowers_peak for r in d.remedies)
    for diagnosis in diagnoses.values():
        assert not any(r.title.startswith("release cached memory") for r in diagnosis.remedies)


def _one_allocation_diagnosed(tmp_path, frames):
    """The diagnosis of a snapshot of one 512-byte allocation made at ``frames``."""
    events = [TraceEvent("alloc", 0x1000, 512, frames=frames)]
    segments = [
        {
            "address": 0x1000,
            "total_size": 2 * MiB,
            "blocks": [
                {"address": 0x1000, "size": 512, "state": "active_allocated"},
                {"address": 0x1200, "size": 2 * MiB - 512, "state": "inactive"},
            ],
        }
    ]
    return diagnose_snapshot(
        load_snapshot(write_snapshot(tmp_path / "s.pickle", segments, {0: events}))
    )


def test_set_max_split_size_call_gets_the_note(tmp_path):
    """A recorded frame calling set_max_split_size gets the note that no such method exists."""
    frames = (Frame("/home/user/train.py", 4, "set_max_split_size"),)
    d = _one_allocation_diagnosed(tmp_path, frames)
    note = next(r for r in d.remedies if "max_split_size_mb through" in r.title)
    assert "no public allocator object with a set_max_split_size method" in note.why
    assert note.saving_bytes is None


@pytest.mark.parametrize(
    ("python_frames", "script"),
    [
        # `python "/home/me/my run/train.py"`: its top level is the outermost Python frame,
        # inside the C++ frames stacks="all" records around it.
        ((("/home/me/my run/train.py", 30, "<module>"),), "/home/me/my run/train.py"),
        # python -m: runpy's frames are outermost; a notebook's kernel; a thread's stack.
        ((("/usr/lib/python3.11/runpy.py", 88, "_run_code"),), None),
        ((("/opt/conda/lib/python3.11/site-packages/ipykernel_launcher.py", 18, "<module>"),),
         None),
        ((("/usr/lib/python3.11/threading.py", 995, "_bootstrap"),), None),
    ],
)
def test_a_setting_s_command_runs_the_script_the_recorded_stacks_show(
    tmp_path, python_frames, script
):
    """The set_max_split_size note's command (an allocator setting's, as the replayed settings'
    are) runs the script whose top level the stacks show, quoted for the shell; else train.py."""
    frames = (
        Frame("??", 0, "c10::cuda::CUDACachingAllocator::malloc"),
        Frame("/home/me/lib/alloc.py", 4, "set_max_split_size"),
        *(Frame(*frame) for frame in python_frames),
        Frame("??", 0, "_start"),
    )
    d = _one_allocation_diagnosed(tmp_path, frames)
    note = next(r for r in d.remedies if "max_split_size_mb through" in r.title)
    command = "'/home/me/my run/train.py'" if script else "train.py"
    assert f"PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:256 python {command}\n" in note.code


@pytest.mark.skipif(not REAL, reason="shared snapshots not available")
def test_the_shared_snapshots_name_their_scripts_where_python_ran_one():
    """Of the real snapshots: the octree study's stacks show its script, and its replayed
    expandable-segments remedy runs it; a notebook's (ipykernel) show none."""
    folder = SHARED / "HugePandaCoder__octree-nca-groupeq"
    d = diagnose_snapshot(load_snapshot(folder / "e67173f362__my_snapshot.pickle"))
    expandable = next(r for r in d.remedies if r.title == "expandable segments")
    assert expandable.code.splitlines()[1] == (
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python "
        "/gris/gris-f/homestud/nlemke/NCA/octree_nca_studies.py"
    )
    notebook = diagnose_snapshot(load_snapshot(folder / "0cc72993c8__my_snapshot.pickle"))
    assert all("python /" not in r.code for r in notebook.remedies)


def test_unknown_device_is_refused(diagnoses, tmp_path):
    """Asking for a device the snapshot does not hold raises UnknownDeviceError naming it."""
    path = CASES[0].build(tmp_path / "s.pickle")
    with pytest.raises(UnknownDeviceError, match="no device 3"):
        diagnose_snapshot(load_snapshot(path), device=3)


def test_without_gpu_outside_memory_is_not_assessed(tmp_path):
    """Without --gpu the outside-PyTorch case cannot be told from a context: it says so."""
    path = next(c for c in CASES if c.name == "outside_pytorch").build(tmp_path / "s.pickle")
    d = diagnose_snapshot(load_snapshot(path))
    assert "outside_pytorch" not in [f.cause for f in d.causes]
    assert any("--gpu" in w for w in d.warnings)
    assert d.figures_bytes["total_bytes"] is None


@pytest.mark.skipif(not REAL, reason="shared snapshots not present")
@pytest.mark.parametrize("path", REAL, ids=[p.name for p in REAL])
def test_real_snapshots_diagnose(path):
    """Every real snapshot (none recorded an OOM) is diagnosed at its peak or final state."""
    snapshot = load_snapshot(path)
    d = diagnose_snapshot(snapshot)
    assert d.attribution is not None and d.attribution.moment in ("peak", "final")
    assert d.causes and d.cause == d.causes[0].cause
    assert all(r.saving_bytes is None or r.saving_bytes >= 0 for r in d.remedies)
    assert [r.rank_key() for r in d.remedies] == sorted(r.rank_key() for r in d.remedies)
    assert d.figures_bytes["allocated_bytes"] == d.attribution.allocated_bytes


def test_real_snapshot_with_priced_expandable_segments():
    """A recorded trace where expandable segments saves 3.88 GiB of peak reserved (by replay)."""
    path = SHARED / "HugePandaCoder__octree-nca-groupeq/e67173f362__my_snapshot.pickle"
    if not path.is_file():
        pytest.skip("shared snapshots not present")
    d = diagnose_snapshot(load_snapshot(path))
    remedy = next(r for r in d.remedies if r.title == "expandable segments")
    assert remedy.saving_bytes == 4167041024
    assert remedy.confidence == "medium"  # no OOM: not checked against a capacity


def test_verdict_says_when_a_snapshot_recorded_no_oom(tmp_path):
    """A snapshot without an OOM is not presented as the cause of one."""
    from oomkit.interfaces.reports.diagnosis import verdict_label

    rec = Recorder(capacity_bytes=64 * GiB)
    rec.alloc(GiB, line=3)
    d = diagnose_snapshot(load_snapshot(rec.write(tmp_path / "s.pickle")), price_settings=False)
    assert d.attribution.moment in ("peak", "final")
    # 1 GiB held on a 64 GiB device, nothing short-lived or fragmented: no risk to name.
    assert verdict_label(d) == "No OOM in this snapshot and no risk found"
    assert d.attribution.moment == "peak"
    assert d.causes[0].summary == (
        "at the peak of allocated memory tensors held 1.00 GiB and PyTorch reserved 1.00 GiB"
    )


def test_fragmentation_is_one_figure_in_diff_and_explain(tmp_path):
    """Peak reserved (54 MiB) comes before peak allocated: explain names each moment, and its
    fragmentation figure (reserved - allocated at peak reserved, 8 MiB) is diff's."""
    from cases.oom_cases import Recorder

    from oomkit.diagnose.run_diff import run_memory_from_snapshot

    rec = Recorder(capacity_bytes=64 * GiB)
    a = rec.alloc(12 * MiB)  # >= 10 MiB: its own 12 MiB segment
    assert a is not None and rec.alloc(12 * MiB) is not None  # a second 12 MiB segment
    rec.free(a)
    assert rec.alloc(4 * MiB) is not None  # splits the free 12 MiB block: 8 MiB stays cached
    assert rec.alloc(30 * MiB) is not None  # a 30 MiB segment: reserved peaks, 46 MiB allocated
    assert rec.alloc(8 * MiB) is not None  # the cached 8 MiB: allocated peaks at 54 MiB
    snapshot = load_snapshot(rec.write(tmp_path / "s.pickle"))
    run = run_memory_from_snapshot(snapshot)
    diagnosis = diagnose_snapshot(snapshot, price_settings=False)
    assert (run.peak_reserved_bytes, run.allocated_at_peak_bytes) == (54 * MiB, 46 * MiB)
    assert run.placement_bytes == 8 * MiB
    assert diagnosis.figures_bytes["fragmentation_at_peak_reserved_bytes"] == 8 * MiB
    text = diagnosis.memory_explained
    assert (
        "Allocated (54.00 MiB, torch.cuda.memory_allocated) is what live tensors used at the "
        "peak of allocated memory"
    ) in text
    assert "the allocated memory plus 0 B cached for reuse" in text, text
    assert (
        "At the peak of reserved memory (54.00 MiB, trace event 8) 46.00 MiB was allocated: "
        "8.00 MiB reserved but unallocated, the fragmentation `oomkit diff` reports."
    ) in text, text

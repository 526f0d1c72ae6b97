"""oomkit doctor's findings: settings that are ignored or do not do what they are set for."""

from __future__ import annotations

from pathlib import Path

import pytest

from oomkit.core.snapshot import load_snapshot, snapshot_from_data
from oomkit.core.snapshot.writer import snapshot_to_data
from oomkit.core.trace import TraceEvent
from oomkit.diagnose.settings_doctor import LiveAllocator, doctor_environment, doctor_snapshot
from oomkit.errors import SnapshotFormatError

MiB = 2**20
SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "snapshots"


def _env(environ, version="2.13", live=None):
    return doctor_environment(environ, version, torch_version_from="test", live=live)


def _severities(report):
    return [(f.severity, f.source) for f in report.findings]


def test_clean_environment_has_no_findings():
    """Nothing set on the newest rules: no findings, defaults in effect."""
    report = _env({})
    assert report.findings == () and report.worst is None
    assert report.config is not None and report.config.expandable_segments is False


def test_issue_183387_expandable_via_unified_name_on_2_9_is_an_error_and_off():
    """2.9 + PYTORCH_ALLOC_CONF=expandable_segments:True: an error, and off in effect."""
    report = _env({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, "2.9.1")
    assert report.worst == "error"
    assert report.findings[0].source.startswith("pytorch/pytorch#183387")
    assert report.config is not None and report.config.expandable_segments is False
    # The same string through the CUDA name is applied (with the deprecation note).
    ok = _env({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, "2.9.1")
    assert ok.worst != "error" and ok.config is not None and ok.config.expandable_segments
    assert any("deprecated" in f.what for f in ok.findings)


def test_unified_name_on_an_old_release_is_never_read():
    """torch 2.4 never reads PYTORCH_ALLOC_CONF: an error naming it."""
    report = _env({"PYTORCH_ALLOC_CONF": "max_split_size_mb:128"}, "2.4")
    assert report.worst == "error"
    assert "PYTORCH_ALLOC_CONF is set but torch 2.4 never reads it" in report.findings[0].what


def test_shadowed_variable_with_other_value_is_a_warning_same_value_info():
    """Two variables set: the unread one is a warning if it differs, info if it is the same."""
    differ = _env({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128", "PYTORCH_ALLOC_CONF": "x:1"})
    assert [f.severity for f in differ.findings] == ["warning"]
    assert "'x:1' is ignored" in differ.findings[0].what
    same = _env({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128", "PYTORCH_ALLOC_CONF": "max_split_size_mb:128"})
    assert [f.severity for f in same.findings] == ["info"]


def test_rejected_string_is_an_error():
    """A string the release rejects is an error finding (PyTorch raises at first use)."""
    report = _env({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:maybe"})
    assert report.worst == "error" and report.config is None


def test_cuda_malloc_async_names_the_ignored_native_options():
    """backend:cudaMallocAsync: the native-only keys it ignores are listed; config unknown."""
    report = _env({"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync,max_split_size_mb:128,expandable_segments:True"})
    (finding,) = report.findings
    assert finding.severity == "warning" and report.backend == "cudaMallocAsync"
    assert "max_split_size_mb, expandable_segments are ignored" in finding.what


def test_gc_threshold_needs_a_fraction_below_one_on_main26():
    """>= 2.12: garbage_collection_threshold without a fraction < 1 does nothing; with 0.9 it works."""
    off = _env({"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6"})
    assert [f.severity for f in off.findings] == ["warning"]
    assert "per-process memory fraction is below 1.0" in off.findings[0].what
    on = _env({"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6,per_process_memory_fraction:0.9"})
    assert on.findings == ()


def test_gc_threshold_on_old_releases_needs_a_fraction_call():
    """<= 2.11: any set_per_process_memory_fraction call enables GC; the finding says so."""
    report = _env({"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6"}, "2.4")
    assert [f.severity for f in report.findings] == ["warning"]
    assert "set_per_process_memory_fraction (any value, 1.0 included)" in report.findings[0].what


def test_non_split_rounding_without_max_split_has_no_effect():
    """max_non_split_rounding_mb alone: a warning citing get_free_block."""
    report = _env({"PYTORCH_CUDA_ALLOC_CONF": "max_non_split_rounding_mb:64"})
    assert _severities(report) == [
        ("warning", "c10/cuda/CUDACachingAllocator.cpp get_free_block (max_non_split_rounding_mb has no effect unless max_split_size_mb is set)")
    ]


def test_expandable_with_max_split_is_flagged_as_an_interaction():
    """expandable_segments + max_split_size_mb: the split-rule interaction, a warning with the
    reason tune gives for never recommending the pair (it had been an info line advising to
    measure the pair, while tune flags it), and the IPC note."""
    from oomkit.plan.tuning import FLAG_REASONS

    report = _env({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:128"})
    assert [f.severity for f in report.findings] == ["warning", "info"]
    first = report.findings[0]
    assert first.source == (
        "c10/cuda/CUDACachingAllocator.cpp get_free_block and shouldSplit (expandable segments)"
    )
    reason = FLAG_REASONS["max-split-with-expandable"].split(": ", 1)[1]
    assert first.what.endswith("still apply: " + reason)
    assert "(PyTorch issue #123548)" in first.what
    assert "it never recommends the pair" in first.advice


def test_no_caching_variable_is_a_warning():
    """PYTORCH_NO_CUDA_MEMORY_CACHING: every setting is ignored."""
    report = _env({"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"})
    assert [f.severity for f in report.findings] == ["warning"]


def test_live_allocator_disagreeing_with_the_environment_is_an_error():
    """The running allocator reports expandable off while the environment asks for it."""
    live = LiveAllocator("2.13.0+cu130", True, "native", {"expandable_segments": False})
    report = _env({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, live=live)
    assert report.worst == "error"
    assert "running allocator reports expandable_segments=False" in report.findings[0].what
    no_gpu = _env({}, live=LiveAllocator("2.13.0+cpu", False))
    assert [f.severity for f in no_gpu.findings] == ["info"]


def _snapshot(events, settings, segments=()):
    return snapshot_from_data(snapshot_to_data(list(segments), {0: events}, settings))


def test_snapshot_settings_are_read_and_the_trace_confirms_them():
    """Recorded settings string parsed; segment_map events imply expandable segments."""
    events = (TraceEvent("segment_map", 0x7000, 20 * MiB), TraceEvent("alloc", 0x7000, 5 * MiB))
    settings = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "expandable_segments": True}
    report = doctor_snapshot(_snapshot(events, settings), "2.5")
    assert report.settings_text == "expandable_segments:True"
    assert report.config is not None and report.config.expandable_segments
    assert report.implied == {"expandable_segments": True}
    assert all(f.severity == "info" for f in report.findings)


def test_snapshot_whose_trace_contradicts_its_settings_is_flagged():
    """Settings say expandable False, the trace maps pages: the setting changed mid-run."""
    events = (TraceEvent("segment_map", 0x7000, 20 * MiB),)
    settings = {"PYTORCH_CUDA_ALLOC_CONF": "", "expandable_segments": False}
    report = doctor_snapshot(_snapshot(events, settings), "2.5")
    assert report.worst == "warning"
    assert "changed while the process ran" in report.findings[0].what


def test_snapshot_without_settings_or_trace_is_bad_input():
    """No allocator_settings and no trace events: SnapshotFormatError (exit 2 on the CLI)."""
    with pytest.raises(SnapshotFormatError, match="nothing shows which settings"):
        doctor_snapshot(_snapshot((TraceEvent("snapshot", 0, 0),), None))


@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/snapshots is absent")
def test_real_snapshots_recorded_with_defaults():
    """Every shared snapshot that records settings: defaults, classic segments, no errors."""
    files = sorted(p for p in SHARED.glob("*/*") if p.suffix in (".pickle", ".pkl"))
    with_settings = 0
    for path in files:
        snap = load_snapshot(path)
        if snap.allocator_settings is None and not any(
            ev.action != "snapshot" for t in snap.device_traces.values() for ev in t
        ):
            continue
        report = doctor_snapshot(snap)
        assert report.worst != "error", path
        if snap.allocator_settings is not None:
            with_settings += 1
            assert report.settings_text == "" and report.config is not None
            assert report.config.expandable_segments is False
    assert with_settings >= 10

"""explain when the run already had expandable segments on: said, not offered again."""

from __future__ import annotations

import json

import pytest

from oomkit.diagnose.diagnosis import diagnose_oom_text
from oomkit.diagnose.oom_text import parse_oom_text
from oomkit.interfaces.cli import main

MiB = 2**20
# 5 GiB cached but unallocated against a 2 GiB request: fragmentation.
TEXT = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
    "capacity of 23.65 GiB of which 1.20 GiB is free. Of the allocated memory 17.00 GiB is "
    "allocated by PyTorch, and 5.00 GiB is reserved by PyTorch but unallocated."
)


def _titles(diagnosis):
    return [r.title for r in diagnosis.remedies]


def test_unknown_setting_offers_expandable_segments():
    """Without knowing the setting, fragmentation offers expandable segments (as PyTorch does)."""
    diagnosis = diagnose_oom_text(parse_oom_text(TEXT))
    assert diagnosis.cause == "fragmentation"
    assert "expandable segments" in _titles(diagnosis)
    assert not any("already had it on" in w for w in diagnosis.warnings)


def test_expandable_already_on_is_said_and_not_offered():
    """With it on, the remedy is gone and a warning says the advice is already followed."""
    diagnosis = diagnose_oom_text(parse_oom_text(TEXT), expandable_segments=True)
    assert diagnosis.cause == "fragmentation"
    assert "expandable segments" not in _titles(diagnosis)
    (note,) = [w for w in diagnosis.warnings if "already had it on" in w]
    assert "the 5.00 GiB cached but unallocated is held in partly used pages" in note


def test_explain_alloc_conf_flag(capsys):
    """explain TEXT --alloc-conf expandable_segments:True --json carries the note."""
    assert main(["explain", TEXT, "--alloc-conf", "expandable_segments:True", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert any("already had it on" in w for w in out["warnings"])
    assert all(r["title"] != "expandable segments" for r in out["remedies"])


def test_alloc_conf_with_a_snapshot_is_refused(tmp_path, capsys):
    """A snapshot records its own settings: --alloc-conf with one exits 2."""
    from oomkit.core.snapshot.writer import write_snapshot
    from oomkit.core.trace import TraceEvent

    path = write_snapshot(tmp_path / "s.pickle", [], {0: [TraceEvent("snapshot", 0, 0)]})
    assert main(["explain", str(path), "--alloc-conf", "expandable_segments:True"]) == 2
    assert "records its own" in capsys.readouterr().err


def test_snapshot_recorded_with_expandable_on_says_so():
    """A snapshot whose recorded settings have expandable segments on, at an OOM: the note."""
    torch = pytest.importorskip("torch")
    from oomkit.core.snapshot import snapshot_from_data
    from oomkit.diagnose.snapshot_diagnosis import diagnose_snapshot
    from oomkit.runtime.simulated import SimulatedCudaDevice

    device = SimulatedCudaDevice(
        "1GiB", context_overhead_bytes=0, record_history=True, alloc_conf="expandable_segments:True"
    )
    with device:
        a, b, c, d = (torch.empty(200 * MiB, dtype=torch.uint8) for _ in range(4))
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(300 * MiB, dtype=torch.uint8)
        snapshot = snapshot_from_data(device.snapshot())
        del a, b, c, d
    assert snapshot.allocator_settings is not None
    assert snapshot.allocator_settings["expandable_segments"] is True
    diagnosis = diagnose_snapshot(snapshot, price_settings=False)
    assert any("already had it on" in w for w in diagnosis.warnings)
    assert all(r.title != "expandable segments" for r in diagnosis.remedies)


def _segment(blocks, expandable=True):
    """A large-pool segment at 1 GiB of (size in MiB, state) blocks, in address order."""
    from oomkit.core.snapshot.model import SnapshotBlock, SnapshotSegment

    base, made, at = 1 << 30, [], 1 << 30
    for size, state in blocks:
        made.append(SnapshotBlock(at, size * MiB, size * MiB, state))
        at += size * MiB
    total = at - base
    return SnapshotSegment(0, base, total, 0, "large", 0, 0, 0, expandable, tuple(made))


@pytest.mark.parametrize(
    ("blocks", "freed_mib"),
    [
        # Free blocks that straddle the 20 MiB pages with live ones: no page is wholly free.
        ([(6, "inactive"), (6, "active_allocated")] * 4 + [(12, "inactive")], None),
        # A free run covering 20-40 MiB whole (and part of 0-20 and 40-60): one page unmapped.
        ([(6, "active_allocated"), (44, "inactive"), (10, "active_allocated")], 20),
    ],
)
def test_empty_cache_frees_only_whole_free_pages_of_an_expandable_segment(blocks, freed_mib):
    """empty_cache unmaps the pages wholly inside free blocks (ExpandableSegment::unmap rounds
    the range inward to its 20 MiB pages); it had counted every free byte."""
    from oomkit.diagnose._remedies import empty_cache_remedy

    remedy = empty_cache_remedy([_segment(blocks)])
    if freed_mib is None:
        assert remedy is None
    else:
        assert remedy is not None and remedy.saving_bytes == freed_mib * MiB

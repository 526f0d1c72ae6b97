"""Every real snapshot in the shared folder loads safely, with the counts its README lists.

The folder is the sibling of the repository root (``../shared/snapshots``) or the one named by
``OOMKIT_SHARED_SNAPSHOTS``. The files are never copied into the repository.
"""

from __future__ import annotations

import collections
import os
import re
from pathlib import Path

import pytest

from oomkit.core.snapshot import FORMAT_GENERATIONS, infer_torch_version, load_snapshot

_REPO_ROOT = Path(__file__).resolve().parents[3]
SHARED = Path(
    os.environ.get("OOMKIT_SHARED_SNAPSHOTS") or _REPO_ROOT / ".." / "shared" / "snapshots"
).resolve()
README = SHARED / "README.md"

pytestmark = pytest.mark.skipif(
    not README.is_file(),
    reason=f"shared snapshots not found at {SHARED} (set OOMKIT_SHARED_SNAPSHOTS to their folder)",
)


def _table() -> list[tuple[str, int, int, dict[str, int]]]:
    """(file, segments, trace events, actions) rows of the README table."""
    if not README.is_file():
        return []
    rows = []
    for line in README.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 7 or not cells[0].startswith("`"):
            continue
        actions = {}
        if cells[6] != "none":
            for item in cells[6].split(","):
                name, count = item.strip().split(":")
                actions[name] = int(count)
        rows.append((cells[0].strip("`"), int(cells[4]), int(cells[5]), actions))
    return rows


ROWS = _table()


def test_table_lists_every_file():
    """The README table and the folder hold the same snapshot files."""
    on_disk = {
        str(p.relative_to(SHARED))
        for p in SHARED.rglob("*")
        if p.is_file() and p.name != "README.md"
    }
    assert {row[0] for row in ROWS} == on_disk
    assert len(ROWS) == 23


@pytest.mark.parametrize("name, segments, events, actions", ROWS, ids=[r[0] for r in ROWS])
def test_shared_snapshot_loads_with_readme_counts(name, segments, events, actions):
    """The file loads through the restricted unpickler with the README's exact counts."""
    snap = load_snapshot(SHARED / name)
    assert len(snap.segments) == segments
    all_events = [ev for trace in snap.device_traces.values() for ev in trace]
    assert len(all_events) == events
    assert dict(collections.Counter(ev.action for ev in all_events)) == actions
    assert snap.format_generation in FORMAT_GENERATIONS
    assert snap.devices()
    for seg in snap.segments:
        # blocks tile their segment in address order (ref §3.1), inferred addresses included
        address = seg.address
        for block in seg.blocks:
            assert block.address == address
            address += block.size
        assert address == seg.address + seg.total_size


# What each file's keys say: (format generation, inferred torch version).
EXPECTED_GENERATIONS = {
    r"Yiyi-philosophy__LLM-inference/.*": ("segments-with-history", "2.0"),
    r"Muduard__LayoutEditing/413b2eb4c1__memory_snapshot\.pkl": ("list-of-segments", "2.1"),
    r"Muduard__LayoutEditing/.*dump_snapshot\.pickle": ("device-traces", "2.1"),
    r"jogregoire__.*": ("device-traces", "2.1"),
    r"LfieLike__.*": ("device-traces+settings", "2.3"),
    r"HugePandaCoder__octree-nca-groupeq/(0cc72993c8|e67173f362)__.*": (
        "device-traces+settings",
        "2.3",
    ),
    r"HugePandaCoder__.*": ("device-traces+settings+annotations", "2.5"),
    r"Wedsonlin__.*": ("device-traces+settings+annotations", "2.9"),
}


@pytest.mark.parametrize("name", [r[0] for r in ROWS])
def test_shared_snapshot_generation_and_version(name):
    """Each file's generation and inferred version follow from its keys."""
    expected = next(v for pattern, v in EXPECTED_GENERATIONS.items() if re.fullmatch(pattern, name))
    snap = load_snapshot(SHARED / name)
    assert (snap.format_generation, infer_torch_version(snap)) == expected


def test_multi_device_file_lists_the_used_device():
    """A file with segments on device 1 and only a snapshot marker on device 0 lists device 1."""
    snap = load_snapshot(SHARED / "Muduard__LayoutEditing/413b2eb4c1__dump_snapshot.pickle")
    assert sorted(snap.device_traces) == [0, 1]
    assert snap.devices() == [1]
    assert [ev.action for ev in snap.trace_for(0)] == ["snapshot"]

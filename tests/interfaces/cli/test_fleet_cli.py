"""The fleet front end (explain DIR / diff DIR_A DIR_B) through its own parser."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from oomkit.interfaces.cli import fleet

OCTREE = Path(__file__).resolve().parents[3] / ".." / "shared" / "snapshots" / "HugePandaCoder__octree-nca-groupeq"
PEAKS = {"b6026285a7__my_snapshot.pickle": 24_410_849_280, "db23ad8d0e__my_snapshot.pickle": 9_193_914_368}

pytestmark = pytest.mark.skipif(not OCTREE.is_dir(), reason="../shared/snapshots is absent")


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--jobs", type=int, default=1)
    fleet.add_fleet_flags(parser)
    return parser.parse_args(list(argv))


def _job(folder: Path, names: list[str], pattern: str) -> Path:
    folder.mkdir()
    for rank, name in enumerate(names):
        (folder / pattern.format(rank)).symlink_to(OCTREE / name)
    return folder


def test_explain_dir_json_names_the_peak_rank(tmp_path, capsys):
    """Two ranks (custom pattern gpuN): rank 1 peaks; --json lists both."""
    folder = _job(tmp_path / "job", list(PEAKS)[::-1], "snap_gpu{}.pickle")
    assert fleet.run_explain(_args("--json", "--rank-pattern", r"gpu(\d+)"), str(folder)) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["peak_rank"] == 1
    assert [r["peak_reserved_bytes"] for r in data["ranks"]] == [9_193_914_368, 24_410_849_280]
    assert data["spread_bytes"] == 24_410_849_280 - 9_193_914_368


def test_explain_dir_table_and_diff(tmp_path, capsys):
    """The terminal report names the peak rank; diff shows the change of each common rank."""
    a = _job(tmp_path / "a", list(PEAKS), "rank{}_memory_snapshot.pickle")
    b = _job(tmp_path / "b", list(PEAKS)[::-1], "memory_snapshot-rank{}.pickle")
    assert fleet.run_explain(_args(), str(a)) == 0
    out = capsys.readouterr().out
    assert "Rank 0 peaks at 22.73 GiB reserved" in out
    assert fleet.run_diff(_args(), str(a), str(b)) == 0
    out = capsys.readouterr().out
    assert "Largest change: rank 1, +14.17 GiB." in out

"""Fleet analysis: per-rank snapshots of a directory reduced on an executor and compared."""

from __future__ import annotations

from pathlib import Path

import pytest

from oomkit.diagnose.fleet import analyze_fleet, diff_fleets, rank_files, rank_of
from oomkit.errors import OomkitError
from oomkit.executors import InProcessExecutor, LocalPoolExecutor, RayExecutor

SNAPSHOTS = Path(__file__).resolve().parents[2] / ".." / "shared" / "snapshots"
OCTREE = SNAPSHOTS / "HugePandaCoder__octree-nca-groupeq"
# Six real snapshots and their peak reserved bytes (run_memory_from_snapshot).
FILES = [
    ("0cc72993c8__my_snapshot.pickle", 21_994_930_176),
    ("752276c112__my_snapshot.pickle", 9_196_011_520),
    ("b6026285a7__my_snapshot.pickle", 24_410_849_280),
    ("d47727a245__my_snapshot.pickle", 22_194_159_616),
    ("db23ad8d0e__my_snapshot.pickle", 9_193_914_368),
    ("e67173f362__my_snapshot.pickle", 20_860_370_944),
]

needs_snapshots = pytest.mark.skipif(not OCTREE.is_dir(), reason="../shared/snapshots is absent")


def _fleet(folder: Path, ranks: int = 16, name: str = "rank{}_memory_snapshot.pickle") -> Path:
    """A job directory of links: rank r is the (r mod 6)-th real snapshot (never copied)."""
    folder.mkdir()
    for r in range(ranks):
        (folder / name.format(r)).symlink_to(OCTREE / FILES[r % 6][0])
    return folder


def test_rank_of_reads_the_frameworks_names():
    """torchtitan, NeMo and Megatron-style names; the last match wins; a custom pattern."""
    assert rank_of("rank12_memory_snapshot.pickle") == 12  # torchtitan
    assert rank_of("memory_snapshot-rank3.pickle") == 3  # NeMo
    assert rank_of("run_rank0_iter_5_rank_7.pickle") == 7  # Megatron path + rank
    assert rank_of("snapshot.pickle") is None
    assert rank_of("gpu05.pickle", r"gpu(\d+)") == 5
    with pytest.raises(OomkitError, match="needs a group around the rank"):
        rank_of("gpu05.pickle", r"gpu\d+")
    with pytest.raises(OomkitError, match="is not a regular expression"):
        rank_of("x", "rank(")


def test_rank_files_refuses_duplicates_and_empty_folders(tmp_path):
    """Two files of one rank, or none naming a rank, are refused with what to do."""
    (tmp_path / "rank1.pickle").write_bytes(b"")
    (tmp_path / "run_rank_1.pickle").write_bytes(b"")
    with pytest.raises(OomkitError, match="both name rank 1"):
        rank_files(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("x")
    with pytest.raises(OomkitError, match="no .pickle file names a rank"):
        rank_files(empty)
    with pytest.raises(OomkitError, match="not a directory"):
        rank_files(tmp_path / "missing")


@pytest.fixture(scope="session")
def sixteen(tmp_path_factory):
    """The 16-rank job folder and its reports read here and on the fork pool, each read once:
    three tests compare with them (each read opens the 16 files). Once a session, not a
    module: the Ray test runs first, apart from this module's other tests (tests/conftest.py
    puts every test of Ray first), so a module fixture was torn down after it and read again
    for them."""
    if not OCTREE.is_dir():
        pytest.skip("../shared/snapshots is absent")
    folder = _fleet(tmp_path_factory.mktemp("fleet") / "job")
    here = analyze_fleet(folder, executor=InProcessExecutor())
    pool = analyze_fleet(folder, executor=LocalPoolExecutor(2))
    return folder, here, pool


@needs_snapshots
def test_sixteen_ranks_peak_median_outliers(sixteen):
    """16 ranks: rank 2 peaks (24.4 GB; ranks 8 and 14 tie, the lowest is named), the median
    is rank 0's 22.0 GB, and the three ranks over it by 10% are outliers."""
    _, report, _ = sixteen
    assert [r.rank for r in report.ranks] == list(range(16))
    assert [r.peak_reserved_bytes for r in report.ranks] == [FILES[r % 6][1] for r in range(16)]
    assert report.peak_rank == 2 and report.median_rank == 0
    assert report.outliers == (2, 8, 14)
    assert report.spread_bytes == 24_410_849_280 - 9_193_914_368
    assert all(d.b_bytes > d.a_bytes for d in report.differences)


@needs_snapshots
def test_local_pool_equals_here(sixteen):
    """The fork pool's report is the one-at-a-time report."""
    _, here, pool = sixteen
    assert pool == here


@needs_snapshots
def test_diff_fleets_rank_by_rank(tmp_path):
    """Job B's ranks are job A's shifted by one file: per-rank peaks, ranks only in A."""
    a = _fleet(tmp_path / "a", ranks=6, name="memory_snapshot-rank{}.pickle")
    b = tmp_path / "b"
    b.mkdir()
    for r in range(4):
        (b / f"rank{r}_memory_snapshot.pickle").symlink_to(OCTREE / FILES[(r + 1) % 6][0])
    diff = diff_fleets(a, b, executor=InProcessExecutor())
    assert diff.per_rank == tuple((r, FILES[r][1], FILES[r + 1][1]) for r in range(4))
    assert diff.only_a == (4, 5) and diff.only_b == ()
    assert diff.largest_growth == (1, 24_410_849_280 - 9_196_011_520)


@needs_snapshots
def test_sixteen_files_on_ray_equal_the_local_pool(sixteen, ray_session):
    """A 16-file fleet read as Ray tasks on a local 2-CPU cluster gives the local report."""
    folder, _, local = sixteen
    on_ray = analyze_fleet(folder, executor=RayExecutor())
    assert on_ray == local

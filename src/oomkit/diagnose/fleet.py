"""Fleet analysis: one report across a job's per-rank memory snapshots, and two jobs compared.

A job on N GPUs that records memory writes one snapshot per rank, the rank in the file name:
torchtitan ``rank{rank}_memory_snapshot.pickle`` (torchtitan/tools/profiling.py
``maybe_enable_memory_snapshot``), NeMo ``memory_snapshot-rank{rank}.pickle``
(nemo/lightning/pytorch/callbacks/memory_profiler.py ``MemoryProfileCallback``), and a
Megatron-LM run that adds the rank to ``--memory-snapshot-path`` (``..._rank_3.pickle``). Each
file is reduced on an ``Executor`` (``run_memory_from_snapshot``: its peak-reserved moment and
what was allocated there), then the ranks are compared: which peaks, how far from the median,
and what the peak rank holds that the median rank does not.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from oomkit.diagnose.run_diff import SiteDelta
from oomkit.errors import OomkitError
from oomkit.executors import Executor, LocalPoolExecutor

__all__ = [
    "FleetDiff",
    "FleetReport",
    "RankMemory",
    "analyze_fleet",
    "diff_fleets",
    "rank_files",
    "rank_of",
]

# The rank in the names the frameworks above write: `rank3`, `rank_3`, `rank-3` (the last one
# in the name wins, so a directory-like prefix `run_rank0_..._rank_3` is read as 3).
DEFAULT_RANK_PATTERN = r"rank[_-]?(\d+)"
_SNAPSHOT_SUFFIXES = (".pickle", ".pkl")
# A rank whose peak is this far above the median is an outlier (one rank unlike the others).
_OUTLIER_SHARE = 0.10
# Sites and categories kept per rank (the largest), and differences shown.
_TOP = 10
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class RankMemory:
    """One rank's snapshot, reduced: its peak reserved and what was allocated there."""

    rank: int
    path: str
    peak_reserved_bytes: int
    allocated_at_peak_bytes: int
    by_category_bytes: Mapping[str, int]
    by_site_bytes: Mapping[str, int]


@dataclass(frozen=True)
class FleetReport:
    """Every rank of one job, and how they differ.

    Attributes:
        directory: where the snapshots are.
        ranks: one record per rank, by rank.
        peak_rank: the rank with the highest peak reserved (the lowest such rank on a tie).
        median_rank: the rank whose peak is the median (the lower middle one).
        spread_bytes: the highest minus the lowest peak reserved.
        outliers: ranks whose peak exceeds the median by more than 10%.
        differences: sites (then categories) the peak rank holds more of than the median rank
            at their peaks, largest first.
    """

    directory: str
    ranks: tuple[RankMemory, ...]
    peak_rank: int
    median_rank: int
    spread_bytes: int
    outliers: tuple[int, ...]
    differences: tuple[SiteDelta, ...]

    def rank(self, rank: int) -> RankMemory:
        """The record of ``rank`` (KeyError where absent)."""
        for record in self.ranks:
            if record.rank == rank:
                return record
        raise KeyError(rank)


@dataclass(frozen=True)
class FleetDiff:
    """Two jobs' ranks compared: the peak reserved of each rank in both, and ranks in one."""

    a: FleetReport
    b: FleetReport
    per_rank: tuple[tuple[int, int, int], ...]
    only_a: tuple[int, ...]
    only_b: tuple[int, ...]

    @property
    def largest_growth(self) -> tuple[int, int] | None:
        """(rank, bytes) of the rank whose peak grew most from A to B; None without common ranks."""
        if not self.per_rank:
            return None
        rank, a, b = max(self.per_rank, key=lambda r: (r[2] - r[1], -r[0]))
        return rank, b - a


def rank_of(name: str, pattern: str | None = None) -> int | None:
    """The rank in a file name (its last match of ``pattern``'s first group), or None.

    Raises:
        OomkitError: ``pattern`` is not a regular expression with one group.
    """
    try:
        regex = re.compile(pattern or DEFAULT_RANK_PATTERN, re.IGNORECASE)
    except re.error as exc:
        raise OomkitError(f"--rank-pattern {pattern!r} is not a regular expression: {exc}") from exc
    if regex.groups < 1:
        raise OomkitError(
            f"--rank-pattern {pattern!r} needs a group around the rank, e.g. 'gpu(\\d+)'"
        )
    matches = list(regex.finditer(name))
    if not matches:
        return None
    text = matches[-1].group(1)
    return int(text) if text.isdigit() else None


def rank_files(directory: str | Path, pattern: str | None = None) -> dict[int, Path]:
    """The snapshot files of a directory by rank (files whose name holds no rank are skipped).

    Raises:
        OomkitError: not a directory, no snapshot names a rank, or two files name one rank.
    """
    folder = Path(directory)
    if not folder.is_dir():
        raise OomkitError(f"{directory}: not a directory of per-rank snapshots")
    found: dict[int, Path] = {}
    for path in sorted(folder.iterdir()):
        if path.suffix.lower() not in _SNAPSHOT_SUFFIXES or not path.is_file():
            continue
        rank = rank_of(path.name, pattern)
        if rank is None:
            continue
        if rank in found:
            raise OomkitError(
                f"{directory}: {found[rank].name} and {path.name} both name rank {rank}; "
                "keep one job's snapshots per directory, or pass --rank-pattern"
            )
        found[rank] = path
    if not found:
        raise OomkitError(
            f"{directory}: no .pickle file names a rank (e.g. rank0_memory_snapshot.pickle, "
            "memory_snapshot-rank3.pickle); pass --rank-pattern with a group around the rank"
        )
    return dict(sorted(found.items()))


def _reduce(item: tuple[int, str]) -> RankMemory:
    """In a worker: one rank's file loaded and reduced to a small record."""
    from oomkit.core.snapshot import load_snapshot
    from oomkit.diagnose.run_diff import run_memory_from_snapshot

    rank, path = item
    try:
        run = run_memory_from_snapshot(load_snapshot(path))
    except OomkitError as exc:
        raise OomkitError(f"rank {rank} ({path}): {exc}") from exc
    sites = sorted(run.by_site_bytes.items(), key=lambda kv: (-kv[1], kv[0]))[:_TOP]
    return RankMemory(
        rank, path, run.peak_reserved_bytes, run.allocated_at_peak_bytes,
        dict(run.by_category_bytes), dict(sites),
    )


def analyze_fleet(
    directory: str | Path,
    *,
    executor: Executor | None = None,
    rank_pattern: str | None = None,
    progress: Progress | None = None,
) -> FleetReport:
    """Reduce every rank's snapshot of ``directory`` and compare the ranks.

    Args:
        directory: a folder of per-rank snapshots (see ``rank_of`` for the names read).
        executor: where the files are read (None: ``LocalPoolExecutor()``).
        rank_pattern: a regular expression whose first group is the rank.
        progress: ``progress(done, total)`` over the files.

    Raises:
        OomkitError: see ``rank_files``; a file that is no snapshot names its rank.
    """
    files = rank_files(directory, rank_pattern)
    runner = executor if executor is not None else LocalPoolExecutor()
    records = runner.map(_reduce, [(r, str(p)) for r, p in files.items()], progress=progress)
    peaks = [r.peak_reserved_bytes for r in records]
    peak = max(records, key=lambda r: (r.peak_reserved_bytes, -r.rank))
    median_bytes = statistics.median_low(peaks)
    median = next(r for r in records if r.peak_reserved_bytes == median_bytes)
    outliers = tuple(
        r.rank for r in records if r.peak_reserved_bytes > median_bytes * (1 + _OUTLIER_SHARE)
    )
    return FleetReport(
        str(directory), tuple(records), peak.rank, median.rank, max(peaks) - min(peaks),
        outliers, _differences(peak, median),
    )


def _differences(peak: RankMemory, median: RankMemory) -> tuple[SiteDelta, ...]:
    """What the peak rank holds more of than the median rank: sites, then categories."""
    out = []
    for a, b in ((median.by_site_bytes, peak.by_site_bytes),
                 (median.by_category_bytes, peak.by_category_bytes)):
        for name in sorted(set(a) | set(b)):
            delta = SiteDelta(name, a.get(name, 0), b.get(name, 0))
            if delta.b_bytes > delta.a_bytes:
                out.append(delta)
    out.sort(key=lambda d: (-(d.b_bytes - d.a_bytes), d.name))
    return tuple(out[:_TOP])


def diff_fleets(
    directory_a: str | Path,
    directory_b: str | Path,
    *,
    executor: Executor | None = None,
    rank_pattern: str | None = None,
) -> FleetDiff:
    """Two jobs' per-rank snapshots compared rank by rank.

    Raises:
        OomkitError: see ``analyze_fleet``.
    """
    a = analyze_fleet(directory_a, executor=executor, rank_pattern=rank_pattern)
    b = analyze_fleet(directory_b, executor=executor, rank_pattern=rank_pattern)
    in_a = {r.rank: r for r in a.ranks}
    in_b = {r.rank: r for r in b.ranks}
    common = sorted(set(in_a) & set(in_b))
    return FleetDiff(
        a, b,
        tuple((r, in_a[r].peak_reserved_bytes, in_b[r].peak_reserved_bytes) for r in common),
        tuple(sorted(set(in_a) - set(in_b))),
        tuple(sorted(set(in_b) - set(in_a))),
    )

"""The test suite of two commits, test by test: is the code slower, or is the suite bigger?

Issue 33 asks that ``make test`` be no slower than at eb25551. The whole suite's wall time mixes
two things: how fast the code runs the tests it already had, and how many tests were added
since (for 33 and for every issue after it). This runs each commit's suite as ``make test``
does (``pytest -n 2 --dist worksteal``) with ``--durations=0``, in a detached worktree of each
commit, with this checkout's virtual environment, and sums pytest's per-test times (setup, call
and teardown) over:

- the test ids both commits have (the same test on both sides; a test renamed since counts as
  removed and added),
- the ids only the base has (removed or renamed) and only the head has (added), by file.

Each sum is CPU-bound test time across the two workers, not wall time; the wall times are
printed beside them. ``--durations-min=0`` lists every phase (pytest hides those under 5 ms by
default; a log saved without it compares the tests that have a longer phase on both sides).
``--logs BASE HEAD`` reads two saved ``--durations=0`` outputs instead of running the suites
(each run takes minutes). The last line is one JSON object.

Usage: ``python benchmarks/test_suite_compare.py [--base eb25551] [--head HEAD] [--out F]``
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PYTHON = REPO / ".venv" / "bin" / "python"
# pytest's --durations lines: "1.23s call     tests/x.py::test_y[param]"
_DURATION = re.compile(r"^([0-9.]+)s (setup|call|teardown)\s+(\S.*?)\s*$")
_SUMMARY = re.compile(r"(\d+) passed(?:, (\d+) skipped)?.* in ([0-9.]+)s")


def run_suite(commit: str, log: Path) -> float:
    """Run ``commit``'s suite in a detached worktree; its output goes to ``log``; wall seconds."""
    with tempfile.TemporaryDirectory(prefix="suite-") as folder:
        tree = Path(folder) / "tree"
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), commit],
            check=True, capture_output=True,
        )
        try:
            start = time.perf_counter()
            with log.open("w") as out:
                subprocess.run(
                    [str(PYTHON), "-m", "pytest", "-n", "2", "--dist", "worksteal",
                     "--durations=0", "--durations-min=0", "-p", "no:cacheprovider"],
                    cwd=tree, stdout=out, stderr=subprocess.STDOUT, check=False,
                    env={**os.environ, "PYTHONPATH": str(tree / "src")},
                )
            return time.perf_counter() - start
        finally:
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)],
                check=False, capture_output=True,
            )


def read_log(log: Path) -> tuple[dict[str, float], dict[str, Any]]:
    """Per-test seconds (setup + call + teardown) and the summary line's counts."""
    times: collections.Counter[str] = collections.Counter()
    summary: dict[str, Any] = {}
    for line in log.read_text(errors="replace").splitlines():
        match = _DURATION.match(line)
        if match:
            times[match.group(3)] += float(match.group(1))
            continue
        match = _SUMMARY.search(line)
        if match:
            summary = {
                "passed": int(match.group(1)),
                "skipped": int(match.group(2) or 0),
                "wall_s": float(match.group(3)),
            }
    if not times:
        raise SystemExit(f"{log}: no --durations=0 lines; was the suite run with them?")
    return dict(times), summary


def compare(base: dict[str, float], head: dict[str, float]) -> dict[str, Any]:
    common = base.keys() & head.keys()
    removed = base.keys() - common
    added = head.keys() - common

    def total(times: dict[str, float], ids: set[str] | Any) -> float:
        return round(sum(times[i] for i in ids), 1)

    by_file: collections.Counter[str] = collections.Counter()
    for test in added:
        by_file[test.split("::")[0]] += head[test]
    return {
        "common_tests": len(common),
        "common_base_s": total(base, common),
        "common_head_s": total(head, common),
        "common_ratio": round(total(head, common) / max(total(base, common), 1e-9), 3),
        "removed_tests": len(removed),
        "removed_base_s": total(base, removed),
        "added_tests": len(added),
        "added_head_s": total(head, added),
        "base_total_s": total(base, base.keys()),
        "head_total_s": total(head, head.keys()),
        "added_by_file_s": {name: round(s, 1) for name, s in by_file.most_common(25)},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="eb25551")
    parser.add_argument("--head", default="HEAD")
    parser.add_argument("--logs", nargs=2, type=Path, metavar=("BASE_LOG", "HEAD_LOG"),
                        help="saved --durations=0 outputs instead of running the suites")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.logs:
        base_log, head_log = args.logs
    else:
        folder = Path(tempfile.mkdtemp(prefix="suite-logs-"))
        base_log, head_log = folder / "base.txt", folder / "head.txt"
        for commit, log in ((args.base, base_log), (args.head, head_log)):
            print(f"running {commit}'s suite ({log}) ...", file=sys.stderr)
            run_suite(commit, log)
    base, base_summary = read_log(base_log)
    head, head_summary = read_log(head_log)
    result = compare(base, head)
    print(f"base {args.base}: {base_summary}; head {args.head}: {head_summary}")
    print(f"the {result['common_tests']} tests both have: {result['common_base_s']} s -> "
          f"{result['common_head_s']} s of test time (x{result['common_ratio']})")
    print(f"removed or renamed: {result['removed_tests']} tests, {result['removed_base_s']} s; "
          f"added: {result['added_tests']} tests, {result['added_head_s']} s")
    for name, seconds in list(result["added_by_file_s"].items())[:10]:
        print(f"  {seconds:6.1f} s  {name}")
    report = {
        "benchmark": "test_suite_compare",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "base": {"commit": args.base, **base_summary},
        "head": {"commit": args.head, **head_summary},
        **result,
    }
    line = json.dumps(report, sort_keys=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())

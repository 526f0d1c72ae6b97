"""A fresh-copy verify replay, and its per-snapshot preparation, under two builds, alternating.

``oomkit replay FILE --verify`` replays a snapshot once: everything ``prepared`` computes for it
(the trace without private-pool entries, the torch version, the final segments, the
reconstructed start state, the trace columns) is paid by every such replay (issue 41). This
benchmark times, on the six real traces with the most events in ``../shared/snapshots``:

- ``verify``: ``replay_snapshot(copy.copy(snapshot), device, verify=True)`` of all six, as
  ``benchmarks/replay_speed.py --part real`` times it (a fresh copy: nothing cached);
- ``prepare``: ``prepared(copy.copy(snapshot), device, None)`` of all six, the part of
  ``verify`` that does not depend on the allocator core.

Each build named on the command line (a folder put first on ``sys.path``: ``src`` of a worktree
for the pure-Python core, a ``pip install --target`` folder for the compiled one) runs in its own
process, in turn, ``--rounds`` times (the order alternating each round, since the machine is
shared and noisy); each process times ``--passes`` passes of each figure after two warm-up
passes. Printed: the median and range of the per-pass CPU time (``time.process_time``) of each
build over every pass of every round, and each build's change against the first; with
``--instructions``, also each build's instructions per pass (valgrind's cachegrind, hash seed
fixed: a count the shared machine's load does not change); the last line is one JSON object
with every pass.

    python benchmarks/replay_prepare.py --build base=/work/wt-base/src --build new=src
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_SNAPSHOTS = REPO.parent / "shared" / "snapshots"


def largest(directory: Path, count: int) -> list[Path]:
    """The ``count`` snapshots with the most trace events (on their first device), in the
    order of benchmarks/replay_speed.py: most events first, then most segments."""
    from oomkit.core.snapshot import load_snapshot

    sized = []
    for path in sorted(p for p in directory.glob("*/*") if p.suffix in (".pickle", ".pkl")):
        snapshot = load_snapshot(path)
        devices = snapshot.devices()
        if devices:
            sized.append((len(snapshot.trace_for(devices[0])), len(snapshot.segments), path))
    sized.sort(key=lambda t: (t[0], t[1]), reverse=True)
    return [t[2] for t in sized[:count]]


def worker(files: list[Path], passes: int, warm: int, only: str | None) -> dict[str, Any]:
    """One build's passes (run in a process whose ``sys.path`` starts with the build)."""
    import copy

    from oomkit._build import allocator_core
    from oomkit.core.replay import replay_snapshot
    from oomkit.core.replay._prepared import prepared
    from oomkit.core.snapshot import load_snapshot

    chosen = []
    for path in files:
        snapshot = load_snapshot(path)
        chosen.append((snapshot, snapshot.devices()[0]))

    def verify() -> None:
        for snapshot, device in chosen:
            replay_snapshot(copy.copy(snapshot), device, verify=True)

    def prepare() -> None:
        for snapshot, device in chosen:
            prepared(copy.copy(snapshot), device, None)

    out: dict[str, Any] = {
        "allocator": allocator_core(),
        "events": sum(len(s.trace_for(d)) for s, d in chosen),
    }
    for name, fn in (("verify", verify), ("prepare", prepare)):
        if only not in (None, name):
            continue
        for _ in range(warm):
            fn()
        times = []
        for _ in range(passes):
            start = time.process_time()
            fn()
            times.append(time.process_time() - start)
        out[name] = times
    return out


def instructions(path: str, files: list[Path], what: str) -> int:
    """Instructions (valgrind cachegrind's I refs) of one pass of ``what``: three passes less
    one, halved, so loading the files and starting Python cancel out."""
    counts = []
    for passes in (1, 3):
        done = subprocess.run(
            ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
             sys.executable, __file__, "--worker", "--passes", str(passes), "--warm", "0",
             "--only", what, *map(str, files)],
            env={**os.environ, "PYTHONPATH": str(Path(path).resolve()), "PYTHONHASHSEED": "0"},
            capture_output=True, text=True, check=True,
        )
        line = next(x for x in done.stderr.splitlines() if "I" in x and "refs:" in x)
        counts.append(int(line.split()[-1].replace(",", "")))
    return (counts[1] - counts[0]) // 2


def _summary(times: list[float]) -> dict[str, float]:
    ms = sorted(t * 1e3 for t in times)
    return {"median_ms": round(statistics.median(ms), 3), "min_ms": round(ms[0], 3),
            "max_ms": round(ms[-1], 3), "passes": len(ms)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", action="append", default=[], metavar="NAME=PATH",
                        help="a build: a folder put first on sys.path (twice or more)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--count", type=int, default=6, help="how many of the largest traces")
    parser.add_argument("--snapshots", type=Path, default=DEFAULT_SNAPSHOTS)
    parser.add_argument("--instructions", action="store_true",
                        help="also count each build's instructions per pass (valgrind)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--warm", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--only", choices=("verify", "prepare"), help=argparse.SUPPRESS)
    parser.add_argument("files", nargs="*", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.files, args.passes, args.warm, args.only)))
        return 0
    files = largest(args.snapshots, args.count)
    builds = [tuple(b.split("=", 1)) for b in args.build]
    if len(builds) < 2 or any(len(b) != 2 for b in builds):
        parser.error("name two builds or more: --build NAME=PATH --build NAME=PATH")
    runs: dict[str, dict[str, Any]] = {name: {"verify": [], "prepare": []} for name, _ in builds}
    for round_ in range(args.rounds):
        order = builds if round_ % 2 == 0 else builds[::-1]
        for name, path in order:
            env = {**os.environ, "PYTHONPATH": str(Path(path).resolve())}
            done = subprocess.run(
                [sys.executable, __file__, "--worker", "--passes", str(args.passes),
                 *map(str, files)],
                env=env, capture_output=True, text=True, check=True,
            )
            got = json.loads(done.stdout.strip().splitlines()[-1])
            for key in ("verify", "prepare"):
                runs[name][key].extend(got[key])
            runs[name].update(allocator=got["allocator"], events=got["events"])
    first = builds[0][0]
    summary: dict[str, Any] = {}
    for name, path in builds:
        row = {key: _summary(runs[name][key]) for key in ("verify", "prepare")}
        row.update(path=path, allocator=runs[name]["allocator"], events=runs[name]["events"])
        summary[name] = row
        change = {
            key: round(row[key]["median_ms"] / summary[first][key]["median_ms"] - 1, 4)
            for key in ("verify", "prepare")
        }
        row["change_vs_" + first] = change
        print(f"{name:>12} ({row['allocator']}): verify {row['verify']['median_ms']:.2f} ms "
              f"[{row['verify']['min_ms']:.2f}, {row['verify']['max_ms']:.2f}], prepare "
              f"{row['prepare']['median_ms']:.2f} ms [{row['prepare']['min_ms']:.2f}, "
              f"{row['prepare']['max_ms']:.2f}] per pass of {row['events']:,} events; "
              f"change {change['verify']:+.1%} / {change['prepare']:+.1%}", flush=True)
        if args.instructions:
            row["instructions_per_pass"] = {
                key: instructions(path, files, key) for key in ("verify", "prepare")
            }
            change_ir = {
                key: round(row["instructions_per_pass"][key]
                           / summary[first]["instructions_per_pass"][key] - 1, 4)
                for key in ("verify", "prepare")
            }
            row["instructions_change_vs_" + first] = change_ir
            print(f"{name:>12}: {row['instructions_per_pass']['verify']:,} instructions a verify "
                  f"pass, {row['instructions_per_pass']['prepare']:,} a prepare pass; change "
                  f"{change_ir['verify']:+.1%} / {change_ir['prepare']:+.1%}", flush=True)
    print(json.dumps({
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cores": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()],
        "rounds": args.rounds, "passes": args.passes,
        "files": [f"{p.parent.name}/{p.name}" for p in files], "summary": summary,
        "runs": {name: {k: [round(t, 6) for t in v] for k, v in runs[name].items()
                        if k in ("verify", "prepare")} for name in runs},
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

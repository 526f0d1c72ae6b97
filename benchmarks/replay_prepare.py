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
build over every pass of every round, and the last build's change against the first; the last
line is one JSON object with every pass.

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


def worker(directory: Path, count: int, passes: int) -> dict[str, Any]:
    """One build's passes (run in a process whose ``sys.path`` starts with the build)."""
    import copy

    from oomkit._build import allocator_core
    from oomkit.core.replay import replay_snapshot
    from oomkit.core.replay._prepared import prepared
    from oomkit.core.snapshot import load_snapshot

    sized = []
    for path in sorted(p for p in directory.glob("*/*") if p.suffix in (".pickle", ".pkl")):
        snapshot = load_snapshot(path)
        devices = snapshot.devices()
        if devices:
            events = len(snapshot.trace_for(devices[0]))
            sized.append((events, len(snapshot.segments), path.name, snapshot, devices[0]))
    # The order of benchmarks/replay_speed.py: most events first, then most segments.
    sized.sort(key=lambda t: (t[0], t[1]), reverse=True)
    chosen = sized[:count]

    def verify() -> None:
        for *_, snapshot, device in chosen:
            replay_snapshot(copy.copy(snapshot), device, verify=True)

    def prepare() -> None:
        for *_, snapshot, device in chosen:
            prepared(copy.copy(snapshot), device, None)

    out: dict[str, Any] = {
        "allocator": allocator_core(),
        "events": sum(t[0] for t in chosen),
        "files": [t[2] for t in chosen],
    }
    for name, fn in (("verify", verify), ("prepare", prepare)):
        fn()
        fn()
        times = []
        for _ in range(passes):
            start = time.process_time()
            fn()
            times.append(time.process_time() - start)
        out[name] = times
    return out


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
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.snapshots, args.count, args.passes)))
        return 0
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
                 "--count", str(args.count), "--snapshots", str(args.snapshots)],
                env=env, capture_output=True, text=True, check=True,
            )
            got = json.loads(done.stdout.strip().splitlines()[-1])
            for key in ("verify", "prepare"):
                runs[name][key].extend(got[key])
            runs[name].update(allocator=got["allocator"], events=got["events"], files=got["files"])
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
    print(json.dumps({
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cores": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()],
        "rounds": args.rounds, "passes": args.passes, "summary": summary,
        "runs": {name: {k: [round(t, 6) for t in v] for k, v in runs[name].items()
                        if k in ("verify", "prepare")} for name in runs},
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

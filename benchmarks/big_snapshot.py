"""A 1 GB snapshot (5M events, per-block frames): load, replay and verify time and peak RSS.

Target (issue 19 item 3, on a 2-core machine): load + replay + verify within 60 s, under 4 GB RSS.

The file is written with oomkit's own writer (``snapshot_to_data`` turns each chunk of the
recording into PyTorch's entry dicts; ``pickle`` with ``write_snapshot``'s protocol writes them).
Each event carries its own list of ``--frames`` stack frames; as in the files PyTorch writes, a
frame that recurs is one dict referred to from every stack that holds it. The recording comes
from ``_recording.py``: it starts mid-run with 1,000 segments, so loading, reconstructing,
seeding, replaying and comparing are all measured.

Loading, replaying and verifying run in a fresh process, so its peak RSS is theirs alone.
The last line is one JSON object with every figure and the machine (cores, load average).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _recording import make_recording  # noqa: E402

from oomkit.core.snapshot import snapshot_to_data  # noqa: E402
from oomkit.core.trace import Frame, TraceEvent  # noqa: E402

_CHUNK = 100_000
# Distinct call sites the stacks are drawn from (a training step allocates from a few hundred).
_SITES = 400


def _machine() -> dict[str, Any]:
    from oomkit._build import allocator_core

    return {
        "cores": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "allocator": allocator_core(),
    }


def write_big_snapshot(path: Path, events: int, frames: int) -> dict[str, Any]:
    """Write the recording to ``path``; returns how long it took and its size."""
    start = time.perf_counter()
    recording = make_recording(events, 1_000)
    trace = recording.events
    # Per-block frames: every alloc its own stack of `frames` frames, from one of _SITES sites.
    stacks = [
        tuple(Frame(f"model/layer_{(s * 7 + k) % 97}.py", 10 + k, f"fn_{s}_{k}") for k in range(frames))
        for s in range(_SITES)
    ]
    data = snapshot_to_data(recording.segments, [[]], allocator_settings=recording.settings)
    entries: list[dict[str, Any]] = data["device_traces"][0]
    shared: dict[tuple[str, int, str], dict[str, Any]] = {}
    for lo in range(0, len(trace), _CHUNK):
        chunk = [
            TraceEvent(ev.action, ev.address, ev.size, ev.stream, time_us=i,
                       frames=stacks[i % _SITES])
            for i, ev in enumerate(trace[lo : lo + _CHUNK], start=lo)
        ]
        converted = snapshot_to_data([], [chunk])["device_traces"][0]
        for entry in converted:
            # One dict per distinct frame, referred to from every stack (as PyTorch pickles).
            entry["frames"] = [
                shared.setdefault((f["filename"], f["line"], f["name"]), f) for f in entry["frames"]
            ]
        entries.extend(converted)
        trace[lo : lo + _CHUNK] = [None] * len(chunk)  # type: ignore[list-item]
    del trace, recording
    with open(path, "wb") as out:
        pickle.dump(data, out, protocol=pickle.HIGHEST_PROTOCOL)
    return {
        "events": len(entries),
        "frames_per_alloc": frames,
        "file_bytes": path.stat().st_size,
        "write_s": round(time.perf_counter() - start, 1),
    }


def peak_rss_mb() -> float:
    """This process's peak RSS: VmHWM (ru_maxrss survives exec, so a child started by the big
    writer would report the writer's peak)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(path: Path) -> dict[str, Any]:
    """Load, replay with verify, and the peak RSS of this process (run in a fresh one)."""
    from oomkit.core.replay import replay_snapshot
    from oomkit.core.snapshot import load_snapshot

    t0 = time.perf_counter()
    c0 = time.process_time()
    snapshot = load_snapshot(path)
    load_s, load_cpu = time.perf_counter() - t0, time.process_time() - c0
    rss_after_load = peak_rss_mb()
    t1 = time.perf_counter()
    c1 = time.process_time()
    result = replay_snapshot(snapshot, snapshot.devices()[0], verify=True)
    replay_s, replay_cpu = time.perf_counter() - t1, time.process_time() - c1
    events = len(snapshot.trace_for(snapshot.devices()[0]))
    return {
        "events": events,
        "load_s": round(load_s, 2),
        "load_cpu_s": round(load_cpu, 2),
        "replay_verify_s": round(replay_s, 2),
        "replay_verify_cpu_s": round(replay_cpu, 2),
        "total_s": round(load_s + replay_s, 2),
        "verify_events_per_s": round(events / replay_cpu) if replay_cpu else None,
        "reproduced": result.first_divergence is None and result.final_state_matches is not False,
        "peak_rss_after_load_mb": round(rss_after_load),
        "peak_rss_mb": round(peak_rss_mb()),
        "machine": _machine(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=5_000_000)
    parser.add_argument("--frames", type=int, default=30, help="frames per alloc's stack")
    parser.add_argument("--path", type=Path, default=None, help="keep the file here")
    parser.add_argument("--measure-only", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure_only is not None:
        print(json.dumps(measure(args.measure_only)))
        return 0
    keep = args.path is not None
    path = args.path or Path(tempfile.mkdtemp()) / "big_snapshot.pickle"
    try:
        print(f"writing {args.events:,} events to {path} {_machine()}", flush=True)
        written = write_big_snapshot(path, args.events, args.frames)
        print(
            f"  {written['file_bytes'] / 1e9:.2f} GB in {written['write_s']} s", flush=True
        )
        out = subprocess.run(
            [sys.executable, __file__, "--measure-only", str(path)],
            capture_output=True,
            text=True,
            check=True,
        )
        figures = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        if not keep:
            path.unlink(missing_ok=True)
    print(
        f"load {figures['load_s']} s, replay+verify {figures['replay_verify_s']} s "
        f"({figures['verify_events_per_s']:,} events/s CPU), total {figures['total_s']} s "
        f"(target 60 s); peak RSS {figures['peak_rss_mb']:,} MB (target 4,096 MB); "
        f"reproduced={figures['reproduced']} {figures['machine']}"
    )
    print(json.dumps({"written": written, **figures}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

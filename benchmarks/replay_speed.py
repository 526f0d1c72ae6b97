"""Replay speed on what users run: real snapshots with --verify, and how the cost scales.

Four parts, each figure printed with the machine it was measured on (cores, load average):

1. **Real traces**: the largest recorded snapshots in ``../shared/snapshots`` (or ``--snapshots``),
   each loaded (load time), replayed with verify under its recorded setting (as
   ``oomkit replay FILE --verify``), and replayed as a what-if under ``expandable_segments:True``.
2. **Synthetic**: a 1,000,000-event PyTorch-style recording (``_recording.py``: it starts
   mid-run with 1,000 segments already allocated), replayed with verify, default and expandable.
3. **Scaling**: recordings of 10k, 100k, 1M and 10M events (``--quick`` stops at 1M), and of
   100, 1k and 10k seeded segments: the cost per event must stay flat.
4. **Plain** (``--part plain``): oomkit's verify replay against a plain re-implementation of
   the same allocator rules (``_plain_allocator.py``) on the largest real traces, alternating
   in one run, ``--rounds`` times. Both replay from the same inputs (the start state, recorded
   segment events and final segments oomkit reconstructs once per snapshot: ``prepared``), both
   compare with the recording, and the plain one's peaks and every stat it keeps are asserted
   equal to oomkit's first. oomkit's figure from a fresh copy of the snapshot (reconstruction
   included, as ``oomkit replay FILE --verify`` runs it) is printed beside it.

Events/s is trace events divided by the CPU time (``time.process_time``) of
``replay_snapshot(...)``: reconstructing the start state, seeding it, the replay and the
comparison with the recording. CPU time, because the machine may be shared: wall time is printed
beside it. The last line is one JSON object with every figure.

Targets (issue 19, on a 2-core machine when quiet): >= 500,000 events/s on real traces with
verify, no trace slower than the synthetic figure by more than 2x, per-event cost flat.
Issue 41: the compiled core at 10x the plain re-implementation's events/s.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import resource
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _plain_allocator import plain_verify  # noqa: E402
from _recording import make_recording  # noqa: E402

from oomkit.core.allocator import AllocatorConfig  # noqa: E402
from oomkit.core.replay import replay_snapshot  # noqa: E402
from oomkit.core.replay._prepared import prepared  # noqa: E402
from oomkit.core.snapshot import load_snapshot, snapshot_from_data, snapshot_to_data  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_SNAPSHOTS = REPO.parent / "shared" / "snapshots"
EXPANDABLE = "expandable_segments:True"


def allocator_build() -> str:
    """Which allocator core runs: the pure-Python modules, or the compiled ones (a wheel that
    setup.py built, or scripts/compile_allocator.py's in-place build)."""
    from oomkit._build import allocator_core

    return allocator_core()


def machine() -> dict[str, Any]:
    """Cores, load average and the rest of what a figure depends on, measured now."""
    load = os.getloadavg()
    return {
        "allocator": allocator_build(),
        "cores": os.cpu_count(),
        "load_average": [round(x, 2) for x in load],
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def machine_note() -> str:
    m = machine()
    return f"[{m['cores']} cores, load {m['load_average'][0]:.2f}, {m['allocator']}]"


def peak_rss_mb() -> float:
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed(fn: Callable[[], Any], repeat: int = 1) -> tuple[Any, float, float]:
    """``fn()``'s result and its best CPU and wall seconds over ``repeat`` runs."""
    best_cpu = best_wall = float("inf")
    result = None
    for _ in range(repeat):
        cpu, wall = time.process_time(), time.perf_counter()
        result = fn()
        best_cpu = min(best_cpu, time.process_time() - cpu)
        best_wall = min(best_wall, time.perf_counter() - wall)
    return result, best_cpu, best_wall


def rate(events: int, seconds: float) -> int:
    return round(events / seconds) if seconds > 0 else 0


def replay_figures(snapshot: Any, device: int, events: int, repeat: int) -> dict[str, Any]:
    """Verify (recorded setting) and an expandable what-if of one device's trace."""
    # Each run replays a fresh copy of the snapshot object (the data shared): replay_snapshot
    # keeps a snapshot's prepared inputs (its start state, ...) for the next replay of the
    # same object, and a user's `oomkit replay FILE --verify` replays a file once.
    verify, cpu, wall = timed(
        lambda: replay_snapshot(copy.copy(snapshot), device, verify=True), repeat
    )
    reproduced = verify.first_divergence is None and verify.final_state_matches is not False
    row: dict[str, Any] = {
        "events": events,
        "segments_at_end": len(verify.final_segments),
        "verify_cpu_s": round(cpu, 4),
        "verify_wall_s": round(wall, 4),
        "verify_events_per_s": rate(events, cpu),
        "reproduced": reproduced,
        "machine": machine_note(),
    }
    config = AllocatorConfig.parse(EXPANDABLE)
    _, cpu, wall = timed(
        lambda: replay_snapshot(copy.copy(snapshot), device, config=config), repeat
    )
    row.update(
        expandable_cpu_s=round(cpu, 4),
        expandable_wall_s=round(wall, 4),
        expandable_events_per_s=rate(events, cpu),
    )
    return row


def real_traces(directory: Path, count: int, repeat: int) -> dict[str, dict[str, Any]]:
    """The ``count`` real snapshots with the most trace events, loaded and replayed."""
    files = sorted(p for p in directory.glob("*/*") if p.suffix in (".pickle", ".pkl"))
    sized = []
    for path in files:
        snapshot = load_snapshot(path)
        devices = snapshot.devices()
        if not devices:
            continue
        events = len(snapshot.trace_for(devices[0]))
        sized.append((events, len(snapshot.segments), path))
    # Most events first; among traces with none, the most segments (seeding cost).
    sized.sort(key=lambda t: (t[0], t[1]), reverse=True)
    rows: dict[str, dict[str, Any]] = {}
    for events, _segments, path in sized[:count]:
        snapshot, load_cpu, load_wall = timed(lambda p=path: load_snapshot(p), repeat)
        device = snapshot.devices()[0]
        row = {
            "file_mb": round(path.stat().st_size / 2**20, 2),
            "load_cpu_s": round(load_cpu, 4),
            "load_wall_s": round(load_wall, 4),
            **replay_figures(snapshot, device, events, repeat),
        }
        name = f"{path.parent.name}/{path.name}"
        rows[name] = row
        print(
            f"{name}\n    {events:,} events, {row['segments_at_end']} segments, "
            f"{row['file_mb']} MB: load {load_wall:.3f} s; verify "
            f"{row['verify_events_per_s']:,} events/s ({row['verify_cpu_s']:.3f} s CPU, "
            f"reproduced={row['reproduced']}); expandable what-if "
            f"{row['expandable_events_per_s']:,} events/s {row['machine']}",
            flush=True,
        )
    return rows


def synthetic(events: int, segments: int, repeat: int, expandable: bool = False) -> dict[str, Any]:
    """A synthetic recording of ``events`` events and ``segments`` seeded segments, replayed."""
    recording, gen_cpu, _ = timed(lambda: make_recording(events, segments, expandable=expandable))
    data = snapshot_to_data(
        recording.segments, [recording.events], allocator_settings=recording.settings
    )
    snapshot = snapshot_from_data(data)
    del data
    row = {"generate_cpu_s": round(gen_cpu, 2)}
    row.update(replay_figures(snapshot, 0, len(recording.events), repeat))
    row["us_per_event"] = round(row["verify_cpu_s"] / max(1, row["events"]) * 1e6, 3)
    return row


def print_synthetic(label: str, row: dict[str, Any]) -> None:
    print(
        f"{label:>34}: {row['events']:>10,} events: verify {row['verify_events_per_s']:>9,} "
        f"events/s ({row['us_per_event']:.2f} us/event, reproduced={row['reproduced']}); "
        f"expandable what-if {row['expandable_events_per_s']:>9,} events/s "
        f"{row['machine']}",
        flush=True,
    )


def largest_traces(directory: Path, count: int) -> list[tuple[int, Path, Any]]:
    """The ``count`` loaded snapshots with the most trace events: (events, path, snapshot)."""
    sized = []
    for path in sorted(p for p in directory.glob("*/*") if p.suffix in (".pickle", ".pkl")):
        snapshot = load_snapshot(path)
        devices = snapshot.devices()
        if devices:
            events = len(snapshot.trace_for(devices[0]))
            sized.append((events, len(snapshot.segments), path, snapshot))
    sized.sort(key=lambda t: (t[0], t[1]), reverse=True)
    return [(events, path, snapshot) for events, _segments, path, snapshot in sized[:count]]


def check_plain_agrees(snapshot: Any, device: int) -> None:
    """The plain re-implementation reproduces oomkit's verify result on this trace (so the
    comparison is fair): peaks, every stat it keeps, segment events and the final state."""
    ours = replay_snapshot(snapshot, device, verify=True)
    inputs = prepared(snapshot, device, None)
    plain = plain_verify(inputs.events, inputs.start.segments, inputs.recorded, inputs.final)
    assert (plain.peak_allocated_bytes, plain.peak_reserved_bytes) == (
        ours.peak_allocated_bytes,
        ours.peak_reserved_bytes,
    ), "the plain re-implementation's peaks differ from oomkit's"
    differing = {k for k, v in plain.memory_stats.items() if ours.memory_stats[k] != v}
    assert not differing, f"the plain re-implementation's stats differ: {sorted(differing)}"
    assert tuple(plain.segment_events) == ours.segment_events
    assert plain.segment_events_matched == ours.segment_events_matched
    assert plain.final_state_matches == ours.final_state_matches


def plain_comparison(directory: Path, count: int, rounds: int) -> dict[str, Any]:
    """oomkit's verify replay against the plain re-implementation, alternating, ``rounds`` times.

    Each round replays every trace with oomkit (from its prepared inputs, and from a fresh
    copy), then with the plain one; a figure is the events of all traces over the summed CPU
    seconds, the best round's.
    """
    traces = largest_traces(directory, count)
    for _events, _path, snapshot in traces:
        check_plain_agrees(snapshot, snapshot.devices()[0])
    total = sum(events for events, _, _ in traces)
    rows = []
    for round_index in range(rounds):
        ours = fresh = plain = 0.0
        for _events, _path, snapshot in traces:
            device = snapshot.devices()[0]
            inputs = prepared(snapshot, device, None)
            _, cpu, _ = timed(lambda s=snapshot, d=device: replay_snapshot(s, d, verify=True))
            ours += cpu
            _, cpu, _ = timed(
                lambda s=snapshot, d=device: replay_snapshot(copy.copy(s), d, verify=True)
            )
            fresh += cpu
            _, cpu, _ = timed(
                lambda i=inputs: plain_verify(i.events, i.start.segments, i.recorded, i.final)
            )
            plain += cpu
        row = {
            "round": round_index + 1,
            "oomkit_events_per_s": rate(total, ours),
            "oomkit_fresh_copy_events_per_s": rate(total, fresh),
            "plain_events_per_s": rate(total, plain),
            "ratio": round(plain / ours, 2) if ours > 0 else 0.0,
            "ratio_fresh_copy": round(plain / fresh, 2) if fresh > 0 else 0.0,
            "machine": machine_note(),
        }
        rows.append(row)
        print(
            f"round {row['round']}: oomkit {row['oomkit_events_per_s']:,} events/s "
            f"(fresh copy {row['oomkit_fresh_copy_events_per_s']:,}), plain "
            f"{row['plain_events_per_s']:,} events/s: {row['ratio']:.2f}x "
            f"({row['ratio_fresh_copy']:.2f}x from a fresh copy) {row['machine']}",
            flush=True,
        )
    best = max(rows, key=lambda r: r["oomkit_events_per_s"])
    ratios = sorted(r["ratio"] for r in rows)
    return {
        "traces": {f"{p.parent.name}/{p.name}": events for events, p, _ in traces},
        "events": total,
        "rounds": rows,
        "median_ratio": ratios[len(ratios) // 2],
        "best_round": best,
    }


def _counts(text: str) -> list[int]:
    """``"10000,1000000"`` -> ``[10000, 1000000]`` (``""``: none)."""
    return [int(part.replace("_", "")) for part in text.split(",") if part.strip()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--snapshots", type=Path, default=DEFAULT_SNAPSHOTS)
    parser.add_argument("--real", type=int, default=6, help="how many real traces (largest)")
    parser.add_argument("--repeat", type=int, default=1, help="best of N runs per figure")
    parser.add_argument("--quick", action="store_true", help="skip the 10M-event recording")
    parser.add_argument(
        "--rounds", type=int, default=5, help="alternating rounds of the plain comparison"
    )
    parser.add_argument(
        "--events-series",
        type=_counts,
        default=None,
        help="the scaling series' event counts, comma-separated (default 10k,100k,1M,10M)",
    )
    parser.add_argument(
        "--segments-series",
        type=_counts,
        default=[100, 1_000, 10_000],
        help="the seeded-segment counts of the 100,000-event rows (default 100,1000,10000; "
        "'' for none)",
    )
    parser.add_argument(
        "--part",
        choices=("all", "real", "synthetic", "scaling", "plain"),
        default="all",
        help="run one part only",
    )
    args = parser.parse_args()
    print(f"machine: {json.dumps(machine())}", flush=True)
    out: dict[str, Any] = {"machine": machine()}

    if args.part in ("all", "real"):
        if args.snapshots.is_dir():
            print(f"\nReal traces ({args.snapshots}):", flush=True)
            out["real"] = real_traces(args.snapshots, args.real, args.repeat)
        else:
            print(f"\nReal traces: {args.snapshots} not found; skipped", flush=True)

    if args.part in ("all", "plain"):
        if args.snapshots.is_dir():
            print(f"\nAgainst a plain re-implementation ({args.real} largest traces):", flush=True)
            out["plain"] = plain_comparison(args.snapshots, args.real, args.rounds)
            print(f"median ratio {out['plain']['median_ratio']:.2f}x", flush=True)
        else:
            print(f"\nPlain comparison: {args.snapshots} not found; skipped", flush=True)

    if args.part in ("all", "synthetic"):
        print("\nSynthetic recording (1,000 seeded segments):", flush=True)
        row = synthetic(1_000_000, 1_000, args.repeat)
        print_synthetic("1M events", row)
        out["synthetic"] = row

    if args.part in ("all", "scaling"):
        print("\nScaling (cost per event should stay flat):", flush=True)
        scaling: dict[str, Any] = {}
        sizes = args.events_series or (
            [10_000, 100_000, 1_000_000] + ([] if args.quick else [10_000_000])
        )
        for n in sizes:
            row = synthetic(n, 1_000, args.repeat)
            scaling[f"events={n}"] = row
            print_synthetic(f"{n:,} events, 1,000 segments", row)
        for segments in args.segments_series:
            row = synthetic(100_000, segments, args.repeat)
            scaling[f"segments={segments}"] = row
            print_synthetic(f"100,000 events, {segments:,} segments", row)
        out["scaling"] = scaling

    out["peak_rss_mb"] = round(peak_rss_mb(), 1)
    print(f"\npeak RSS {out['peak_rss_mb']} MB {machine_note()}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

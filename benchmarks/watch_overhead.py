"""What ``oomkit.watch()`` / ``oomkit run`` cost: recording overhead and snapshot size (issue 4 §1).

Three measurements:

1. **Snapshot size per recorded event** against stack depth: snapshots in PyTorch's layout
   (``device_traces`` entries with ``frames``, as ``_dump_snapshot`` pickles them) are written
   for ``--entries`` events with 1 to 64 Python frames each, every frame with its own strings as
   torch's C++ side creates them. The file size is ``max_entries`` times this figure (plus the
   segments), so it bounds what ``--max-entries`` costs on disk and in host memory at the dump.
2. **On a GPU** (when CUDA is available): a loop of small allocations and frees timed without
   recording, then under ``_record_memory_history(stacks="python", context="alloc")`` (what
   ``watch`` turns on) and ``context="all"``, and the real ``_dump_snapshot`` size per entry.
3. **On CPU**: the same loop under ``SimulatedCudaDevice`` with and without its history and
   inside ``watch`` (oomkit's own cost on the simulated device, not PyTorch's).

Prints a table per measurement and, last, one JSON line with every figure.
Run: ``python benchmarks/watch_overhead.py [--entries 20000] [--iters 20000]``.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import tempfile
import time
from pathlib import Path

import torch

from oomkit.runtime.simulated import SimulatedCudaDevice
from oomkit.runtime.watch import DEFAULT_MAX_ENTRIES, watch
from oomkit.units import format_bytes

DEPTHS = (1, 8, 16, 32, 64)


def _frames(depth: int, salt: int) -> list[dict]:
    # Distinct string objects per frame (no pickle memo sharing), as torch builds them per entry.
    return [
        {
            "filename": "".join(
                ["/opt/venv/lib/python3.11/site-packages/pkg/module_", str(k), ".py"]
            ),
            "line": 100 + k + salt % 7,
            "name": "".join(["function_", str(k)]),
        }
        for k in range(depth)
    ]


def snapshot_bytes_per_entry(entries: int, depth: int) -> float:
    """Pickled bytes per trace entry of ``depth`` frames in PyTorch's snapshot layout."""
    trace = []
    for i in range(entries):
        action = ("alloc", "free_requested", "free_completed")[i % 3]
        trace.append(
            {
                "action": action,
                "addr": 139_000_000_000 + 512 * (i // 3),
                "size": 512 * (1 + i % 64),
                "stream": 0,
                "time_us": 1_700_000_000_000_000 + i,
                "frames": _frames(depth, i),
            }
        )
    data = {
        "segments": [],
        "device_traces": [trace],
        "allocator_settings": {},
        "external_annotations": [],
    }
    return len(pickle.dumps(data)) / entries


def _alloc_loop(iters: int, device: str, repeats: int = 3) -> float:
    """Seconds per alloc+free of a 4 KiB tensor, the best of ``repeats`` runs (shared hosts)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            t = torch.empty(1024, device=device)
            del t
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / iters)
    return best


def gpu_overhead(iters: int) -> dict:
    memory = torch.cuda.memory
    out: dict = {}
    _alloc_loop(1000, "cuda")  # warm-up
    out["off_us"] = _alloc_loop(iters, "cuda") * 1e6
    for context in ("alloc", "all"):
        memory._record_memory_history(
            enabled="all", context=context, stacks="python", max_entries=DEFAULT_MAX_ENTRIES
        )
        out[f"{context}_us"] = _alloc_loop(iters, "cuda") * 1e6
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "s.pickle"
            start = time.perf_counter()
            memory._dump_snapshot(str(path))
            out[f"{context}_dump_s"] = time.perf_counter() - start
            entries = sum(len(t) for t in memory._snapshot()["device_traces"])
            out[f"{context}_entries"] = entries
            out[f"{context}_bytes_per_entry"] = path.stat().st_size / max(1, entries)
        memory._record_memory_history(enabled=None)
    return out


def simulated_overhead(iters: int) -> dict:
    out: dict = {}
    with SimulatedCudaDevice("24GiB", context_overhead_bytes=0):
        _alloc_loop(200, "cpu")
        out["sim_off_us"] = _alloc_loop(iters, "cpu") * 1e6
    with SimulatedCudaDevice(
        "24GiB", context_overhead_bytes=0, record_history=True, max_entries=DEFAULT_MAX_ENTRIES
    ) as device:
        with tempfile.TemporaryDirectory() as tmp, watch(snapshot_dir=tmp):
            out["sim_watch_us"] = _alloc_loop(iters, "cpu") * 1e6
        out["sim_history_us"] = _alloc_loop(iters, "cpu") * 1e6
        data = pickle.dumps(device.snapshot())
        entries = len(device.events())
        out["sim_entries"] = entries
        out["sim_bytes_per_entry"] = len(data) / max(1, entries)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=20_000, help="events per size sample")
    parser.add_argument("--iters", type=int, default=20_000, help="allocations per timing")
    args = parser.parse_args(argv)

    result: dict = {"torch": torch.__version__, "max_entries_default": DEFAULT_MAX_ENTRIES}
    print(f"Snapshot size per event ({args.entries} events, PyTorch's layout, pickled)")
    print(f"{'frames':>7} {'bytes/event':>12} {'at max_entries=100000':>22}")
    sizes = {}
    for depth in DEPTHS:
        per = snapshot_bytes_per_entry(args.entries, depth)
        sizes[depth] = per
        print(f"{depth:>7} {per:>12.0f} {format_bytes(int(per * DEFAULT_MAX_ENTRIES)):>22}")
    result["bytes_per_entry_by_depth"] = {str(k): round(v, 1) for k, v in sizes.items()}

    if torch.cuda.is_available():
        gpu = gpu_overhead(args.iters)
        result["gpu"] = {"name": torch.cuda.get_device_name(), **gpu}
        print(f"\nOn {torch.cuda.get_device_name()}: alloc+free of 4 KiB, {args.iters} times")
        print(f"  recording off           {gpu['off_us']:.2f} us")
        for context in ("alloc", "all"):
            print(
                f"  context={context:<6} stacks=python {gpu[f'{context}_us']:.2f} us; "
                f"snapshot {gpu[f'{context}_bytes_per_entry']:.0f} B/event, "
                f"dump {gpu[f'{context}_dump_s']:.2f} s for {gpu[f'{context}_entries']} events"
            )
    else:
        print("\nNo CUDA device: PyTorch's own recording overhead is not measured here.")

    sim = simulated_overhead(args.iters)
    result["simulated"] = sim
    print(f"\nSimulated device (CPU, oomkit's own cost), alloc+free of 4 KiB, {args.iters} times")
    print(f"  no history              {sim['sim_off_us']:.2f} us")
    print(f"  history                 {sim['sim_history_us']:.2f} us")
    print(f"  history + oomkit.watch  {sim['sim_watch_us']:.2f} us")
    print(f"  snapshot                {sim['sim_bytes_per_entry']:.0f} B/event (1 frame each)")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())

"""`oomkit predict` against PyTorch's MemTracker on the same training steps, whole process each.

MemTracker (``torch.distributed._tools.mem_tracker``) is PyTorch's own GPU-free memory estimator:
it runs the step under ``FakeTensorMode`` and accounts every tensor by module and category. Both
tools are timed as a user waits for them: a fresh process from start to exit (imports included),
the tools alternating in one run so that the machine's load falls on all alike. Wall seconds and
the child's CPU seconds (``getrusage``: what does not move with the load) are printed, with the
ratio MemTracker / oomkit (above 1: oomkit is faster).

oomkit runs twice per round (``prediction/recording_cache.py``): **cold**, with an empty
recording cache (``OOMKIT_CACHE_DIR`` a new empty folder: the step is recorded, which imports
torch, and the recording kept), then **warm**, the same command again (the kept recording is
replayed, without importing torch). Cold is a user's first prediction of a step on an
installation; warm every later one of the same step (the same scenario, oomkit source, package
versions and environment). Each ratio says which it is; the warm run's ``--json`` is checked to
be byte-identical to the cold run's.

Cases (issue 41 item 3), fp32 weights, AdamW (foreach, as on CUDA):
- ``gpt2-124m``: GPT-2 124M, batch 8, seq 1024, 3 training steps;
- ``llama-3b``: Llama 3.2 3B (3.2B parameters: the presets' nearest to a 2.7B model), batch 1,
  seq 2048, one training step.

MemTracker runs on the same model (oomkit's preset builder, the same modules), on fake CUDA
tensors where this torch has CUDA, else on fake CPU tensors (said in the output: its CPU kernels'
fake implementations stand in for CUDA's; the work it does per op is the same kind).
The last line is one JSON object with every figure and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from typing import Any

# name -> (preset, batch, seq, steps)
CASES = {
    "gpt2-124m": ("gpt2-124m", 8, 1024, 3),
    "llama-3b": ("llama-3b", 1, 2048, 1),
}


def memtracker_child(case: str) -> dict[str, Any]:
    """Run the case's steps under FakeTensorMode with MemTracker; its peak, by device."""
    import torch
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from oomkit.prediction.models.presets import get_preset

    name, batch, seq, steps = CASES[case]
    preset = get_preset(name)
    vocab = int(preset.shape.vocab)  # type: ignore[union-attr]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with FakeTensorMode():
        with torch.device(device):
            model = preset.build()
            ids = torch.randint(0, vocab, (batch, seq))
        optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
        with tracker:
            for step in range(steps):
                logits = model(ids)
                loss = F.cross_entropy(logits.view(-1, vocab), ids.view(-1))
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                if step < steps - 1:
                    # MemTracker tracks one iteration's module stats at a time (its docstring's
                    # example resets them after the first); the peak is kept.
                    tracker.reset_mod_stats()
        peak = tracker.get_tracker_snapshot("peak")
    peak_bytes = {str(dev): stats.get("Total", 0) for dev, stats in peak.items()}
    return {"device": device, "peak_bytes": peak_bytes}


def oomkit_command(case: str) -> list[str]:
    name, batch, seq, steps = CASES[case]
    return [
        sys.executable, "-m", "oomkit", "predict", name, "--gpu", "h100",
        "--batch", str(batch), "--seq", str(seq), "--steps", str(steps),
        "--precision", "fp32", "--optimizer", "adamw", "--json",
    ]  # fmt: skip


def timed(command: list[str], env: dict[str, str] | None = None) -> tuple[float, float, str]:
    """Wall and CPU seconds of one child process, start to exit; its stdout."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode not in (0, 1):  # predict exits 1 when the step would not fit
        sys.stderr.write(done.stderr)
        raise SystemExit(f"{command[:5]} exited {done.returncode}")
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return wall, cpu, done.stdout


def machine() -> dict[str, Any]:
    import torch

    return {
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "cores": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument(
        "--repeat", type=int, default=2, help="rounds of cold, warm and MemTracker, alternating"
    )
    parser.add_argument("--memtracker-child", choices=list(CASES), help=argparse.SUPPRESS)
    parser.add_argument("--write", help="also write the JSON line here")
    args = parser.parse_args()
    if args.memtracker_child:
        print(json.dumps(memtracker_child(args.memtracker_child)))
        return 0
    results: dict[str, Any] = {}
    tools = ("oomkit_cold", "oomkit_warm", "memtracker")
    for case in args.cases:
        runs: dict[str, list[tuple[float, float]]] = {tool: [] for tool in tools}
        memtracker_out = cold_out = ""
        identical = True
        for _ in range(args.repeat):
            with tempfile.TemporaryDirectory(prefix="oomkit-cache-") as cache:
                env = {**os.environ, "OOMKIT_CACHE_DIR": cache}
                env.pop("OOMKIT_NO_CACHE", None)
                wall, cpu, cold_out = timed(oomkit_command(case), env)
                runs["oomkit_cold"].append((wall, cpu))
                wall, cpu, warm_out = timed(oomkit_command(case), env)
                runs["oomkit_warm"].append((wall, cpu))
                identical = identical and warm_out == cold_out
            memtracker = [sys.executable, __file__, "--memtracker-child", case]
            wall, cpu, memtracker_out = timed(memtracker)
            runs["memtracker"].append((wall, cpu))
        row: dict[str, Any] = {}
        for tool, figures in runs.items():
            row[tool] = {
                "wall_s": round(statistics.median(w for w, _ in figures), 2),
                "cpu_s": round(statistics.median(c for _, c in figures), 2),
                "runs": [[round(w, 2), round(c, 2)] for w, c in figures],
            }
        for which in ("cold", "warm"):
            mine = row[f"oomkit_{which}"]
            row[f"ratio_{which}_wall"] = round(row["memtracker"]["wall_s"] / mine["wall_s"], 2)
            row[f"ratio_{which}_cpu"] = round(row["memtracker"]["cpu_s"] / mine["cpu_s"], 2)
        row["warm_json_identical_to_cold"] = identical
        tracked = json.loads(memtracker_out.strip().splitlines()[-1])
        row["memtracker_device"] = tracked["device"]
        row["memtracker_peak_bytes"] = tracked["peak_bytes"]
        predicted = json.loads(cold_out)
        row["oomkit_peak_allocated_bytes"] = predicted.get("peak_allocated_bytes")
        results[case] = row
        fake = "" if tracked["device"] == "cuda" else " (MemTracker on fake CPU tensors: no CUDA)"
        mt, cold, warm = row["memtracker"], row["oomkit_cold"], row["oomkit_warm"]
        print(
            f"{case}: MemTracker {mt['wall_s']} s wall / {mt['cpu_s']} s CPU{fake}\n"
            f"  oomkit cold (empty cache: records) {cold['wall_s']} s / {cold['cpu_s']} s: "
            f"MemTracker / oomkit = {row['ratio_cold_wall']}x wall, {row['ratio_cold_cpu']}x CPU\n"
            f"  oomkit warm (cache hit: replays)   {warm['wall_s']} s / {warm['cpu_s']} s: "
            f"MemTracker / oomkit = {row['ratio_warm_wall']}x wall, {row['ratio_warm_cpu']}x CPU"
            f"; --json identical to cold: {identical}",
            flush=True,
        )
    target = 10.0
    for which in ("warm", "cold"):
        met = [
            case for case, row in results.items()
            if row[f"ratio_{which}_wall"] >= target and row[f"ratio_{which}_cpu"] >= target
        ]  # fmt: skip
        print(f"{target:g}x on wall and CPU, oomkit {which}: {len(met)} of {len(results)} cases")
    line = json.dumps({"cases": results, "target_ratio": target, "machine": machine()})
    print(line)
    if args.write:
        with open(args.write, "w", encoding="utf-8") as out:
            out.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

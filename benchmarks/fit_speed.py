"""What a `fit` search costs next to its first probe, with the meta-kernel memo and without.

`oomkit fit gpt2-124m --gpu h100` (seq 1024, bf16-mixed, AdamW, 2 steps a probe, the default
margin) is run as ``oomkit.plan.batch_search.max_batch_size`` with the preset builder, in a child
process per setting so that each starts cold (torch imported, nothing remembered):
- ``memo``: as shipped: the meta-kernel memo (prediction/tracing/meta_memo.py) is shared by
  the probes, so a probe re-runs no meta kernel an earlier one ran on the same shapes (the
  optimizer's ops on the parameters, every op of a layer after the first);
- ``plain``: the memo turned off (``SHARED_MEMO.enabled = False``): every op's kernel runs.
Each probe is timed by the CPU time (``time.process_time``) between the search's progress
callbacks; on a shared machine CPU time is the figure that does not move with the load. The
search's answer is checked to be the same with and without the memo.

Prints a line per setting, then, last, one JSON line:
{"settings": {"memo": {"probes": [...], "first_probe_cpu_s": ..., "search_cpu_s": ...,
 "batch_size": ...}, "plain": {...}}, "machine": {...}}
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

PRESET, SEQ, GPU = "gpt2-124m", 1024, "h100"


def run_setting(memo: bool) -> dict:
    """One search in this process; its per-probe CPU seconds and its answer."""
    import torch
    import torch._dynamo  # noqa: F401  (imported by torch on first use: not a probe's cost)

    from oomkit.plan.batch_search import max_batch_size
    from oomkit.prediction.models import StepOptions, build_preset_step
    from oomkit.prediction.tracing.meta_memo import SHARED_MEMO

    del torch
    SHARED_MEMO.enabled = memo
    laps: list[float] = []
    mark = [time.process_time()]

    def progress(done: int, total: int) -> None:
        now = time.process_time()
        laps.append(now - mark[0])
        mark[0] = now

    def build(batch_size: int) -> object:
        options = StepOptions(batch_size=batch_size, seq_len=SEQ, precision="bf16-mixed",
                              optimizer="adamw")
        return build_preset_step(PRESET, options)

    start_cpu, start_wall = time.process_time(), time.perf_counter()
    result = max_batch_size(build, gpu=GPU, steps=2, progress=progress)
    return {
        "batch_size": result.batch_size,
        "probes": [round(lap, 2) for lap in laps],
        "sizes": list(result.probe_order),
        "first_probe_cpu_s": round(laps[0], 2) if laps else None,
        "search_cpu_s": round(time.process_time() - start_cpu, 2),
        "search_wall_s": round(time.perf_counter() - start_wall, 2),
        "memo_hits": SHARED_MEMO.hits,
        "memo_misses": SHARED_MEMO.misses,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setting", choices=("memo", "plain"), help="run one here (internal)")
    parser.add_argument("--write", metavar="PATH", help="also write the JSON result to PATH")
    args = parser.parse_args()
    if args.setting:
        print(json.dumps(run_setting(args.setting == "memo")))
        return 0
    state = {"cpus": os.cpu_count(), "load_average_1m": round(os.getloadavg()[0], 2)}
    settings = {}
    for setting in ("memo", "plain"):
        proc = subprocess.run([sys.executable, __file__, "--setting", setting],
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr)
            return proc.returncode
        result = settings[setting] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{setting:>5}: batch {result['batch_size']} after {len(result['probes'])} probes "
              f"({result['sizes']}): first probe {result['first_probe_cpu_s']:.2f} s CPU, whole "
              f"search {result['search_cpu_s']:.2f} s CPU ({result['search_wall_s']:.2f} s wall)")
    if settings["memo"]["batch_size"] != settings["plain"]["batch_size"]:
        print("the memo changed the answer", file=sys.stderr)
        return 1
    state["load_average_1m_after"] = round(os.getloadavg()[0], 2)
    line = json.dumps({"settings": settings, "machine": state})
    print(line)
    if args.write:
        with open(args.write, "w", encoding="utf-8") as out:
            out.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

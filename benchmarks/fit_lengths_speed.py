"""What `oomkit fit --lengths` costs with and without interpolating recordings across batches.

`oomkit fit gpt2-124m --lengths FILE --gpu rtx4090 --precision bf16-mixed` over a run of 200
steps whose lengths are drawn (seed 0) from 64, 96, ..., 1024 (31 distinct lengths; a dataset
bucketed by 32), run as ``oomkit.plan.envelope_fit.max_batch_for_run`` with the CLI's recorder,
in a child process per setting so that each starts cold:
- ``parallel``: as `oomkit fit` runs a preset: ``interpolated``, with the lengths a probe traces
  traced in forked processes at once, one per CPU core (``jobs=None``);
- ``interpolated``: a length's recordings at other batches synthesized from two
  traced ones, the answers traced at every length to confirm (plan/envelope_fit.py), in one
  process (``jobs=1``);
- ``traced``: ``interpolate=False``, every length traced at every batch tried.
Each is timed in CPU seconds (``time.process_time``, plus the forked processes' as ``os.times``
counts reaped children; on a shared machine the figure that moves least with the load) and
wall seconds, with the recordings traced and synthesized. ``--only`` runs some settings. The answer
and every probe's worst step are checked to be the same in both.

Prints a line per setting, then one JSON line: {"settings": {"interpolated": {...}, "traced":
{...}}, "machine": {...}}.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

from _children import ChildFailed, emit, run_child

SETTINGS = ("parallel", "interpolated", "traced")
STEPS = 200
LENGTHS = tuple(range(64, 1025, 32))


def run_setting(setting: str) -> dict:
    """One search in this process."""
    import torch._dynamo  # noqa: F401  (imported by torch on first use: not the search's cost)

    from oomkit.plan.envelope_fit import max_batch_for_run
    from oomkit.scenario import Scenario, scenario_target
    from oomkit.scenario.lengths import length_recorder

    rng = random.Random(0)
    lengths = [rng.choice(LENGTHS) for _ in range(STEPS)]
    scenario = Scenario(
        model={"preset": "gpt2-124m"},
        step={"precision": "bf16-mixed"},
        target={"gpu": "rtx4090"},
        lengths={"file": "-"},
    )
    target = scenario_target(scenario)
    record_at = length_recorder(scenario, target, [])
    start_cpu, start_wall = time.process_time(), time.perf_counter()
    start_children = _children_cpu_s()
    found = max_batch_for_run(
        lambda batch, length: record_at(batch, length)[0],
        lengths,
        target,
        max_length=1024,
        interpolate=setting != "traced",
        jobs=None if setting == "parallel" else 1,
    )
    children_cpu_s = _children_cpu_s() - start_children
    return {
        "batch_size": found.batch_size,
        "probes": [[p.batch_size, p.fits, p.worst_peak_reserved_bytes] for p in found.probes],
        "traces": found.traces,
        "synthesized": found.synthesized,
        "distinct_lengths": len(set(lengths)),
        "cpu_s": round(time.process_time() - start_cpu + children_cpu_s, 2),
        "children_cpu_s": round(children_cpu_s, 2),
        "wall_s": round(time.perf_counter() - start_wall, 2),
    }


def _children_cpu_s() -> float:
    """CPU seconds of the forked processes this one has reaped (user and system)."""
    times = os.times()
    return times.children_user + times.children_system


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setting", choices=SETTINGS, help="run one here (internal)")
    parser.add_argument("--write", metavar="PATH", help="also write the JSON result to PATH")
    parser.add_argument("--only", nargs="+", choices=SETTINGS, help="run these settings only")
    args = parser.parse_args()
    if args.setting:
        print(json.dumps(run_setting(args.setting)))
        return 0
    machine = {"cpus": os.cpu_count(), "load_average_1m": round(os.getloadavg()[0], 2)}
    settings = {}
    for setting in args.only or SETTINGS:
        try:
            result = settings[setting] = run_child(__file__, "--setting", setting)
        except ChildFailed as failed:
            return failed.returncode
        print(
            f"{setting:>12}: batch {result['batch_size']} after {len(result['probes'])} probes, "
            f"{result['traces']} recordings traced, {result['synthesized']} synthesized "
            f"({result['distinct_lengths']} lengths): {result['cpu_s']:.1f} s CPU (of it "
            f"{result['children_cpu_s']:.1f} s in forked processes), "
            f"{result['wall_s']:.1f} s wall (load average {os.getloadavg()[0]:.2f})"
        )
    first = next(iter(settings.values()))
    for name, other in settings.items():
        if (first["batch_size"], first["probes"]) != (other["batch_size"], other["probes"]):
            print(f"{name} changed the answer or a probe's worst step", file=sys.stderr)
            return 1
    machine["load_average_1m_after"] = round(os.getloadavg()[0], 2)
    emit({"settings": settings, "machine": machine}, args.write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

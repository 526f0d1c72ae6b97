"""Replay speed of the simulator on a 1,000,000-event training-like trace.

Prints a line per setting, then, last, one JSON line:
{"events": N, "events_per_second": {"default": ..., "expandable_segments:True": ...},
 "peak_rss_mb": ...}

Targets (issue 2, on a 2-core machine): >= 500,000 events/s for the default setting, and peak
process memory under 500 MB.
"""

from __future__ import annotations

import argparse
import itertools
import json
import resource
import sys
import time

from oomkit.core.allocator import AllocatorConfig
from oomkit.core.replay import simulate_events
from oomkit.core.workloads import TrainingWorkload, training_events

SETTINGS = {"default": "", "expandable_segments:True": "expandable_segments:True"}


def peak_rss_mb() -> float:
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=1, help="best of N runs per setting")
    args = parser.parse_args()

    # Enough steps for the requested number of events, then cut to exactly that many.
    workload = TrainingWorkload(steps=10_000, seed=1)
    events = list(itertools.islice(training_events(workload), args.events))
    rates = {}
    for label, setting in SETTINGS.items():
        config = AllocatorConfig.parse(setting)
        best = float("inf")
        for _ in range(args.repeat):
            start = time.perf_counter()
            result = simulate_events(events, config)
            best = min(best, time.perf_counter() - start)
        rates[label] = round(len(events) / best)
        print(
            f"{label:>26}: {len(events):,} events in {best:.2f} s = {rates[label]:,} events/s; "
            f"peak reserved {result.peak_reserved_bytes / 2**30:.2f} GiB",
            file=sys.stdout,
        )
    print(json.dumps({"events": len(events), "events_per_second": rates, "peak_rss_mb": round(peak_rss_mb(), 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

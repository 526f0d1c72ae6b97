"""What a ~100-candidate `oomkit plan` costs on the local fork pool and on a 2-worker Ray cluster.

One process plans the same request twice: on ``LocalPoolExecutor()`` (one forked process per
core, what ``oomkit plan`` runs by default), then on ``RayExecutor()`` over a local Ray cluster
started here with 2 CPUs (``ray.init(num_cpus=2)``; its start-up is timed apart). It checks the
two plans are equal and reports the wall seconds of each, their ratio, and the plan's pruning:
how many layouts were enumerated, pruned by state bytes, and predicted in full.

Default request: gpt2-124m, global batch 8, seq 64, on RTX 3080 and L4, up to 4 GPUs, micro-batch
at most 2, AC none/full, bf16-mixed/bf16: 96 layouts (``--preset``, ``--gpus``... to change it;
``--preset gpt2-1.5b`` prunes 44 of them by state bytes, and took 1151 s on the local pool of a
loaded 2-core machine). Its state fits every GPU, so the pruning is also counted, without
predicting, at scale: llama3-70b, global batch 1024, seq 8192, H100 / A100 80GB / L40S, up to
512 GPUs (``pruning_at_scale``). State of the machine (cores, load average before and after)
beside the figures.

Prints a line per executor, then, last, one JSON line:
{"enumerated": ..., "pruned": ..., "predicted": ..., "local_s": ..., "ray_s": ...,
 "ray_start_s": ..., "ray_over_local": ..., "equal": true, "machine": {...}}
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from _children import emit

from oomkit.executors import InProcessExecutor, LocalPoolExecutor, RayExecutor
from oomkit.scenario.planning import PlanRequest, plan


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2-124m")
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--gpus", default="rtx3080,l4")
    parser.add_argument("--max-gpus", type=int, default=4)
    parser.add_argument("--max-micro-batch", type=int, default=2)
    parser.add_argument("--ray-cpus", type=int, default=2)
    parser.add_argument("--write", default=None, metavar="FILE", help="also write the JSON line")
    args = parser.parse_args()
    request = PlanRequest(
        args.preset, args.global_batch, args.seq, tuple(args.gpus.split(",")),
        max_gpus=args.max_gpus, checkpointing=("none", "full"),
        precisions=("bf16-mixed", "bf16"), max_micro_batch=args.max_micro_batch,
    )
    at_scale = plan(
        PlanRequest("llama3-70b", 1024, 8192, ("h100", "a100-80gb", "l40s"), max_gpus=512),
        InProcessExecutor(),
        predictor=lambda data: {"peak_reserved_bytes": 0, "fits": True, "headroom_bytes": 0},
    )
    load_before = os.getloadavg()
    start = time.perf_counter()
    local = plan(request, LocalPoolExecutor())
    local_s = time.perf_counter() - start
    print(f"local pool ({os.cpu_count()} cores): {local_s:.1f} s", file=sys.stderr)

    import ray

    start = time.perf_counter()
    ray.init(num_cpus=args.ray_cpus, include_dashboard=False, log_to_driver=False)
    ray_start_s = time.perf_counter() - start
    try:
        start = time.perf_counter()
        on_ray = plan(request, RayExecutor())
        ray_s = time.perf_counter() - start
    finally:
        ray.shutdown()
    print(f"ray ({args.ray_cpus} workers): {ray_s:.1f} s (+{ray_start_s:.1f} s start)", file=sys.stderr)
    emit({
        "request": {"preset": args.preset, "global_batch": args.global_batch, "seq": args.seq,
                    "gpus": args.gpus, "max_gpus": args.max_gpus},
        "enumerated": len(local.candidates),
        "pruned": local.pruned,
        "predicted": local.predicted,
        "local_s": round(local_s, 2),
        "ray_s": round(ray_s, 2),
        "ray_start_s": round(ray_start_s, 2),
        "ray_over_local": round(ray_s / local_s, 3),
        "equal": on_ray == local,
        "pruning_at_scale": {"request": "llama3-70b, global batch 1024, seq 8192, "
                             "h100/a100-80gb/l40s, up to 512 GPUs",
                             "enumerated": len(at_scale.candidates), "pruned": at_scale.pruned,
                             "to_predict": at_scale.predicted},
        "machine": {"cores": os.cpu_count(), "load_before": load_before,
                    "load_after": os.getloadavg()},
    }, args.write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

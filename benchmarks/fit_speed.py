"""What a `fit` search costs next to its first probe: with interpolation, the model and meta-kernel caches, and without.

`oomkit fit gpt2-124m --gpu h100` (seq 1024, bf16-mixed, AdamW, 2 steps a probe, the default
margin; ``--case llama-8b-lora``: Llama 3.1 8B, seq 2048, LoRA r 16; ``--case llama-1b``: Llama 3.2 1B,
seq 2048, every weight trained) is run as ``oomkit.plan.batch_search.max_batch_size`` with the preset builder, in a child
process per setting so that each starts cold (torch imported, nothing remembered):
- ``parallel``: as `oomkit fit` runs a preset: ``interpolated``, with the sizes the search traces
  next traced ahead in forked processes, one per CPU core (``max_batch_size(jobs=None)``): the
  second size it learns from beside the first, the sizes its answer rests on beside each other;
- ``interpolated``: the caches below, and most sizes not traced at all: once two
  traced sizes recorded one structure with sizes affine in the batch, the recordings of other
  sizes are synthesized and replayed (plan/trace_interpolation.py), and the answer and the size
  above it are traced to confirm them; one process (``jobs=1``, the Python API's default);
- ``cached``: ``interpolate=False``, every size traced; the search builds the model once and its
  probes share it (prediction/models/model_cache.py), and they share the meta-kernel memo
  (prediction/tracing/meta_memo.py), so a probe re-runs no meta kernel an earlier one ran on the
  same shapes (the optimizer's ops on the parameters, every op of a layer after the first);
- ``memo-only``: the memo, but a model built afresh for every probe (the model cache off);
- ``plain``: neither: every probe builds its model and runs every op's kernel.
Each probe is timed by the CPU time (``time.process_time``) between the search's progress
callbacks; on a shared machine CPU time is the figure that does not move with the load. The
whole search is timed in wall seconds too, and with ``parallel`` the CPU seconds of the forked
processes (``os.times`` of the reaped children) are added to the search's CPU time; the wall
ratio "search / first probe" is what a user waits for, the CPU ratio what the search costs. Where a
probe's time goes is split into ``build`` (the builder: the model under ``torch.device("meta")``,
of it ``model`` the model alone, found in the cache or built, and the optimizer and inputs),
``trace`` (recording the 2 steps, the CUDA emulations included), ``replay`` (the simulated
allocator), ``synthesize`` and ``learn`` (the interpolation: making a recording, and taking in a
traced one with its structure), summed over the probes after the first; ``traces`` and ``synthesized`` count the
recordings traced and synthesized. The search's answer, and every probe's peaks, are checked to be
the same in every setting.

This times the search inside one warm process; ``fit_cli_speed.py`` times the command a user
runs, start-up and shut-down included, with its first probe and a `predict` of one size.

Prints a line per setting with the ratio "search / first probe", then, last, one JSON line:
{"settings": {"interpolated": {"probes": [...], "traces": ..., "synthesized": ...,
 "first_probe_cpu_s": ..., "search_cpu_s": ..., "search_over_first_probe": ..., "later_probes_cpu_s": {"build": ..., "model": ..., ...},
 "batch_size": ...}, "cached": {...}, "memo-only": {...}, "plain": {...}},
 "machine": {...}}
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from typing import Any

from _children import ChildFailed, emit, run_child

# --case: (preset, seq, GPU, LoRA rank or None). The default is `oomkit fit gpt2-124m --gpu h100`;
# `llama-8b-lora` is `oomkit fit llama-8b --seq 2048 --lora 16 --gpu h100`, whose build
# (peft wrapping every attention projection) costs more than GPT-2's; `llama-1b` is `oomkit fit
# llama-1b --gpu h100` (seq 2048, every weight trained), whose embedding backward changes path
# between the two sizes learned first (2,048 indices at batch 1, 4,096 at batch 2).
CASES = {
    "gpt2": ("gpt2-124m", 1024, "h100", None),
    "llama-8b-lora": ("llama-8b", 2048, "h100", 16),
    "llama-1b": ("llama-1b", 2048, "h100", None),
}


SETTINGS = ("parallel", "interpolated", "cached", "memo-only", "plain")


def run_setting(setting: str, case: str, jobs: int | None = None) -> dict:
    """One search in this process; its per-probe CPU seconds, where they went, and its answer."""
    import torch
    import torch._dynamo  # noqa: F401  (imported by torch on first use: not a probe's cost)

    import oomkit.plan.batch_probe as batch_probe
    import oomkit.plan.batch_prober as batch_prober
    import oomkit.plan.trace_interpolation as interpolation
    import oomkit.prediction.models.presets as presets
    import oomkit.prediction.tracing as tracing
    from oomkit.core.target import Target
    from oomkit.plan.batch_search import max_batch_size
    from oomkit.prediction.models import StepOptions, build_preset_step
    from oomkit.prediction.models.lora_options import LoraOptions
    from oomkit.prediction.tracing.meta_memo import SHARED_MEMO

    del torch
    preset, seq, gpu, rank = CASES[case]
    SHARED_MEMO.enabled = setting != "plain"
    if setting in ("memo-only", "plain"):  # a probe finds no cache and builds its own model
        batch_prober.new_model_cache = lambda: None  # type: ignore[attr-defined]
    laps: list[float] = []
    wall_laps: list[float] = []
    phases: list[dict[str, float]] = [{}]
    mark = [time.process_time(), time.perf_counter()]

    def progress(done: int, total: int) -> None:
        now, wall = time.process_time(), time.perf_counter()
        laps.append(now - mark[0])
        wall_laps.append(wall - mark[1])
        mark[:] = [now, wall]
        phases.append({})

    def timed(name: str, fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                part = phases[-1]
                part[name] = part.get(name, 0.0) + time.process_time() - start

        return run

    presets.cached_model = timed("model", presets.cached_model)  # type: ignore[attr-defined]
    tracing.trace_step = timed("trace", tracing.trace_step)  # type: ignore[attr-defined]
    batch_probe.predict_recording = timed("replay", batch_probe.predict_recording)  # type: ignore[attr-defined]
    batch_prober.predict_recording = timed("replay", batch_prober.predict_recording)  # type: ignore[attr-defined]
    interpolator = interpolation.TraceInterpolator
    interpolator.synthesize = timed("synthesize", interpolator.synthesize)  # type: ignore[method-assign]
    interpolator.add = timed("learn", interpolator.add)  # type: ignore[method-assign]

    def build(batch_size: int) -> object:
        options = StepOptions(batch_size=batch_size, seq_len=seq, precision="bf16-mixed",
                              optimizer="adamw", lora=None if rank is None else LoraOptions(r=rank))
        return build_preset_step(preset, options)

    start_cpu, start_wall = time.process_time(), time.perf_counter()
    start_children = _children_cpu_s()
    mark[:] = [start_cpu, start_wall]
    result = max_batch_size(timed("build", build), target=Target.resolve(gpu), steps=2, progress=progress,
                            interpolate=setting in ("interpolated", "parallel"),
                            jobs=jobs if setting == "parallel" else 1)
    search_wall_s = time.perf_counter() - start_wall
    # A process stopped at the end of the search (the background one, unused) is left to exit
    # and reaped later: wait for it here, so its CPU seconds are counted.
    for child in multiprocessing.active_children():
        child.join()
    children_cpu_s = _children_cpu_s() - start_children
    search_cpu_s = time.process_time() - start_cpu + children_cpu_s
    later = {name: round(sum(p.get(name, 0.0) for p in phases[1:-1]), 2)
             for name in ("build", "model", "trace", "replay", "synthesize", "learn")}
    return {
        "batch_size": result.batch_size,
        "probes": [round(lap, 2) for lap in laps],
        "sizes": list(result.probe_order),
        "traces": result.traces,
        "synthesized": result.synthesized,
        "peaks": [[p.batch_size, p.peak_allocated_bytes, p.peak_reserved_bytes]
                  for p in result.curve],
        "first_probe_cpu_s": round(laps[0], 2) if laps else None,
        "search_cpu_s": round(search_cpu_s, 2),
        "search_over_first_probe": round(search_cpu_s / laps[0], 2) if laps else None,
        "children_cpu_s": round(children_cpu_s, 2),
        "unused_ahead": result.unused_ahead,
        "first_probe_wall_s": round(wall_laps[0], 2) if wall_laps else None,
        "search_wall_s": round(search_wall_s, 2),
        "search_wall_over_first_probe": round(search_wall_s / wall_laps[0], 2) if wall_laps else None,
        "later_probes_cpu_s": later,
        "memo_hits": SHARED_MEMO.hits,
        "memo_misses": SHARED_MEMO.misses,
    }


def _children_cpu_s() -> float:
    """CPU seconds of the forked processes this one has reaped (user and system)."""
    times = os.times()
    return times.children_user + times.children_system


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", choices=tuple(CASES), default="gpt2", help="what to search")
    parser.add_argument("--setting", choices=SETTINGS, help="run one here (internal)")
    parser.add_argument("--write", metavar="PATH", help="also write the JSON result to PATH")
    parser.add_argument("--settings", default=",".join(SETTINGS),
                        help="which settings to run, comma-separated (default: all)")
    parser.add_argument("--jobs", type=int, default=None,
                        help="processes of the parallel setting (default: one per CPU core; the "
                        "size a second search would trace first is traced in the background "
                        "beside them)")
    args = parser.parse_args()
    if args.setting:
        print(json.dumps(run_setting(args.setting, args.case, args.jobs)))
        return 0
    chosen = [name.strip() for name in args.settings.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in SETTINGS]
    if unknown or not chosen:
        parser.error(f"--settings: choose from {', '.join(SETTINGS)}; got {args.settings!r}")
    state = {"cpus": os.cpu_count(), "load_average_1m": round(os.getloadavg()[0], 2),
             "case": args.case, "parallel_jobs": args.jobs}
    settings = {}
    for setting in chosen:
        extra = () if args.jobs is None else ("--jobs", str(args.jobs))
        try:
            result = settings[setting] = run_child(
                __file__, "--setting", setting, "--case", args.case, *extra
            )
        except ChildFailed as failed:
            return failed.returncode
        later = result["later_probes_cpu_s"]
        print(f"{setting:>12}: batch {result['batch_size']} after {len(result['sizes'])} sizes "
              f"({result['sizes']}; {result['traces']} traced, {result['synthesized']} "
              f"synthesized): first probe {result['first_probe_cpu_s']:.2f} s CPU, whole "
              f"search {result['search_cpu_s']:.2f} s CPU, of it {result['children_cpu_s']:.2f} s "
              f"in forked processes ({result['search_wall_s']:.2f} s wall); search / first "
              f"probe {result['search_over_first_probe']:.1f} CPU, "
              f"{result['search_wall_over_first_probe']:.1f} wall; probes "
              f"after the first: build {later['build']:.2f} s (model {later['model']:.2f}), "
              f"trace {later['trace']:.2f} s, replay {later['replay']:.2f} s, synthesize "
              f"{later['synthesize']:.2f} s, learn {later['learn']:.2f} s "
              f"(load average {os.getloadavg()[0]:.2f})")
    reference = next(iter(settings.values()))
    for setting, result in settings.items():
        if (result["batch_size"], result["peaks"]) != (reference["batch_size"], reference["peaks"]):
            print(f"{setting} changed the answer or a probe's peaks", file=sys.stderr)
            return 1
    state["load_average_1m_after"] = round(os.getloadavg()[0], 2)
    emit({"settings": settings, "machine": state}, args.write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

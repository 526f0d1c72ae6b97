"""Time, where it goes, and peak process memory of `oomkit predict` on built-in workloads.

Each case runs in its own child process, so its peak RSS (``ru_maxrss``) is its own:
- GPT-2 124M training step, batch 8, seq 1024 (target: < 2 s, issue 19 item 6; < 2 GB);
- Llama-8B-shaped training step, batch 1, seq 2048 (target: < 60 s, < 2 GB);
- the same with LoRA r=16 on peft's default targets (q_proj, v_proj) (target: < 60 s, < 2 GB);
- QLoRA: the same LoRA on nf4 base weights with double quantization (target: < 60 s, < 2 GB);
- Llama-3.1-8B training step, batch 1, seq 8192 (target: < 20 s, issue 19 item 6; < 2 GB);
- the same LoRA on int8 base weights (bitsandbytes Linear8bitLt) (target: < 60 s, < 2 GB).
All record 3 steps (the CLI default), bf16-mixed with AdamW, on an H100 SXM.
Sharded cases (SHARDED_CASES, rank 0 recorded on a fake process group, as `oomkit predict
--fsdp N`; ``--sharded-only`` runs them alone) report wall and CPU seconds:
- Llama-3.1-8B FSDP2 over 8 ranks, per-rank batch 2, seq 8192, selective-op activation
  checkpointing (target: < 60 s, < 2 GB).
- Llama-3.1-70B FSDP2 over 32 ranks x TP 8 (rank 0 of 256), per-rank batch 1, seq 8192,
  selective-op activation checkpointing (target: < 3 minutes, < 2 GB).

``seconds`` is what `oomkit predict` costs once torch is imported: build + trace + replay
(``predict()`` itself, run as its parts: ``trace_step`` then ``predict_recording``, the same
calls with the same arguments). Each phase is timed both by the wall clock and by the process's
CPU time (``time.process_time``): on a shared machine the CPU time is the figure that does not
move with the load. The phases:
- ``import``: importing torch (with torch._dynamo, which torch imports on the first call of a
  dynamo-disabled function, i.e. while building any model) and oomkit's predictor: paid once
  per process, and not in ``seconds``;
- ``build``: the model, optimizer and inputs on the meta device;
- ``trace``: running the steps under the recorder (meta kernels, storage accounting, frames),
  less ``emulation``;
- ``emulation``: inside the CUDA emulation hooks (workspaces, SDPA, autocast casts; the hooked
  op's own meta kernel included);
- ``replay``: building the trace and replaying it through the simulated allocator
  (``predict_recording``).
The child's whole CPU time (``process_cpu_s``, imports included) is read with ``getrusage``.

Prints a line per case, then, last, one JSON line:
{"cases": {"gpt2-124m": {"seconds": ..., "cpu_seconds": ..., "phases": {...},
 "peak_rss_mb": ..., "events": ..., ...}, ...}, "targets": {...}, "machine": {...}}
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import subprocess
import sys
import time
from typing import Any

# name -> (preset, batch, seq, target seconds, target peak RSS in MB)
CASES = {
    "gpt2-124m": ("gpt2-124m", 8, 1024, 2.0, 2000.0),
    "llama-8b": ("llama-8b", 1, 2048, 60.0, 2000.0),
    "llama-8b-lora": ("llama-8b", 1, 2048, 60.0, 2000.0),
    "llama-8b-qlora": ("llama-8b", 1, 2048, 60.0, 2000.0),
    # issue 19 item 6: Llama-3.1-8B at a long context.
    "llama-3.1-8b-seq8192": ("llama-8b", 1, 8192, 20.0, 2000.0),
    "llama-8b-int8-lora": ("llama-8b", 1, 2048, 60.0, 2000.0),
}
# name -> LoRA rank, for the cases that train adapters (peft) instead of the whole model.
LORA_RANKS = {"llama-8b-lora": 16, "llama-8b-qlora": 16, "llama-8b-int8-lora": 16}
# name -> quantized base weights (bitsandbytes nf4 with double quantization, or int8; emulated).
QUANTIZED: dict[str, dict[str, object]] = {
    "llama-8b-qlora": {"quantize": "nf4", "double_quant": True},
    "llama-8b-int8-lora": {"quantize": "int8"},
}
# name -> (preset, per-rank batch, seq, (FSDP, TP) ranks, checkpointing, target s, target RSS MB)
SHARDED_CASES = {
    "llama-8b-fsdp8-seq8192": ("llama-8b", 2, 8192, (8, 1), "selective-op", 60.0, 2000.0),
    "llama3-70b-fsdp32-tp8": ("llama3-70b", 1, 8192, (32, 8), "selective-op", 180.0, 2000.0),
}
GPU = "h100"
PRECISION = "bf16-mixed"
STEPS = 3


def peak_rss_mb() -> float:
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class _Clock:
    """Wall and CPU seconds of named phases."""

    def __init__(self) -> None:
        self.phases: dict[str, dict[str, float]] = {}
        self._mark = (time.perf_counter(), time.process_time())

    def lap(self, name: str) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        self.phases[name] = {"wall_s": wall - self._mark[0], "cpu_s": cpu - self._mark[1]}
        self._mark = (wall, cpu)


class _TimedHooks(dict):
    """The emulation hooks, each timed (the outermost call only: a hook's op may run another)."""

    def __init__(self, hooks: Any) -> None:
        super().__init__({name: self._timed(hooks[name]) for name in hooks})
        self.wall_s = 0.0
        self.cpu_s = 0.0
        self._depth = 0

    def _timed(self, hook: Any) -> Any:
        def timed(ctx: Any) -> Any:
            if self._depth:
                return hook(ctx)
            self._depth += 1
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                return hook(ctx)
            finally:
                self.wall_s += time.perf_counter() - wall
                self.cpu_s += time.process_time() - cpu
                self._depth -= 1

        return timed


def run_case(name: str) -> dict:
    """Build, record and predict one case in this process; return its figures."""
    clock = _Clock()
    import torch
    import torch._dynamo  # noqa: F401  (torch imports it on first use: building any model)

    from oomkit.core.target import Target
    from oomkit.prediction import predict_recording
    from oomkit.prediction.models import StepOptions, build_preset_step
    from oomkit.prediction.models.lora_options import LoraOptions
    from oomkit.prediction.tracing import trace_step
    from oomkit.prediction.tracing.emulation import DEFAULT_EMULATIONS

    clock.lap("import")
    preset, batch, seq, _, _ = CASES[name]
    lora = LoraOptions(r=LORA_RANKS[name]) if name in LORA_RANKS else None
    start = time.perf_counter(), time.process_time()
    quantize = QUANTIZED.get(name, {})
    options = StepOptions(
        batch_size=batch,
        seq_len=seq,
        precision=PRECISION,
        optimizer="adamw",
        lora=lora,
        **quantize,
    )
    built = build_preset_step(preset, options)
    clock.lap("build")
    # predict(built.step_fn, gpu=GPU, steps=STEPS, track=built.track), as its two parts.
    target = Target.resolve(GPU)
    hooks = _TimedHooks(DEFAULT_EMULATIONS)
    recording = trace_step(
        lambda *_: built.step_fn(),
        *built.track,
        steps=STEPS,
        target=target,
        emulations=hooks,
        require_allocations=True,
    )
    clock.lap("trace")
    p = predict_recording(recording, target=target)
    clock.lap("replay")
    trace = clock.phases["trace"]
    clock.phases["emulation"] = {"wall_s": hooks.wall_s, "cpu_s": hooks.cpu_s}
    clock.phases["trace"] = {
        "wall_s": trace["wall_s"] - hooks.wall_s,
        "cpu_s": trace["cpu_s"] - hooks.cpu_s,
    }
    seconds = time.perf_counter() - start[0]
    cpu_seconds = time.process_time() - start[1]
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "seconds": round(seconds, 2),
        "cpu_seconds": round(cpu_seconds, 2),
        "phases": {
            phase: {key: round(value, 3) for key, value in figures.items()}
            for phase, figures in clock.phases.items()
        },
        "process_cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "events": p.events,
        "peak_allocated_bytes": p.peak_allocated_bytes,
        "peak_reserved_bytes": p.peak_reserved_bytes,
        "fits": p.fits,
    }


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_sharded_case(name: str) -> dict:
    """Record rank 0 of a sharded case on a fake process group and predict it, in this process."""
    from oomkit.core.target import ParallelLayout, Target
    from oomkit.prediction.models import StepOptions
    from oomkit.prediction.models.parallel import build_fsdp_preset_step
    from oomkit.prediction.predictor import predict_recording
    from oomkit.prediction.tracing.distributed import trace_distributed_step

    preset, batch, seq, ranks, checkpointing, _, _ = SHARDED_CASES[name]
    start, cpu_start = time.perf_counter(), cpu_seconds()
    options = StepOptions(
        batch_size=batch, seq_len=seq, precision=PRECISION, checkpointing=checkpointing
    )
    layout = ParallelLayout(fsdp=ranks[0], tp=ranks[1])
    target = dataclasses.replace(Target.resolve(gpu=GPU), parallel=layout)

    def build(mesh):
        built = build_fsdp_preset_step(preset, options, mesh)
        return built.step_fn, tuple(built.track)

    recording = trace_distributed_step(
        build, world_size=layout.world_size, mesh_shape=layout.mesh_shape, steps=STEPS,
        target=target,
    )
    p = predict_recording(recording, target=target)
    return {
        "seconds": round(time.perf_counter() - start, 2),
        "cpu_seconds": round(cpu_seconds() - cpu_start, 2),
        # The machine's 1-minute load average at the end: wall time on a shared machine.
        "load_average": round(os.getloadavg()[0], 2),
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "events": p.events,
        "peak_allocated_bytes": p.peak_allocated_bytes,
        "peak_reserved_bytes": p.peak_reserved_bytes,
        "fits": p.fits,
    }


def _run_sharded_cases(results: dict) -> int:
    for name, (_, batch, seq, ranks, ckpt, target_s, target_mb) in SHARDED_CASES.items():
        proc = subprocess.run(
            [sys.executable, __file__, "--case", name], capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr)
            return proc.returncode
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        results[name] = result
        ok = result["seconds"] < target_s and result["peak_rss_mb"] < target_mb
        ways = f"FSDP2 x{ranks[0]}" + (f" x TP {ranks[1]}" if ranks[1] > 1 else "")
        print(
            f"{name:>14} ({ways}, batch {batch}/rank, seq {seq}, {ckpt} checkpointing, "
            f"{PRECISION}, {STEPS} steps on {GPU}, rank 0): {result['seconds']:.2f} s "
            f"({result['cpu_seconds']:.2f} s CPU, load {result['load_average']:.1f}), peak RSS {result['peak_rss_mb']:.0f} MB, "
            f"{result['events']:,} events, peak reserved "
            f"{result['peak_reserved_bytes'] / 2**30:.2f} GiB "
            f"({'within' if ok else 'OVER'} target {target_s:.0f} s / {target_mb:.0f} MB)"
        )
    return 0


def machine() -> dict:
    """The machine the figures were taken on, with its load when the run started."""
    return {
        "cpus": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
    }


def _phase_line(phases: dict[str, dict[str, float]]) -> str:
    return ", ".join(
        f"{name} {figures['cpu_s']:.2f}" for name, figures in phases.items() if name != "import"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--case", choices=sorted([*CASES, *SHARDED_CASES]), help="run one case here (internal)"
    )
    parser.add_argument("--sharded-only", action="store_true", help="run the SHARDED_CASES only")
    parser.add_argument(
        "--only", nargs="+", choices=sorted(CASES), metavar="CASE", help="run these cases only"
    )
    parser.add_argument("--write", metavar="PATH", help="also write the JSON result to PATH")
    args = parser.parse_args()
    if args.case:
        run = run_sharded_case if args.case in SHARDED_CASES else run_case
        print(json.dumps(run(args.case)))
        return 0
    results: dict = {}
    state = machine()
    for name, (_, batch, seq, target_s, target_mb) in CASES.items():
        if args.sharded_only or (args.only and name not in args.only):
            continue
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        proc = subprocess.run(
            [sys.executable, __file__, "--case", name], capture_output=True, text=True, check=False
        )
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr)
            return proc.returncode
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        # The child's CPU time as its parent sees it (RUSAGE_CHILDREN): imports included.
        result["child_cpu_s"] = round(
            after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, 2
        )
        results[name] = result
        # Judged by CPU time: the wall clock moves with whatever else the machine runs.
        ok = result["cpu_seconds"] < target_s and result["peak_rss_mb"] < target_mb
        print(
            f"{name:>20} (batch {batch}, seq {seq}, {PRECISION}, {STEPS} steps on {GPU}): "
            f"{result['cpu_seconds']:.2f} s CPU ({result['seconds']:.2f} s wall; "
            f"{_phase_line(result['phases'])}; import "
            f"{result['phases']['import']['cpu_s']:.2f} more), "
            f"peak RSS {result['peak_rss_mb']:.0f} MB, {result['events']:,} events, peak "
            f"reserved {result['peak_reserved_bytes'] / 2**30:.2f} GiB "
            f"({'within' if ok else 'OVER'} target {target_s:.0f} s / {target_mb:.0f} MB)"
        )
    if not args.only:
        code = _run_sharded_cases(results)
        if code:
            return code
    targets = {name: {"seconds": c[3], "peak_rss_mb": c[4]} for name, c in CASES.items()}
    targets |= {n: {"seconds": c[5], "peak_rss_mb": c[6]} for n, c in SHARDED_CASES.items()}
    state["load_average_1m_after"] = round(os.getloadavg()[0], 2)
    line = json.dumps({"cases": results, "targets": targets, "machine": state})
    print(line)
    if args.write:
        with open(args.write, "w", encoding="utf-8") as out:
            out.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

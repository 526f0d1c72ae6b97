"""Wall time and peak process memory of `oomkit predict` on two built-in workloads.

Each case runs in its own child process, so its peak RSS (``ru_maxrss``) is its own:
- GPT-2 124M training step, batch 8, seq 1024 (target: < 5 s, < 2 GB);
- Llama-8B-shaped training step, batch 1, seq 2048 (target: < 60 s, < 2 GB);
- the same with LoRA r=16 on peft's default targets (q_proj, v_proj) (target: < 60 s, < 2 GB);
- QLoRA: the same LoRA on nf4 base weights with double quantization (target: < 60 s, < 2 GB);
- the same LoRA on int8 base weights (bitsandbytes Linear8bitLt) (target: < 60 s, < 2 GB).
Both record 3 steps (the CLI default), bf16-mixed with AdamW, on an H100 SXM.
Sharded cases (SHARDED_CASES, rank 0 recorded on a fake process group, as `oomkit predict
--fsdp N`) also report CPU seconds:
- Llama-3.1-8B FSDP2 over 8 ranks, per-rank batch 2, seq 8192, selective-op activation
  checkpointing (target: < 60 s, < 2 GB).
- Llama-3.1-70B FSDP2 over 32 ranks x TP 8 (rank 0 of 256), per-rank batch 1, seq 8192,
  selective-op activation checkpointing (target: < 3 minutes, < 2 GB).

Prints a line per case, then, last, one JSON line:
{"cases": {"gpt2-124m": {"seconds": ..., "peak_rss_mb": ..., "events": ..., ...}, ...},
 "targets": {...}}
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import time

# name -> (preset, batch, seq, target seconds, target peak RSS in MB)
CASES = {
    "gpt2-124m": ("gpt2-124m", 8, 1024, 5.0, 2000.0),
    "llama-8b": ("llama-8b", 1, 2048, 60.0, 2000.0),
    "llama-8b-lora": ("llama-8b", 1, 2048, 60.0, 2000.0),
    "llama-8b-qlora": ("llama-8b", 1, 2048, 60.0, 2000.0),
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


def run_case(name: str) -> dict:
    """Build, record and predict one case in this process; return its figures."""
    from oomkit.prediction import predict
    from oomkit.prediction.models import StepOptions, build_preset_step
    from oomkit.prediction.models.lora_options import LoraOptions

    preset, batch, seq, _, _ = CASES[name]
    lora = LoraOptions(r=LORA_RANKS[name]) if name in LORA_RANKS else None
    start = time.perf_counter()
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
    p = predict(built.step_fn, gpu=GPU, steps=STEPS, track=built.track)
    seconds = time.perf_counter() - start
    return {
        "seconds": round(seconds, 2),
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--case", choices=sorted([*CASES, *SHARDED_CASES]), help="run one case here (internal)"
    )
    parser.add_argument(
        "--sharded-only", action="store_true", help="run the SHARDED_CASES only"
    )
    args = parser.parse_args()
    if args.case:
        run = run_sharded_case if args.case in SHARDED_CASES else run_case
        print(json.dumps(run(args.case)))
        return 0
    if args.sharded_only:
        results: dict = {}
        code = _run_sharded_cases(results)
        print(json.dumps({"cases": results}))
        return code
    results = {}
    for name, (_, batch, seq, target_s, target_mb) in CASES.items():
        proc = subprocess.run(
            [sys.executable, __file__, "--case", name], capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr)
            return proc.returncode
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        results[name] = result
        ok = result["seconds"] < target_s and result["peak_rss_mb"] < target_mb
        print(
            f"{name:>18} (batch {batch}, seq {seq}, {PRECISION}, {STEPS} steps on {GPU}): "
            f"{result['seconds']:.2f} s, peak RSS {result['peak_rss_mb']:.0f} MB, "
            f"{result['events']:,} events, peak reserved "
            f"{result['peak_reserved_bytes'] / 2**30:.2f} GiB "
            f"({'within' if ok else 'OVER'} target {target_s:.0f} s / {target_mb:.0f} MB)"
        )
    code = _run_sharded_cases(results)
    if code:
        return code
    targets = {name: {"seconds": c[3], "peak_rss_mb": c[4]} for name, c in CASES.items()}
    targets |= {n: {"seconds": c[5], "peak_rss_mb": c[6]} for n, c in SHARDED_CASES.items()}
    print(json.dumps({"cases": results, "targets": targets}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

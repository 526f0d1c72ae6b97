"""What ``oomkit.Monitor`` adds to a training step (issue 6 §1; target: under 1%).

A small MLP trains with AdamW; blocks of ``--steps`` steps run alternately without and with the
monitor (so drift and noise of a shared machine hit both alike), and the best per-step time
of each is compared. Monitor variants: in memory only, with a JSONL log, and ``every=10``.

1. **CPU, simulated device**: the step runs under ``SimulatedCudaDevice`` (oomkit's allocator
   accounts every storage), and the monitor reads the simulated ``memory_stats()``. The
   simulator itself slows the step (every storage goes through the simulated allocator), so the
   "off" time here is not a real CPU step's.
2. **CPU, real step**: the same loop on plain CPU, no simulator, so the step takes what it takes
   in PyTorch; the monitor reads a device whose ``memory_stats()`` hands back a copy of a fixed
   dict with the keys of ``torch.cuda.memory_stats()``: what is timed is the monitor's own cost
   (its bookkeeping, record and log line), against a real step.
3. **GPU** (when CUDA is available): the same loop on ``cuda`` with a wider MLP; the monitor
   reads ``torch.cuda.memory_stats()`` (and NVML in a thread when nvidia-ml-py is installed).

Prints a table per device and, last, one JSON line with every figure.
Run: ``python benchmarks/monitor_overhead.py [--steps 50] [--blocks 8]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from oomkit.runtime.monitor import Monitor
from oomkit.runtime.simulated import SimulatedCudaDevice


def _mlp_step(width: int, depth: int, batch: int, device: str) -> Callable[[], None]:
    """One AdamW training step of a seeded ``depth``-layer GELU MLP on a fixed random batch."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(batch, width, device=device)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    return step


def _block(
    step: Callable[[], None], steps: int, monitor: Monitor | None, sync: Callable[[], None]
) -> float:
    """Seconds per step over one block of ``steps`` steps."""
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
        if monitor is not None:
            monitor.step()
    sync()
    return (time.perf_counter() - start) / steps


def measure(
    step: Callable[[], None],
    *,
    steps: int,
    blocks: int,
    sync: Callable[[], None],
    make_monitors: dict[str, Callable[[], Monitor]],
) -> dict[str, float]:
    """Best seconds per step for "off" and each monitor variant, blocks interleaved."""
    for _ in range(3):
        step()  # warm-up: optimizer state, caches
    times: dict[str, list[float]] = {"off": [], **{name: [] for name in make_monitors}}
    monitors = {name: make() for name, make in make_monitors.items()}
    with contextlib.ExitStack() as stack:
        for monitor in monitors.values():
            stack.enter_context(monitor)
        for _ in range(blocks):
            times["off"].append(_block(step, steps, None, sync))
            for name, monitor in monitors.items():
                times[name].append(_block(step, steps, monitor, sync))
    # The best block of each: on a shared machine the other load only ever adds time.
    return {name: min(values) for name, values in times.items()}


def step_call_us(make: Callable[[], Monitor], calls: int = 2000) -> float:
    """Microseconds per ``Monitor.step()`` call alone (no training step between): the cost
    the monitor adds, measured without the noise of the training step around it."""
    with make() as monitor:
        monitor.step()
        start = time.perf_counter()
        for _ in range(calls):
            monitor.step()
        return (time.perf_counter() - start) / calls * 1e6


def _variants(tmp: Path) -> dict[str, Callable[[], Monitor]]:
    return {
        "monitor": lambda: Monitor(),
        "monitor+log": lambda: Monitor(log_path=tmp / "m.jsonl", keep_records=False),
        "monitor every=10": lambda: Monitor(every=10),
    }


def _print(title: str, measured: dict) -> dict:
    """Print a table; return the figures with the added fractions (timed and per call)."""
    result, calls = measured["seconds_per_step"], measured["step_call_us"]
    base = result["off"]
    print(title)
    print(f"{'variant':<18} {'ms/step':>9} {'added (timed)':>14} {'step() us':>10} {'= of step':>10}")
    added, per_call = {}, {}
    for name, seconds in result.items():
        added[name] = seconds / base - 1
        us = calls.get(name)
        line = f"{name:<18} {seconds * 1e3:>9.3f} {added[name] * 100:>13.2f}%"
        if us is not None:
            # every=10: nine of ten calls only count; the per-step cost is the mean over them.
            per_call[name] = us * 1e-6 / base
            line += f" {us:>10.1f} {per_call[name] * 100:>9.2f}%"
        print(line)
    print()
    return {**measured, "added_timed": added, "added_per_call": per_call}


def cpu_simulated(steps: int, blocks: int, width: int, batch: int) -> dict:
    with SimulatedCudaDevice("24GiB", context_overhead_bytes=0), tempfile.TemporaryDirectory() as t:
        step = _mlp_step(width, 4, batch, "cpu")
        result = measure(
            step, steps=steps, blocks=blocks, sync=lambda: None, make_monitors=_variants(Path(t))
        )
        calls = {name: step_call_us(make) for name, make in _variants(Path(t)).items()}
    return {"seconds_per_step": result, "step_call_us": calls}


class _FixedStatsDevice:
    """A ``DeviceMemory`` with fixed counters: reading it costs a dict copy, as little as a
    device can, so the monitor's own work is what is left to time."""

    name = "fixed counters (no device)"

    def __init__(self, stats: dict[str, int], total_bytes: int) -> None:
        self._stats = stats
        self._total_bytes = total_bytes

    def memory_stats(self) -> dict[str, int]:
        return dict(self._stats)

    def reset_peak_memory_stats(self) -> None:
        pass

    def mem_get_info(self) -> tuple[int, int]:
        return self._total_bytes - self._stats["reserved_bytes.all.current"], self._total_bytes


def _fixed_variants(tmp: Path, device: _FixedStatsDevice) -> dict[str, Callable[[], Monitor]]:
    return {
        "monitor": lambda: Monitor(device=device),
        "monitor+log": lambda: Monitor(device=device, log_path=tmp / "m.jsonl", keep_records=False),
        "monitor every=10": lambda: Monitor(device=device, every=10),
    }


def cpu_real(steps: int, blocks: int, width: int, batch: int) -> dict:
    """A real CPU step (no simulator); the monitor reads fixed counters (its own cost only)."""
    # The key set torch.cuda.memory_stats() returns, taken once from the simulated allocator.
    with SimulatedCudaDevice("24GiB", context_overhead_bytes=0) as simulated:
        stats = dict(simulated.memory_stats())
    device = _FixedStatsDevice(stats, 24 * 2**30)
    with tempfile.TemporaryDirectory() as t:
        step = _mlp_step(width, 4, batch, "cpu")
        variants = _fixed_variants(Path(t), device)
        result = measure(step, steps=steps, blocks=blocks, sync=lambda: None, make_monitors=variants)
        calls = {name: step_call_us(make) for name, make in variants.items()}
    return {"seconds_per_step": result, "step_call_us": calls, "stats_keys": len(stats)}


def gpu(steps: int, blocks: int, width: int, batch: int) -> dict:
    with tempfile.TemporaryDirectory() as t:
        step = _mlp_step(width, 8, batch, "cuda")
        result = measure(
            step,
            steps=steps,
            blocks=blocks,
            sync=torch.cuda.synchronize,
            make_monitors=_variants(Path(t)),
        )
        calls = {name: step_call_us(make) for name, make in _variants(Path(t)).items()}
    return {"seconds_per_step": result, "step_call_us": calls}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="steps per timed block")
    parser.add_argument("--blocks", type=int, default=8, help="blocks per variant")
    parser.add_argument("--cpu-width", type=int, default=512)
    parser.add_argument("--cpu-batch", type=int, default=64)
    parser.add_argument("--gpu-width", type=int, default=4096)
    parser.add_argument("--gpu-batch", type=int, default=256)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    out: dict = {"torch": torch.__version__}
    cpu = cpu_simulated(args.steps, args.blocks, args.cpu_width, args.cpu_batch)
    title = (
        f"CPU under SimulatedCudaDevice: MLP 4x{args.cpu_width}, batch {args.cpu_batch}, "
        f"{args.blocks} blocks of {args.steps} steps"
    )
    out["cpu_simulated"] = _print(title, cpu)
    real = cpu_real(args.steps, args.blocks, args.cpu_width, args.cpu_batch)
    title = (
        f"CPU, real step (no simulator; the monitor reads fixed counters): MLP "
        f"4x{args.cpu_width}, batch {args.cpu_batch}, {args.blocks} blocks of {args.steps} steps"
    )
    out["cpu_real"] = _print(title, real)
    if torch.cuda.is_available():
        result = gpu(args.steps, args.blocks, args.gpu_width, args.gpu_batch)
        title = (
            f"GPU {torch.cuda.get_device_name()}: MLP 8x{args.gpu_width}, batch "
            f"{args.gpu_batch}, {args.blocks} blocks of {args.steps} steps"
        )
        out["gpu"] = {"name": torch.cuda.get_device_name(), **_print(title, result)}
    sys.stdout.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

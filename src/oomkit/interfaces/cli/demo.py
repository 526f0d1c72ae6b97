"""``oomkit demo``: the built-in workload under the default settings and expandable segments."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from oomkit.interfaces.cli._common import (
    add_device_flags,
    add_json_flag,
    device_from_args,
    device_lines,
    device_to_json,
    print_json,
    stdout_console,
)

if TYPE_CHECKING:
    from oomkit.core.replay import ReplayResult

__all__ = ["add_parser", "run", "demo_verdict", "DEMO_SETTINGS"]

# The two settings the demo compares: PyTorch's default and the setting its own OOM message
# suggests against fragmentation (CUDACachingAllocator.cpp OOM message, ref §12).
DEMO_SETTINGS = ("", "expandable_segments:True")


# The allocator's limit without --gpu or --capacity: an 80 GB A100/H100, as before.
_DEFAULT_CAPACITY = "80GiB"

# The demo replays every step's events in this process: past this it would run for minutes.
_MAX_STEPS = 1_000


def _steps(text: str) -> int:
    """argparse type for --steps: a whole number of 1 to _MAX_STEPS (0 or -1 would replay
    nothing and report an empty workload as if it fitted)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number; got {text!r}") from None
    if not 1 <= value <= _MAX_STEPS:
        raise argparse.ArgumentTypeError(
            f"must be 1 to {_MAX_STEPS:,}; got {text[:40]!r}. Example: --steps 12"
        )
    return value


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "demo",
        help="replay the built-in training-like workload under two allocator settings",
        description="Replay oomkit's built-in, deterministic training-like workload (a "
        "transformer trained with AdamW on varying sequence lengths) under PyTorch's default "
        "allocator settings and under expandable_segments:True, and compare. No GPU needed.",
    )
    add_device_flags(parser, default_capacity=_DEFAULT_CAPACITY, what="replay at")
    parser.add_argument(
        "--steps",
        type=_steps,
        default=12,
        help=f"training steps, 1 to {_MAX_STEPS:,} (default 12)",
    )
    add_json_flag(parser)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from oomkit.core.allocator import AllocatorConfig
    from oomkit.core.replay import simulate_events
    from oomkit.core.workloads import TrainingWorkload, training_events
    from oomkit.interfaces.reports import comparison_table, replay_to_json

    device = device_from_args(args, default_capacity=_DEFAULT_CAPACITY)
    assert device is not None  # a default capacity
    workload = TrainingWorkload(steps=args.steps)
    results = []
    for setting in DEMO_SETTINGS:
        config = AllocatorConfig.parse(setting)
        result = simulate_events(
            training_events(workload),
            config,
            device.capacity_bytes,
            reserved_outside_bytes=device.context_overhead_bytes,
        )
        results.append((setting or "default", result))
    if args.json:
        print_json(
            {
                "workload": workload.__dict__,
                **device_to_json(device),
                "results": {label: replay_to_json(r, include_segments=False) for label, r in results},
            }
        )
        return 0
    console = stdout_console()
    (_, base), (_, expandable) = results
    console.print(
        f"Built-in workload: {workload.layers}-layer transformer, hidden {workload.hidden}, "
        f"batch {workload.batch}, {workload.steps} steps with sequence lengths "
        f"{workload.min_seq}-{workload.max_seq}."
    )
    for line in device_lines(device):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    console.print(comparison_table(results, title="Default vs expandable_segments:True"))
    console.print(demo_verdict(base, expandable))
    return 0


def demo_verdict(base: ReplayResult, expandable: ReplayResult) -> str:
    """One line on what ``expandable_segments:True`` changed: an OOM avoided (or not) first,
    then the peak reserved memory it saves (or costs)."""
    from oomkit.units import format_bytes

    setting = "expandable_segments:True"
    if base.oom and expandable.oom:
        return (
            f"Both settings run out of memory on this device: {setting} does not rescue it. "
            "Give a larger --gpu or --capacity, or fewer --steps."
        )
    if base.oom:
        return (
            f"The default settings run out of memory on this device and {setting} does not "
            f"(peak reserved {format_bytes(expandable.peak_reserved_bytes)}): "
            f"PYTORCH_CUDA_ALLOC_CONF={setting}"
        )
    if expandable.oom:
        return (
            f"{setting} runs out of memory on this device and the default settings do not "
            f"(peak reserved {format_bytes(base.peak_reserved_bytes)}): keep the default."
        )
    saving = base.peak_reserved_bytes - expandable.peak_reserved_bytes
    if saving > 0:
        return (
            f"{setting} reserves {format_bytes(saving)} less at peak "
            f"({100 * saving / base.peak_reserved_bytes:.1f}%): "
            f"PYTORCH_CUDA_ALLOC_CONF={setting}"
        )
    return f"{setting} does not lower peak reserved memory here."

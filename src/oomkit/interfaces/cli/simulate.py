"""``oomkit simulate TRACE``: replay an oomkit trace file under some allocator settings."""

from __future__ import annotations

import argparse

from oomkit.interfaces.cli._common import (
    add_alloc_conf_flag,
    add_device_flags,
    add_json_flag,
    add_torch_version_flag,
    config_from_args,
    device_from_args,
    device_lines,
    device_to_json,
    existing_file,
    print_json,
    stdout_console,
)

__all__ = ["add_parser", "run"]

# The allocator's limit without --gpu or --capacity: an 80 GB A100/H100, as before.
_DEFAULT_CAPACITY = "80GiB"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "simulate",
        help="replay an oomkit trace file through the simulated allocator",
        description="Replay an oomkit trace file (.jsonl or .jsonl.gz) through the simulated "
        "CUDA caching allocator. Exit code 1 when it would run out of memory.",
    )
    parser.add_argument("trace", type=existing_file, metavar="TRACE")
    add_alloc_conf_flag(parser)
    add_device_flags(parser, default_capacity=_DEFAULT_CAPACITY, what="simulate")
    add_torch_version_flag(parser, default="the trace's, else the newest release")
    add_json_flag(parser)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from oomkit.core.replay import simulate_events
    from oomkit.core.trace import read_trace
    from oomkit.interfaces.reports import render_replay, replay_to_json

    device = device_from_args(
        args, default_capacity=_DEFAULT_CAPACITY, torch_version=args.torch_version
    )
    assert device is not None  # a default capacity
    header, events = read_trace(args.trace)
    config = config_from_args(args)
    if config is None and header.allocator_settings:
        from oomkit.core.allocator import AllocatorConfig

        config = AllocatorConfig.parse(header.allocator_settings, torch_version=args.torch_version)
    result = simulate_events(
        events,
        config,
        capacity_bytes=device.capacity_bytes,
        torch_version=args.torch_version or header.torch_version,
        reserved_outside_bytes=device.context_overhead_bytes,
    )
    if args.json:
        print_json({**device_to_json(device), **replay_to_json(result)})
    else:
        console = stdout_console()
        for line in device_lines(device):
            console.print(line, markup=False, highlight=False, soft_wrap=True)
        render_replay(result, console, title=f"Simulated {args.trace.name}")
    return 1 if result.oom else 0

"""``oomkit simulate TRACE``: replay an oomkit trace file under some allocator settings."""

from __future__ import annotations

import argparse

from oomkit.interfaces.cli._common import (
    add_alloc_conf_flag,
    add_capacity_flag,
    add_json_flag,
    add_torch_version_flag,
    capacity_bytes,
    config_from_args,
    existing_file,
    print_json,
    stdout_console,
)

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "simulate",
        help="replay an oomkit trace file through the simulated allocator",
        description="Replay an oomkit trace file (.jsonl or .jsonl.gz) through the simulated "
        "CUDA caching allocator. Exit code 1 when it would run out of memory.",
    )
    parser.add_argument("trace", type=existing_file, metavar="TRACE")
    add_alloc_conf_flag(parser)
    add_capacity_flag(parser, default="80GiB")
    add_torch_version_flag(parser, default="the trace's, else the newest release")
    add_json_flag(parser)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from oomkit.core.replay import simulate_events
    from oomkit.core.trace import read_trace
    from oomkit.interfaces.reports import render_replay, replay_to_json

    capacity = capacity_bytes(args.gpu)
    header, events = read_trace(args.trace)
    config = config_from_args(args)
    if config is None and header.allocator_settings:
        from oomkit.core.allocator import AllocatorConfig

        config = AllocatorConfig.parse(header.allocator_settings, torch_version=args.torch_version)
    result = simulate_events(
        events,
        config,
        capacity_bytes=capacity,
        torch_version=args.torch_version or header.torch_version,
    )
    if args.json:
        print_json(replay_to_json(result))
    else:
        render_replay(result, stdout_console(), title=f"Simulated {args.trace.name}")
    return 1 if result.oom else 0

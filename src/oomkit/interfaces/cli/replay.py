"""``oomkit replay SNAPSHOT``: replay a PyTorch memory snapshot, verify it, or ask "what if"."""

from __future__ import annotations

import argparse

from oomkit.interfaces.cli._common import (
    add_alloc_conf_flags,
    add_json_flag,
    config_from_args,
    existing_file,
    print_json,
    stdout_console,
)

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "replay",
        help="replay a snapshot from torch.cuda.memory._dump_snapshot",
        description="Replay the allocation requests recorded in a PyTorch memory snapshot "
        "(torch.cuda.memory._record_memory_history + _dump_snapshot). With --verify, compare "
        "every recorded segment decision with the simulator's (exit 1 on a divergence). With "
        "--alloc-conf, replay the same requests under other settings (exit 1 if it would OOM "
        "at --capacity).",
    )
    parser.add_argument("snapshot", type=existing_file, metavar="SNAPSHOT")
    parser.add_argument("--device", type=int, default=None, help="device index (default: the first)")
    parser.add_argument(
        "--verify",
        action="store_true",
        help="check the simulator reproduces every recorded segment decision",
    )
    add_alloc_conf_flags(parser, capacity_default=None)
    add_json_flag(parser)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from oomkit.core.replay import replay_snapshot
    from oomkit.interfaces.reports import render_replay, replay_to_json
    from oomkit.core.snapshot import load_snapshot

    snapshot = load_snapshot(args.snapshot)
    devices = snapshot.devices()
    device = args.device if args.device is not None else (devices[0] if devices else 0)
    config = config_from_args(args)
    what_if = config is not None or args.capacity is not None
    result = replay_snapshot(
        snapshot,
        device,
        verify=not what_if,
        config=config,
        capacity_bytes=args.capacity,
        torch_version=args.torch_version,
    )
    if args.json:
        print_json(replay_to_json(result))
    else:
        title = f"What-if replay of {args.snapshot.name}" if what_if else f"Replay of {args.snapshot.name}"
        render_replay(result, stdout_console(), title=title)
    if what_if:
        return 1 if result.oom else 0
    if args.verify:
        reproduced = result.first_divergence is None and result.final_state_matches is not False
        return 0 if reproduced else 1
    return 0

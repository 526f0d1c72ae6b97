"""``oomkit replay SNAPSHOT``: replay a PyTorch memory snapshot, verify it, or ask "what if"."""

from __future__ import annotations

import argparse
import sys

from oomkit.errors import ConfigError
from oomkit.interfaces.cli._common import (
    Device,
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
from oomkit.interfaces.cli._progress import (
    add_jobs_flag,
    note_memory_cap,
    progress_bar,
    progress_enabled,
    snapshot_progress,
)

__all__ = ["EXIT_NOTHING_TO_VERIFY", "add_parser", "run"]

# --verify on a trace with no segment decision and no allocation: 0 of 0 is not a success.
EXIT_NOTHING_TO_VERIFY = 4


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "replay",
        help="replay a snapshot from torch.cuda.memory._dump_snapshot",
        description="Replay the allocation requests recorded in a PyTorch memory snapshot "
        "(torch.cuda.memory._record_memory_history + _dump_snapshot). With --verify, compare "
        "every recorded segment decision and block placement with the simulator's (exit 1 on a "
        "divergence, 4 when the trace holds nothing to compare; --gpu then sizes expandable "
        "reservations as on that device). With --alloc-conf, --gpu or --capacity "
        "alone, replay the same requests under other settings or on another device (exit 1 if "
        "it would OOM; default --capacity 80GiB). --gpu is the device, as in predict: the "
        "allocator may reserve its total less the CUDA context. --verify replays the recorded "
        "setting, so it cannot be combined with --alloc-conf (exit 2). --what-if SETTING, "
        "repeated, replays "
        "the same requests under each setting (in parallel, --jobs) and compares them in one "
        "table (exit 1 if any would OOM).",
    )
    parser.add_argument("snapshot", type=existing_file, metavar="SNAPSHOT")
    parser.add_argument("--device", type=int, default=None, help="device index (default: the first)")
    parser.add_argument(
        "--verify",
        action="store_true",
        help="check the simulator reproduces every recorded segment decision and block "
        "placement (exit 1: diverged, 4: nothing to verify)",
    )
    add_alloc_conf_flag(parser)
    parser.add_argument(
        "--what-if",
        action="append",
        default=None,
        metavar="SETTING",
        help="a PYTORCH_CUDA_ALLOC_CONF value to replay the trace under; repeat it to compare "
        "several settings side by side (use '' for the default setting)",
    )
    add_jobs_flag(parser, what="--what-if settings")
    add_device_flags(parser, default_capacity=None, what="replay at")
    add_torch_version_flag(parser, default="read from the snapshot")
    add_json_flag(parser)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from oomkit.core.replay import replay_snapshot
    from oomkit.core.snapshot import load_snapshot
    from oomkit.interfaces.reports.replay import render_replay, replay_to_json

    if args.verify and args.alloc_conf is not None:
        # replay_snapshot(verify=True) compares with the recording, made under its own setting.
        raise ConfigError(
            "--verify replays the snapshot under the setting it was recorded with, so it cannot "
            "take --alloc-conf. Run `oomkit replay SNAPSHOT --verify` to check the simulator, "
            "and `oomkit replay SNAPSHOT --alloc-conf ...` (no --verify) for the what-if."
        )
    if args.what_if is not None:
        return _run_what_ifs(args)
    named_device = device_from_args(args, torch_version=args.torch_version)
    capacity, outside = _limits(named_device)
    config = config_from_args(args)
    with snapshot_progress(progress_enabled(args, sys.stderr), args.snapshot.name) as progress:
        snapshot = load_snapshot(args.snapshot, progress=progress.loading)
        devices = snapshot.devices()
        device = args.device if args.device is not None else (devices[0] if devices else 0)
        what_if = not args.verify and (config is not None or named_device is not None)
        progress.phase(f"replaying {len(snapshot.trace_for(device)):,} events")
        result = replay_snapshot(
            snapshot,
            device,
            verify=not what_if,
            config=config,
            capacity_bytes=capacity,
            torch_version=args.torch_version,
            reserved_outside_bytes=outside,
        )
    if args.json:
        out = replay_to_json(result)
        # The device's keys only where one was named: a plain --verify prints what it did.
        print_json(out if named_device is None else {**device_to_json(named_device), **out})
    else:
        from oomkit.interfaces.reports._untrusted import as_written

        name = as_written(args.snapshot.name)  # printed as written: no markup, no escapes
        title = f"What-if replay of {name}" if what_if else f"Replay of {name}"
        console = stdout_console()
        for line in [] if named_device is None else device_lines(named_device):
            console.print(line, markup=False, highlight=False, soft_wrap=True)
        render_replay(result, console, title=title)
    if what_if:
        return 1 if result.oom else 0
    if args.verify:
        if result.verified is False:
            return EXIT_NOTHING_TO_VERIFY
        return 0 if result.reproduced else 1
    return 0


def _limits(named: Device | None) -> tuple[int | None, int]:
    """``replay_snapshot``'s capacity and memory outside the allocator for the device named
    (none: the recorded run's capacity, nothing outside)."""
    return (None, 0) if named is None else (named.capacity_bytes, named.context_overhead_bytes)


def _run_what_ifs(args: argparse.Namespace) -> int:
    """``--what-if A --what-if B ...``: one replay per setting, in parallel, in one table."""
    from oomkit.core.allocator import AllocatorConfig
    from oomkit.core.replay import replay_snapshot
    from oomkit.core.snapshot import load_snapshot
    from oomkit.executors import replay_settings
    from oomkit.interfaces.reports.replay import what_if_table, what_if_to_json

    if args.verify or args.alloc_conf is not None:
        raise ConfigError(
            "--what-if replays the trace under the settings it names, so it cannot take "
            f"{'--verify' if args.verify else '--alloc-conf'}. Give every setting with --what-if, "
            "e.g. `oomkit replay SNAPSHOT --what-if '' --what-if expandable_segments:True`."
        )
    # A setting given twice is replayed once (the same replay, in the order first given).
    texts = list(dict.fromkeys(text.strip() for text in args.what_if))
    # Parsed up front: a setting the modelled PyTorch rejects stops the command (exit 2)
    # before any replay runs.
    configs = [AllocatorConfig.parse(text, torch_version=args.torch_version) for text in texts]
    named_device = device_from_args(args, torch_version=args.torch_version)
    capacity, outside = _limits(named_device)
    with snapshot_progress(progress_enabled(args, sys.stderr), args.snapshot.name) as progress:
        snapshot = load_snapshot(args.snapshot, progress=progress.loading)
    devices = snapshot.devices()
    device = args.device if args.device is not None else (devices[0] if devices else 0)

    def replay(config: AllocatorConfig):
        # An explicit config is a what-if from the first request, as --alloc-conf.
        return replay_snapshot(
            snapshot,
            device,
            verify=False,
            config=config,
            capacity_bytes=capacity,
            torch_version=args.torch_version,
            reserved_outside_bytes=outside,
        )

    note_memory_cap(args.jobs, len(configs))
    with progress_bar(progress_enabled(args, sys.stderr), "replaying settings") as update:
        results = replay_settings(replay, configs, jobs=args.jobs, progress=update)
    rows = list(zip(texts, results, strict=True))
    if args.json:
        print_json(
            {
                "snapshot": args.snapshot.name,
                "device": device,
                **(device_to_json(named_device) if named_device else {"capacity_bytes": None}),
                "settings": what_if_to_json(rows),
            }
        )
    else:
        console = stdout_console()
        from oomkit.interfaces.reports._untrusted import as_written

        for line in [] if named_device is None else device_lines(named_device):
            console.print(line, markup=False, highlight=False, soft_wrap=True)
        title = f"What-if replays of {as_written(args.snapshot.name)}"
        console.print(what_if_table(rows, title=title))
        warnings = dict.fromkeys(w for _, r in rows for w in r.warnings)
        for warning in warnings:
            console.print(f"[yellow]warning:[/] {warning}")
    return 1 if any(r.oom for r in results) else 0

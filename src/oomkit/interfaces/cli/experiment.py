"""``oomkit experiment -- python train.py ARGS``: measure allocator settings on the real script.

The script runs once per ``PYTORCH_CUDA_ALLOC_CONF`` candidate (the caller's own setting first, as
the baseline) in a child Python under the monitor, for ``--steps`` optimizer steps; see
:mod:`oomkit.runtime.experiment`. Candidates come from ``--configs FILE`` (one per line, ``#``
comments), from ``--from-tune SNAPSHOT`` (the shortlist ``oomkit tune`` ranks best for that
snapshot), or a built-in three. With several GPUs visible (or named with ``--gpus``) the trials
run in parallel, one per GPU, each seeing only its GPU. Exit codes: 0 a trial completed (the recommendation is printed),
1 none did, 2 usage error.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from oomkit.errors import OomkitError
from oomkit.interfaces.cli._common import (
    add_json_flag,
    add_script_command,
    existing_file,
    float_arg,
    positive_int,
    print_json,
    stderr_console,
)

__all__ = ["FROM_TUNE_LIMIT", "add_parser", "run"]

# How many of `oomkit tune`'s recommendable settings --from-tune runs (each is a full trial).
FROM_TUNE_LIMIT = 4
_DEFAULT_STEPS = 20
_DEFAULT_TIMEOUT_S = 600.0


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "experiment",
        help="run a script once per PYTORCH_CUDA_ALLOC_CONF and compare peak memory and speed",
        description="Run a Python script unmodified once per allocator setting (your current "
        "PYTORCH_CUDA_ALLOC_CONF first, as the baseline), each in its own process, stopped after "
        "--steps optimizer steps. Measures peak reserved memory, fragmentation and steps/s per "
        "setting; trials that run out of memory, crash or hang (--timeout) are reported, not "
        "fatal. Recommends the lowest peak reserved among the settings at most 5%% slower than "
        "the baseline. With several GPUs visible the trials run in parallel, one per GPU "
        "(--gpus). Exits 0 when a trial completed, 1 when none did, 2 on a usage error.",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--configs",
        metavar="FILE",
        type=existing_file,
        help="settings to try, one PYTORCH_CUDA_ALLOC_CONF value per line (# comments)",
    )
    source.add_argument(
        "--from-tune",
        metavar="SNAPSHOT",
        type=existing_file,
        help=f"try the best {FROM_TUNE_LIMIT} settings `oomkit tune SNAPSHOT` finds "
        "(a snapshot or an oomkit trace)",
    )
    parser.add_argument(
        "--steps",
        metavar="N",
        type=positive_int,
        default=_DEFAULT_STEPS,
        help=f"optimizer steps per trial; the first is left out of steps/s (default {_DEFAULT_STEPS})",
    )
    parser.add_argument(
        "--timeout",
        metavar="S",
        type=_positive_float,
        default=_DEFAULT_TIMEOUT_S,
        help=f"seconds before a trial is killed (default {_DEFAULT_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--gpus",
        metavar="LIST",
        type=_gpu_list,
        default=None,
        help="GPUs to spread the trials over, one trial per GPU at a time, as "
        "CUDA_VISIBLE_DEVICES names them (0,1,2,3 or UUIDs); each trial sees only its GPU "
        "(default: every visible GPU; one GPU or none: one trial after another)",
    )
    add_json_flag(parser)
    add_script_command(parser)
    parser.set_defaults(run=run)
    return parser


def _positive_float(text: str) -> float:
    return float_arg(text, lambda seconds: seconds > 0, "must be a positive number of seconds")


def _gpu_list(text: str) -> tuple[str, ...]:
    gpus = tuple(part.strip() for part in text.split(","))
    if not all(gpus):
        raise argparse.ArgumentTypeError(
            f"must be GPUs separated by commas, e.g. 0,1; got {text!r}"
        )
    if len(set(gpus)) != len(gpus):
        raise argparse.ArgumentTypeError(f"names a GPU twice; got {text!r}")
    return gpus


def _from_tune(path: Path) -> list[str]:
    """The recommendable settings `oomkit tune PATH` ranks first, best first, the default left out."""
    from oomkit.interfaces.cli.tune import _DEFAULT_CAPACITY, _open_source
    from oomkit.plan import tune
    from oomkit.units import parse_bytes

    source, device, torch_version, _ = _open_source(path, None)
    result = tune(
        source, parse_bytes(_DEFAULT_CAPACITY), device=device, torch_version=torch_version
    )
    shortlist = [c.alloc_conf for c in result.candidates if c.recommendable and c.alloc_conf]
    return shortlist[:FROM_TUNE_LIMIT]


def _candidates(args: argparse.Namespace) -> list[str]:
    from oomkit.runtime.experiment import DEFAULT_CONFIGS, parse_configs

    if args.configs is not None:
        from oomkit._files import refuse_special_file

        refuse_special_file(args.configs, what="settings file")
        try:
            configs = parse_configs(Path(args.configs).read_text())
        except (OSError, UnicodeDecodeError) as exc:
            raise OomkitError(f"{args.configs}: cannot be read ({exc})") from exc
        if not configs:
            raise OomkitError(
                f"{args.configs} names no setting. Write one PYTORCH_CUDA_ALLOC_CONF value per "
                "line, e.g. expandable_segments:True"
            )
        return configs
    if args.from_tune is not None:
        configs = _from_tune(Path(args.from_tune))
        if not configs:
            stderr_console().print(
                f"oomkit: `oomkit tune {args.from_tune}` finds nothing better than the default; "
                "only the baseline runs"
            )
        return configs
    return list(DEFAULT_CONFIGS)


def run(args: argparse.Namespace) -> int:
    from oomkit.interfaces.cli.run import split_python_command
    from oomkit.interfaces.reports.experiment import experiment_to_json, render_experiment
    from oomkit.runtime.experiment import run_experiment

    python, options, target = split_python_command(list(args.script_command), by="experiment")
    configs = _candidates(args)
    console = stderr_console()

    def progress(index: int, total: int, alloc_conf: str) -> None:
        if not args.json:
            label = alloc_conf or "(default)"
            console.print(f"oomkit: trial {index + 1}/{total}: PYTORCH_CUDA_ALLOC_CONF={label}")

    result = run_experiment(
        python,
        target,
        configs,
        interpreter_options=options,
        steps=args.steps,
        timeout_s=args.timeout,
        progress=progress,
        gpus=args.gpus,
    )
    if args.json:
        print_json(experiment_to_json(result))
    else:
        from oomkit.interfaces.cli._common import stdout_console

        render_experiment(result, stdout_console())
    return 0 if result.recommended is not None else 1

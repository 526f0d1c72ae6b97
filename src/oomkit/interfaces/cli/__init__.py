"""The ``oomkit`` command line: one module per subcommand, each with ``add_parser`` and ``run``.

Exit codes (documented in the README):
    0  success (for predictions and what-ifs: it fits)
    1  the workload does not fit / would OOM / the check failed
    2  usage error or bad input (a clear one-line message on stderr)
    3  a feature needs something that is not installed (e.g. torch)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from oomkit.errors import OomkitError, TorchRequiredError

__all__ = ["main", "build_parser", "EXIT_OK", "EXIT_NO_FIT", "EXIT_USAGE", "EXIT_MISSING_DEPENDENCY"]

EXIT_OK = 0
EXIT_NO_FIT = 1
EXIT_USAGE = 2
EXIT_MISSING_DEPENDENCY = 3


def _subcommands() -> list:
    # Imported here so that `oomkit --help` stays fast and optional dependencies stay lazy.
    from oomkit.interfaces.cli import (
        demo,
        diff,
        doctor,
        experiment,
        explain,
        fit,
        gpus,
        predict,
        presets,
        replay,
        report,
        run,
        simulate,
        tune,
    )

    return [
        predict,
        explain,
        demo,
        replay,
        simulate,
        tune,
        run,
        fit,
        experiment,
        report,
        gpus,
        presets,
        doctor,
        diff,
    ]


def build_parser() -> argparse.ArgumentParser:
    """The root parser with every subcommand registered."""
    from oomkit._version import __version__

    parser = argparse.ArgumentParser(
        prog="oomkit",
        description="Predict, explain and prevent CUDA out-of-memory errors in PyTorch.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"oomkit {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in _subcommands():
        module.add_parser(subparsers)
    # No abbreviated flags: `experiment --gpu 0` must not quietly mean `--gpus 0`.
    for subparser in subparsers.choices.values():
        subparser.allow_abbrev = False
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI and return its exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return int(args.run(args))
    except TorchRequiredError as exc:
        print(f"oomkit: {exc}", file=sys.stderr)
        return EXIT_MISSING_DEPENDENCY
    except OomkitError as exc:
        print(f"oomkit: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("oomkit: interrupted", file=sys.stderr)
        return 130

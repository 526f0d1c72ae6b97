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
from importlib import import_module

from oomkit.errors import OomkitError, TorchRequiredError

__all__ = ["main", "build_parser", "EXIT_OK", "EXIT_NO_FIT", "EXIT_USAGE", "EXIT_MISSING_DEPENDENCY"]

EXIT_OK = 0
EXIT_NO_FIT = 1
EXIT_USAGE = 2
EXIT_MISSING_DEPENDENCY = 3


# The subcommands in help order, by module name under oomkit.interfaces.cli.
_COMMANDS = (
    "predict",
    "explain",
    "demo",
    "replay",
    "simulate",
    "tune",
    "run",
    "fit",
    "experiment",
    "report",
    "gpus",
    "presets",
    "doctor",
    "diff",
)


def _subcommands(only: str | None = None) -> list:
    # Imported here so that `oomkit --help` stays fast and optional dependencies stay lazy; with
    # ``only``, just that subcommand's module (issue 19 item 4: `oomkit replay FILE` does not
    # import the predictor that `fit` needs).
    names = _COMMANDS if only is None else (only,)
    return [import_module(f"oomkit.interfaces.cli.{name}") for name in names]


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The root parser with every subcommand registered (or just ``only``, a subcommand name)."""
    from oomkit._version import __version__

    parser = argparse.ArgumentParser(
        prog="oomkit",
        description="Predict, explain and prevent CUDA out-of-memory errors in PyTorch.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"oomkit {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in _subcommands(only):
        module.add_parser(subparsers)
    # No abbreviated flags: `experiment --gpu 0` must not quietly mean `--gpus 0`.
    for subparser in subparsers.choices.values():
        subparser.allow_abbrev = False
    return parser


def _command_named(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` runs, when its first word names one; None otherwise."""
    if argv and argv[0] in _COMMANDS:
        return argv[0]
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI and return its exit code."""
    words = list(sys.argv[1:] if argv is None else argv)
    # Only the named subcommand's parser is built (and its module imported); `oomkit`,
    # `oomkit --help` and unknown words get the full parser, which lists every subcommand.
    parser = build_parser(_command_named(words))
    args = parser.parse_args(words)
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

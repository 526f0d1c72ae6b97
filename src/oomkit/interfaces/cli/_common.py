"""Small helpers shared by the subcommands: consoles, size and setting arguments, JSON output."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console

from oomkit.errors import OomkitError
from oomkit.units import parse_bytes

__all__ = [
    "stdout_console",
    "stderr_console",
    "print_json",
    "size_arg",
    "existing_file",
    "add_json_flag",
    "add_script_command",
    "positive_int",
    "add_alloc_conf_flags",
    "config_from_args",
]


def stdout_console() -> Console:
    """The console for results (plain when not a terminal, so output pipes cleanly)."""
    return Console(file=sys.stdout, highlight=False, soft_wrap=False)


def stderr_console() -> Console:
    """The console for progress and hints."""
    return Console(file=sys.stderr, highlight=False)


def print_json(obj: object) -> None:
    """Print one JSON object on stdout."""
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def size_arg(text: str) -> int:
    """argparse type for sizes such as ``24GiB``."""
    try:
        return parse_bytes(text)
    except OomkitError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def existing_file(text: str) -> Path:
    """argparse type for an input file that must exist."""
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(
            f"{text}: no such file. Check the path (it is relative to {Path.cwd()})."
        )
    return path


def positive_int(text: str) -> int:
    """argparse type for a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number; got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1; got {value}")
    return value


def add_script_command(parser: argparse.ArgumentParser) -> None:
    """The ``-- python SCRIPT [ARGS...]`` tail of ``oomkit run`` and ``oomkit experiment``."""
    parser.add_argument(
        "script_command",
        nargs=argparse.REMAINDER,
        metavar="-- python SCRIPT [ARGS...]",
        help="the command to run: python script.py ARGS or python -m module ARGS",
    )


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object for scripts")


def add_alloc_conf_flags(parser: argparse.ArgumentParser, *, capacity_default: str | None) -> None:
    parser.add_argument(
        "--alloc-conf",
        metavar="STR",
        help="PYTORCH_CUDA_ALLOC_CONF value to simulate, e.g. expandable_segments:True",
    )
    parser.add_argument(
        "--capacity",
        metavar="SIZE",
        type=size_arg,
        default=None if capacity_default is None else parse_bytes(capacity_default),
        help="device memory, e.g. 24GiB"
        + ("" if capacity_default is None else f" (default {capacity_default})"),
    )
    parser.add_argument(
        "--torch-version",
        metavar="VER",
        help="model this PyTorch version's allocator (default: the newest release)",
    )


def config_from_args(args: argparse.Namespace):
    """The ``AllocatorConfig`` named by ``--alloc-conf`` (None when the flag is absent)."""
    from oomkit.core.allocator import AllocatorConfig

    if args.alloc_conf is None:
        return None
    return AllocatorConfig.parse(args.alloc_conf, torch_version=args.torch_version)

"""Small helpers shared by the subcommands: consoles, the shared flags, JSON output."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from oomkit.errors import ConfigError, OomkitError
from oomkit.units import SizeError, SizeTooLargeError, parse_bytes

__all__ = [
    "stdout_console",
    "output_width",
    "PIPE_WIDTH_COLUMNS",
    "stderr_console",
    "print_json",
    "user_output_to_stderr",
    "size_arg",
    "existing_file",
    "add_json_flag",
    "add_script_command",
    "positive_int",
    "float_arg",
    "add_alloc_conf_flag",
    "add_capacity_flag",
    "add_gpu_flag",
    "add_torch_version_flag",
    "torch_version_arg",
    "capacity_bytes",
    "capacity_from_args",
    "config_from_args",
]


if TYPE_CHECKING:
    from rich.console import Console


# The width of the results when stdout is not a terminal (a pipe, a file, a CI log). rich would
# take 80 columns there, wrapping tables and splitting setting names (`tune`'s
# "expandable_segments:True" came out in 9-character pieces); nothing the reports print is wider
# than this, so a pipe gets each table row and each sentence on one line.
PIPE_WIDTH_COLUMNS = 1000


def output_width(stream: object, environ: dict[str, str] | None = None) -> int | None:
    """The width to render results at on ``stream``: ``None`` (rich's own choice: the terminal's
    width, or ``$COLUMNS`` when set) on a terminal or when ``$COLUMNS`` is set, else
    ``PIPE_WIDTH_COLUMNS``."""
    env = os.environ if environ is None else environ
    isatty = getattr(stream, "isatty", None)
    if (isatty is not None and isatty()) or env.get("COLUMNS"):
        return None
    return PIPE_WIDTH_COLUMNS


def stdout_console() -> Console:
    """The console for results: plain and unwrapped when not a terminal, so output pipes
    cleanly (see ``PIPE_WIDTH_COLUMNS``)."""
    # rich is imported when something is rendered, not at start-up (--json never needs it).
    from rich.console import Console

    return Console(
        file=sys.stdout, highlight=False, soft_wrap=False, width=output_width(sys.stdout)
    )


def stderr_console() -> Console:
    """The console for progress and hints."""
    from rich.console import Console

    return Console(file=sys.stderr, highlight=False)


def user_output_to_stderr() -> contextlib.AbstractContextManager[object]:
    """While the user's code runs (import, builder, steps, script), its prints go to stderr:
    stdout is oomkit's (``--json`` stays one JSON object, a report one report), whatever the
    code prints while it builds (nanoGPT prints its parameter count)."""
    return contextlib.redirect_stdout(sys.stderr)


def print_json(obj: object) -> None:
    """Print one JSON object on stdout."""
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False) + "\n")


# A size without a unit is bytes; below this, it is almost surely a forgotten unit (`--capacity
# 24` meant 24 GiB, not 24 bytes), so it is refused (0 stays valid: `--margin 0`).
_MIN_UNITLESS_BYTES = 2**20


def _check_unit(text: str, size: int) -> None:
    """Refuse a bare number between 1 and 1 MiB - 1: ask for the unit it surely meant."""
    stripped = text.strip()
    if stripped.replace(".", "", 1).isdigit() and 0 < size < _MIN_UNITLESS_BYTES:
        raise SizeError(
            f"{text!r} has no unit, so it would mean {size} bytes; give the unit, e.g. "
            f"{stripped}GiB or {stripped}MiB (a number alone counts bytes only from 1048576 on)."
        )


def size_arg(text: str) -> int:
    """argparse type for sizes such as ``24GiB`` (a bare number below 1 MiB is refused)."""
    try:
        size = parse_bytes(text)
        _check_unit(text, size)
    except OomkitError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return size


def existing_file(text: str) -> Path:
    """argparse type for an input file that must exist."""
    path = Path(text)
    if not path.is_file():
        # The name as typed, its control characters shown (\x1b), never acted on by a terminal.
        shown = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)
        what = "is a directory, not a file" if path.is_dir() else "no such file"
        raise argparse.ArgumentTypeError(
            f"{shown}: {what}. Check the path (it is relative to {Path.cwd()})."
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


def float_arg(text: str, accepts: Callable[[float], bool], expected: str) -> float:
    """argparse type helper: ``text`` as a number that ``accepts`` admits.

    Text that is no number reads as NaN, which every range check refuses.

    Raises:
        argparse.ArgumentTypeError: ``"{expected}; got 'TEXT'"`` (a usage error, exit 2).
    """
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not accepts(value):
        raise argparse.ArgumentTypeError(f"{expected}; got {text!r}")
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


def add_gpu_flag(
    parser: argparse.ArgumentParser,
    *,
    default: str | None,
    help: str,
    capacity_alias: bool = False,
) -> None:
    """The one ``--gpu NAME|SIZE`` flag (dest ``gpu``, kept as text until the command reads it).

    Args:
        parser: the subcommand's parser.
        default: the GPU when the flag is absent (a name or a size; ``None``: none).
        help: what the GPU means to this command (a capacity, or usable memory).
        capacity_alias: also accept ``--capacity``, the name the replaying commands used first.
    """
    names = ("--gpu", "--capacity") if capacity_alias else ("--gpu",)
    parser.add_argument(*names, dest="gpu", default=default, metavar="NAME|SIZE", help=help)


def add_capacity_flag(parser: argparse.ArgumentParser, *, default: str | None) -> None:
    """``--gpu NAME|SIZE`` (alias ``--capacity``) for a command that replays at a capacity.

    The capacity is what ``cudaMemGetInfo`` reports as total, as ``explain SNAPSHOT --gpu``
    takes a catalog GPU's total memory: nothing is subtracted for the CUDA context (the replay
    models no memory outside PyTorch), unlike ``predict --gpu``, whose allocator may reserve
    only the total less ``--context-overhead``. See ``capacity_bytes``.
    """
    add_gpu_flag(
        parser,
        default=default,
        capacity_alias=True,
        help="the device to replay at: a catalog GPU (e.g. rtx4090; its total memory as "
        "cudaMemGetInfo reports it, nothing subtracted for the CUDA context) or a size (e.g. "
        "24GiB); --capacity is an alias"
        + ("" if default is None else f" (default {default})"),
    )


def add_alloc_conf_flag(parser: argparse.ArgumentParser) -> None:
    """The one ``--alloc-conf STR`` flag (dest ``alloc_conf``)."""
    parser.add_argument(
        "--alloc-conf",
        metavar="STR",
        help="PYTORCH_CUDA_ALLOC_CONF value to simulate, e.g. expandable_segments:True",
    )


def add_torch_version_flag(parser: argparse.ArgumentParser, *, default: str) -> None:
    """The one ``--torch-version X.Y`` flag (dest ``torch_version``).

    Args:
        parser: the subcommand's parser.
        default: what the command models without the flag, for the help text.
    """
    parser.add_argument(
        "--torch-version",
        metavar="X.Y",
        type=torch_version_arg,
        help=f"the PyTorch version whose allocator rules to model, e.g. 2.6 (default: {default})",
    )


def torch_version_arg(text: str) -> str:
    """argparse type for a PyTorch version (``2.6``, ``2.6.0+cu124``, ``nightly``), kept as text."""
    from oomkit.core.allocator.versions import parse_torch_version

    try:
        parse_torch_version(text)
    except OomkitError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return text


def capacity_bytes(text: str) -> int:
    """The device capacity ``--gpu``/``--capacity`` names, in bytes.

    A size (``24GiB``, or plain bytes from 1 MiB on) is taken as it is; a catalog GPU gives its
    total memory, what ``cudaMemGetInfo`` reports as total (``GpuSpec.total_memory_bytes``),
    CUDA context included.

    Raises:
        ConfigError: the size is zero, or a number without a unit below 1 MiB (``24``: surely
            24 GiB, not 24 bytes).
        UnknownGpuError: the text is neither a size nor a catalog GPU (the message lists near
            names).
    """
    try:
        size = parse_bytes(text)
    except SizeTooLargeError as exc:
        raise ConfigError(f"--gpu/--capacity: {exc}") from None
    except SizeError:
        from oomkit.core.gpus import get_gpu

        return get_gpu(text).total_memory_bytes
    try:
        _check_unit(text, size)
    except SizeError as exc:
        raise ConfigError(f"--gpu/--capacity {exc}") from None
    if size <= 0:
        raise ConfigError(
            f"the device capacity must be above zero; got {text!r}. Give a size such as 24GiB or "
            "a GPU name such as rtx4090."
        )
    return size


def capacity_from_args(args: argparse.Namespace) -> int | None:
    """The capacity ``--gpu`` names, in bytes (``None`` when the flag is absent, no default)."""
    return None if args.gpu is None else capacity_bytes(args.gpu)


def config_from_args(args: argparse.Namespace):
    """The ``AllocatorConfig`` named by ``--alloc-conf`` (None when the flag is absent)."""
    from oomkit.core.allocator import AllocatorConfig

    if args.alloc_conf is None:
        return None
    return AllocatorConfig.parse(args.alloc_conf, torch_version=args.torch_version)

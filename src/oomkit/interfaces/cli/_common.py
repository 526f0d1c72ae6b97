"""Small helpers shared by the subcommands: consoles, the shared flags, JSON output."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
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
    "add_device_flags",
    "add_gpu_flag",
    "add_torch_version_flag",
    "torch_version_arg",
    "capacity_bytes",
    "Device",
    "device_from_args",
    "device_lines",
    "device_to_json",
    "target_from_args",
    "config_from_args",
]


if TYPE_CHECKING:
    from rich.console import Console

    from oomkit.core.target import Target


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


# Both consoles print emoji codes as written (emoji=False): a file, frame or setting named
# `a:fire:b` is shown as it is (reports escape markup in what they read for the same reason), and
# rich's table of 4,000 emoji names is never imported (issue 41 item 4: start-up).
def stdout_console() -> Console:
    """The console for results: plain and unwrapped when not a terminal, so output pipes
    cleanly (see ``PIPE_WIDTH_COLUMNS``)."""
    # rich is imported when something is rendered, not at start-up (--json never needs it).
    from rich.console import Console

    return Console(
        file=sys.stdout,
        highlight=False,
        soft_wrap=False,
        width=output_width(sys.stdout),
        emoji=False,
    )


def stderr_console() -> Console:
    """The console for progress and hints."""
    from rich.console import Console

    return Console(file=sys.stderr, highlight=False, emoji=False)


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
    from oomkit._files import not_a_file_reason

    what = not_a_file_reason(text)
    if what is not None:
        # The name as typed, its control characters shown (\x1b), never acted on by a terminal.
        shown = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)
        raise argparse.ArgumentTypeError(
            f"{shown}: {what}. Pass a file; check the path (it is relative to {Path.cwd()})."
        )
    return Path(text)


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
        help="the command to run: python script.py ARGS, python -m module ARGS, or "
        "script.py -- ARGS (run by the Python that runs oomkit)",
    )


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object for scripts")


def add_gpu_flag(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    *,
    default: str | None,
    help: str,
) -> None:
    """The one ``--gpu NAME|SIZE`` flag (dest ``gpu``, kept as text until the command reads it).

    Args:
        parser: the subcommand's parser (or one of its groups).
        default: the GPU when the flag is absent (a name or a size; ``None``: none).
        help: what the GPU is to this command.
    """
    parser.add_argument("--gpu", dest="gpu", default=default, metavar="NAME|SIZE", help=help)


# --gpu's help wherever it names the device a command simulates (replay, simulate, tune, demo;
# predict and fit say the same through the Scenario's field).
_GPU_DEVICE_HELP = (
    "the device: a catalog GPU (e.g. rtx4090) or its total memory (e.g. 24GiB); the allocator "
    "may reserve the total less the CUDA context (the catalog's figure, a typical one for a "
    "size), as predict --gpu; --context-overhead 0 keeps the whole total"
)


def add_device_flags(
    parser: argparse.ArgumentParser, *, default_capacity: str | None, what: str
) -> None:
    """``--gpu NAME|SIZE``, ``--capacity SIZE`` and ``--context-overhead SIZE``: the device a
    replaying command simulates (``device_from_args`` reads them).

    ``--gpu`` is the device, as ``predict --gpu``: its total memory, of which the allocator may
    reserve all but the CUDA context (``Target.resolve``). ``--capacity`` is the allocator's
    own limit, nothing subtracted. One or the other, not both.

    Args:
        parser: the subcommand's parser.
        default_capacity: the ``--capacity`` without either flag (``None``: none, the
            command's own choice).
        what: what the device is used for, for the help (``"replay at"``).
    """
    group = parser.add_argument_group("device (--gpu or --capacity, not both)")
    add_gpu_flag(group, default=None, help=_GPU_DEVICE_HELP)
    group.add_argument(
        "--capacity",
        dest="capacity",
        default=None,
        metavar="SIZE",
        help=f"the allocator's own limit to {what}, e.g. 24GiB: what it may reserve, nothing "
        "subtracted for a CUDA context"
        + ("" if default_capacity is None else f" (default {default_capacity})"),
    )
    # predict and fit have it as a Scenario field (target.context_overhead_bytes).
    group.add_argument(
        "--context-overhead",
        dest="context_overhead",
        type=size_arg,
        metavar="SIZE",
        help="memory outside PyTorch on the --gpu device (default: the GPU's CUDA context); "
        "0 gives the allocator the whole total",
    )


def add_alloc_conf_flag(
    parser: argparse.ArgumentParser,
    help: str = "PYTORCH_CUDA_ALLOC_CONF value to simulate, e.g. expandable_segments:True",
) -> None:
    """The one ``--alloc-conf STR`` flag (dest ``alloc_conf``); ``help`` says what the command
    does with it."""
    parser.add_argument("--alloc-conf", metavar="STR", help=help)


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
    """argparse type for a PyTorch version (``2.6``, ``2.6.0+cu124``, ``nightly``), kept as text;
    one past main is refused (replay, tune, simulate, doctor: as predict's target)."""
    from oomkit.core.allocator.versions import require_modelled

    try:
        require_modelled(text)
    except OomkitError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return text


def capacity_bytes(text: str) -> int:
    """The allocator limit ``--capacity SIZE`` names, in bytes (nothing subtracted).

    A size (``24GiB``, or plain bytes from 1 MiB on) is taken as it is.

    Raises:
        ConfigError: the size is zero or too large, a number without a unit below 1 MiB
            (``24``: surely 24 GiB, not 24 bytes), or not a size at all (a GPU name: that is
            ``--gpu``).
    """
    try:
        size = parse_bytes(text)
    except SizeTooLargeError as exc:
        raise ConfigError(f"--capacity: {exc}") from None
    except SizeError:
        shown = text.strip()[:40]
        raise ConfigError(
            f"--capacity takes a size, the allocator's own limit (e.g. 24GiB); got {shown!r}. "
            "For a GPU, give it with --gpu instead: its total memory less the CUDA context."
        ) from None
    try:
        _check_unit(text, size)
    except SizeError as exc:
        raise ConfigError(f"--capacity {exc}") from None
    if size <= 0:
        raise ConfigError(
            f"the allocator's limit must be above zero; got {text!r}. Give a size such as "
            "--capacity 24GiB, or a GPU such as --gpu rtx4090."
        )
    return size


@dataclass(frozen=True)
class Device:
    """The device a replaying command simulates, as ``--gpu`` or ``--capacity`` named it.

    Attributes:
        capacity_bytes: the device's total memory (``cudaMemGetInfo`` total) for ``--gpu``;
            the allocator's limit itself for ``--capacity``.
        context_overhead_bytes: memory held outside the allocator (the CUDA context), left out
            of what it may reserve; 0 for ``--capacity``.
        target: the ``--gpu`` device resolved as predict resolves it; ``None`` for
            ``--capacity``.
    """

    capacity_bytes: int
    context_overhead_bytes: int = 0
    target: Target | None = None

    @property
    def usable_bytes(self) -> int:
        """What the allocator may reserve: the capacity less the context, in bytes."""
        return self.capacity_bytes - self.context_overhead_bytes


def target_from_args(args: argparse.Namespace, *, torch_version: str | None = None) -> Target:
    """The ``Target`` of ``--gpu`` (and ``--context-overhead``), by ``Target.resolve``: the
    resolution ``oomkit.scenario.target.target_of`` gives predict and fit, so a GPU gets the
    same CUDA context (figure and source) in every command.

    Args:
        args: the parsed flags (``gpu`` set; ``context_overhead`` in bytes or absent).
        torch_version: the PyTorch release modelled (``--torch-version``); ``None``: the
            installed torch's CUDA build sets the context, as predict's default.

    Raises:
        UnknownGpuError: ``--gpu`` is neither a catalog GPU nor a size with a unit.
        GpuSpecError: the context is not below the device's total (for a size, the message
            names ``--capacity``).
    """
    from oomkit.core.gpus import GpuSpecError
    from oomkit.core.target import Target

    overhead = getattr(args, "context_overhead", None)
    try:
        return Target.resolve(
            args.gpu, context_overhead_bytes=overhead, torch_version=torch_version
        )
    except GpuSpecError as exc:
        small = overhead is None and "context_overhead_bytes" in str(exc)
        if not small or not hasattr(args, "capacity"):  # the hint needs --capacity
            raise
        raise GpuSpecError(
            f"--gpu: {exc} To simulate an allocator limited to {args.gpu!r}, give it with "
            "--capacity instead (nothing subtracted), or give --context-overhead SIZE."
        ) from None


def device_from_args(
    args: argparse.Namespace,
    *,
    default_capacity: str | None = None,
    torch_version: str | None = None,
) -> Device | None:
    """The device ``--gpu`` / ``--capacity`` / ``--context-overhead`` name.

    Args:
        args: the parsed flags of ``add_device_flags``.
        default_capacity: the ``--capacity`` when neither flag is given (``None``: no device).
        torch_version: for ``--gpu``, the PyTorch release whose CUDA context to assume.

    Returns:
        The device; ``None`` when no flag is given and there is no default.

    Raises:
        ConfigError: ``--gpu`` and ``--capacity`` together, ``--context-overhead`` without
            ``--gpu``, or a bad ``--capacity``.
        UnknownGpuError: ``--gpu`` is neither a catalog GPU nor a size with a unit.
        GpuSpecError: ``--gpu``'s context is not below its total.
    """
    overhead = getattr(args, "context_overhead", None)
    if args.gpu is not None and args.capacity is not None:
        raise ConfigError(
            f"--gpu {args.gpu!r} and --capacity {args.capacity!r} both set the device: choose one. "
            "--gpu NAME|SIZE is the device, whose total less the CUDA context the allocator may "
            "reserve (as predict); --capacity SIZE is the allocator's own limit, nothing "
            "subtracted."
        )
    if overhead is not None and args.gpu is None:
        raise ConfigError(
            "--context-overhead is the memory outside PyTorch on the --gpu device: give --gpu "
            "NAME|SIZE with it (--capacity is the allocator's own limit, nothing subtracted)."
        )
    if args.gpu is not None:
        target = target_from_args(args, torch_version=torch_version)
        return Device(target.capacity_bytes, target.context_overhead_bytes, target)
    text = args.capacity if args.capacity is not None else default_capacity
    return None if text is None else Device(capacity_bytes(text))


def device_to_json(device: Device) -> dict[str, object]:
    """The device in a command's ``--json``, with predict's key names: ``gpu`` (the catalog
    name, ``None`` for ``--capacity``), ``capacity_bytes``, ``context_overhead_bytes``,
    ``usable_bytes`` (what the allocator may reserve) and ``cuda_context`` (the context
    assumed and its source, ``None`` for ``--capacity``)."""
    target = device.target
    return {
        "gpu": None if target is None else target.gpu.name,
        "capacity_bytes": device.capacity_bytes,
        "context_overhead_bytes": device.context_overhead_bytes,
        "usable_bytes": device.usable_bytes,
        "cuda_context": None if target is None else target.context_description,
    }


def device_lines(device: Device) -> list[str]:
    """The device in words, for a report's head: what the allocator may reserve and why."""
    from oomkit.units import format_bytes

    usable = format_bytes(device.usable_bytes)
    if device.target is None:
        return [f"Device: the allocator may reserve {usable} (--capacity: nothing subtracted)."]
    return [
        f"Device: {device.target.gpu.name} ({format_bytes(device.capacity_bytes)} total, "
        f"{format_bytes(device.context_overhead_bytes)} outside PyTorch): the allocator may "
        f"reserve {usable}.",
        f"CUDA context assumed: {device.target.context_description}",
    ]


def config_from_args(args: argparse.Namespace):
    """The ``AllocatorConfig`` named by ``--alloc-conf`` (None when the flag is absent)."""
    from oomkit.core.allocator import AllocatorConfig

    if args.alloc_conf is None:
        return None
    return AllocatorConfig.parse(args.alloc_conf, torch_version=args.torch_version)

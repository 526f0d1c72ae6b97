"""The ``oomkit`` command line: one module per subcommand, each with ``add_parser`` and ``run``.

Exit codes (documented in the README):
    0  success (for predictions and what-ifs: it fits)
    1  the workload does not fit / would OOM / the check failed
    2  usage error or bad input (a clear one-line message on stderr)
    3  a feature needs something that is not installed (e.g. torch)
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import gc
import os
import sys
from collections.abc import Sequence
from importlib import import_module
from typing import Any, NoReturn

from oomkit.errors import OomkitError, TorchRequiredError

__all__ = [
    "main",
    "console_main",
    "build_parser",
    "summary_parser",
    "EXIT_OK",
    "EXIT_NO_FIT",
    "EXIT_USAGE",
    "EXIT_MISSING_DEPENDENCY",
]

EXIT_OK = 0
EXIT_NO_FIT = 1
EXIT_USAGE = 2
EXIT_MISSING_DEPENDENCY = 3


# The subcommands in help order (module name under oomkit.interfaces.cli) with the one line
# `oomkit --help` lists for each. `oomkit` and `oomkit --help` list them from here without
# importing the fourteen modules (issue 19 item 4); tests/interfaces/cli/test_startup.py checks
# that each line is the one the module's own ``add_parser`` registers.
_SUMMARIES: dict[str, str] = {
    "predict": "predict a step's peak GPU memory on a named GPU, without a GPU",
    "explain": "explain an OOM error: its cause, the evidence and ranked remedies",
    "demo": "replay the built-in training-like workload under two allocator settings",
    "replay": "replay a snapshot from torch.cuda.memory._dump_snapshot",
    "simulate": "replay an oomkit trace file through the simulated allocator",
    "tune": "find the PYTORCH_CUDA_ALLOC_CONF that reserves least for a trace or snapshot",
    "run": "run a Python script with OOM snapshots and diagnosis: oomkit run -- python train.py",
    "fit": "find the largest batch that fits on a GPU, without a GPU",
    "experiment": "run a script once per PYTORCH_CUDA_ALLOC_CONF and compare peak memory and "
    "speed",
    "report": "summarise oomkit.Monitor logs: peaks, fragmentation, retries, OOMs per rank",
    "gpus": "list the GPUs --gpu can name, with their memory",
    "presets": "list the built-in models predict and fit take, with their defaults",
    "doctor": "show which allocator settings are in effect (environment or snapshot)",
    "diff": "split the change in peak memory between two runs into allocated and placement",
    "serve": "will vLLM / SGLang start with these flags, and with what KV cache (GPU-free)",
    "plan": "rank the layouts (GPU kind and count, FSDP/HSDP/DDP/TP, micro-batch, AC, "
    "precision) that fit a training job",
    "mcp": "serve predict, fit, explain, replay, tune, diff, doctor and gpus as MCP tools",
}
_COMMANDS = tuple(_SUMMARIES)
# `oomkit --help` lists the commands in these groups, in this order (every command in one).
_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("before a run (no GPU)", ("predict", "fit", "plan", "serve")),
    ("after an OOM, and during a run", ("explain", "run")),
    ("snapshots, traces and settings", ("replay", "simulate", "tune", "diff", "doctor", "demo")),
    ("across runs", ("report", "experiment")),
    ("catalogs", ("gpus", "presets")),
    ("agents", ("mcp",)),
)
# The commands whose words after `--` are a script's own arguments (`predict train.py -- ARGS`).
_SCRIPT_COMMANDS = ("predict", "fit")
# Flags whose value names a script's argument, so it starts with a dash (`--batch-arg
# --batch_size`), which argparse takes for an option of its own; joined as `--batch-arg=...`.
_DASHED_VALUES = ("--batch-arg",)
# The cyclic garbage collector's thresholds in the `oomkit` process, mypy's (mypy/build.py build:
# "Run gc less frequently, as otherwise we can spend a large fraction of cpu in gc"). CPython
# collects its youngest generation every 700 net allocations of containers; importing a
# command's modules (functions, classes, the methods each dataclass generates) makes some 10^5
# of them and next to no garbage cycles, so those collections free nothing and cost 7-9% of a
# file command's start-up (benchmarks/startup_speed.py, issue 41 item 4). Reference counting
# still frees everything else at once; cycles are collected after 200,000 allocations.
_GC_THRESHOLDS = (200_000, 30, 30)


def _subcommands(only: str | None = None) -> list:
    # Imported here so that optional dependencies stay lazy; with ``only``, just that
    # subcommand's module (issue 19 item 4: `oomkit replay FILE` does not import the predictor
    # that `fit` needs).
    names = _COMMANDS if only is None else (only,)
    return [import_module(f"oomkit.interfaces.cli.{name}") for name in names]


def _help_width() -> int:
    """The width argparse's help formatter takes by default, ``shutil.get_terminal_size().columns
    - 2`` (``$COLUMNS``, else the terminal's, else 80), read without importing shutil.

    argparse builds a formatter for every argument a parser adds (it checks the metavar), and
    its own look-up imports shutil with bz2, lzma and zlib: 2 ms of every command's start-up
    for a help text it never prints (issue 41 item 4).
    """
    try:
        columns = int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):  # no stdout, closed, or not a terminal
            columns = 0
        columns = columns or 80
    return columns - 2


class _WholeWordsFormatter(argparse.HelpFormatter):
    """argparse's help layout, but a line never breaks inside a hyphenated word: preset names
    (``bert-large``), flags and settings stay whole, so they can be copied from the help."""

    def __init__(
        self,
        prog: str,
        indent_increment: int = 2,
        max_help_position: int = 24,
        width: int | None = None,
    ) -> None:
        super().__init__(
            prog, indent_increment, max_help_position, _help_width() if width is None else width
        )

    def _split_lines(self, text: str, width: int) -> list[str]:
        import textwrap

        text = " ".join(text.split())
        return textwrap.wrap(text, width, break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        import textwrap

        text = " ".join(text.split())
        return textwrap.fill(
            text, width, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False
        )


def _root_parser(
    kind: type[argparse.ArgumentParser] = argparse.ArgumentParser,
) -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    from oomkit._version import __version__

    parser = kind(
        prog="oomkit",
        description="Predict, explain and prevent CUDA out-of-memory errors in PyTorch.",
        allow_abbrev=False,
        formatter_class=_WholeWordsFormatter,
    )
    parser.add_argument(
        "--version",
        action=_VersionAction,
        version=f"oomkit {__version__}",
        help="show the version and which allocator core runs (compiled or pure Python), and exit",
    )
    # The commands' own parsers are plain ones (the grouped help is the root's alone).
    return parser, parser.add_subparsers(
        dest="command", metavar="COMMAND", parser_class=_CommandParser
    )


class _CommandParser(argparse.ArgumentParser):
    """A subcommand's parser: its help keeps words whole (``_WholeWordsFormatter``) unless the
    command sets a formatter of its own; from its first argument on, so that argparse's own
    formatter (and the shutil import of its width) is never built."""

    # `` (did you mean --gpus for --gpu?)``, said after a missing required argument: argparse
    # reports that before the unknown flag that was meant to give it (_parse sets it).
    hint = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _WholeWordsFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        if message.startswith("the following arguments are required"):
            message += self.hint
        super().error(message)


class _VersionAction(argparse._VersionAction):
    """``--version``: the version, then the allocator core this installation imports (looked up
    only when asked: it reads the file system)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        from oomkit._build import allocator_core

        self.version = f"{self.version} (allocator core: {allocator_core()})"
        super().__call__(parser, namespace, values, option_string)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The root parser with every subcommand registered (or just ``only``, a subcommand name)."""
    parser, subparsers = _root_parser(_GroupedRootParser)
    for module in _subcommands(only):
        module.add_parser(subparsers)
    # No abbreviated flags: `experiment --gpu 0` must not quietly mean `--gpus 0`.
    for subparser in subparsers.choices.values():
        subparser.allow_abbrev = False
    return parser


class _GroupedRootParser(argparse.ArgumentParser):
    """The root parser, whose help lists the commands in groups (``_GROUPS``)."""

    def format_help(self) -> str:
        width = max(len(name) for name in _COMMANDS) + 2
        lines = [self.format_usage().rstrip(), "", str(self.description), ""]
        for title, names in _GROUPS:
            lines.append(f"{title}:")
            lines.extend(f"  {name:<{width}}{_SUMMARIES[name]}" for name in names)
            lines.append("")
        lines += [
            "options:",
            "  -h, --help  show this help message and exit",
            "  --version   show the version and which allocator core runs, and exit",
            "",
            "`oomkit COMMAND --help` shows a command's options. Exit codes: 0 success (it fits), "
            "1 it does not fit, 2 bad input, 3 a missing dependency.",
        ]
        return "\n".join(lines) + "\n"


def summary_parser() -> argparse.ArgumentParser:
    """The root parser that lists every subcommand by its one-line summary without importing the
    subcommand modules: what `oomkit`, `oomkit --help` and an unknown command word get. Its help
    text groups the commands (``_GROUPS``); its subcommands take no arguments of their own."""
    parser, subparsers = _root_parser(_GroupedRootParser)
    for name, summary in _SUMMARIES.items():
        subparsers.add_parser(name, help=summary)
    return parser


def _command_named(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` runs, when its first word names one; None otherwise."""
    if argv and argv[0] in _COMMANDS:
        return argv[0]
    return None


def _parse(
    parser: argparse.ArgumentParser, command: str | None, words: list[str]
) -> argparse.Namespace:
    """``parser.parse_args(words)``; where a script's own arguments were given without `--`
    before them (``oomkit predict train.py --batch_size 64``), the error says where they go."""
    chosen = _subparser(parser, command)
    if isinstance(chosen, _CommandParser):
        head = words[: words.index("--")] if "--" in words else words
        known = chosen._option_string_actions
        given = [w for w in head if w.split("=", 1)[0] not in known]
        chosen.hint = _guesses(chosen, given, name_given=True)
    args, unknown = parser.parse_known_args(words)
    target = getattr(args, "target", None) or ""
    if unknown and command in _SCRIPT_COMMANDS and target.endswith(".py"):
        parser.error(
            f"unrecognized arguments: {' '.join(unknown)}. A script's own arguments go after "
            f"`--`: oomkit {command} {target} [oomkit's options] -- {' '.join(unknown)}"
        )
    if unknown:
        guesses = _guesses(chosen or parser, unknown)
        parser.error(f"unrecognized arguments: {' '.join(unknown)}{guesses}")
    return args


def _subparser(parser: argparse.ArgumentParser, command: str | None) -> Any:
    """The parser of ``command`` (None: no command named)."""
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    return sub.choices.get(command) if sub is not None and command is not None else None


def _guesses(
    chosen: argparse.ArgumentParser, unknown: list[str], *, name_given: bool = False
) -> str:
    """`` (did you mean --batch?)`` for unknown flags close to one the command has; with
    ``name_given`` or several, each is named (``--gpus for --gpu``)."""
    from oomkit._names import closest_name

    # Compared without the dashes every long flag shares: `--lr` is not close to `--lora`.
    known = [f[2:] for f in chosen._option_string_actions if f[:2] == "--"]
    flags = [word.split("=", 1)[0] for word in unknown if word[:2] == "--"]
    pairs = []
    for flag in flags:
        close = closest_name(flag[2:], known) or max(
            (k for k in known if flag[2:].startswith((f"{k}-", f"{k}_"))), key=len, default=None
        )  # `--batch-size` -> `--batch`: the longest flag it starts with
        if close:
            named = name_given or len(flags) > 1
            pairs.append(f"--{close} for {flag}" if named else f"--{close}")
    return f" (did you mean {', '.join(pairs)}?)" if pairs else ""


def _launch_read(words: list[str], command: str) -> Any:
    """``_launchers.launch_read``; a command it cannot read is a usage error (exit 2)."""
    from oomkit.interfaces.cli._launchers import LauncherError, launch_read

    try:
        read = launch_read(words, command)
    except LauncherError as exc:
        build_parser(command).error(str(exc))
    if read is None:
        return None
    # oomkit's own options written after the script are the script's: say so beside the reading.
    root = build_parser(command)
    ours = {
        option
        for action in root._actions
        if isinstance(action, argparse._SubParsersAction)
        for sub in action.choices.values()
        for option in sub._option_string_actions
    }
    mistaken = [w for w in read.script_args if w.split("=", 1)[0] in ours and w.startswith("--")]
    if mistaken:
        said = (
            f"{read.said}; {', '.join(mistaken)} after the script went to the script: oomkit's "
            "own options go before the launch command"
        )
        read = dataclasses.replace(read, said=said)
    return read


def _dashed_values_joined(words: list[str]) -> list[str]:
    """``--batch-arg --batch_size`` as ``--batch-arg=--batch_size`` (``_DASHED_VALUES``)."""
    out: list[str] = []
    i = 0
    while i < len(words):
        if words[i] in _DASHED_VALUES and i + 1 < len(words):
            out.append(f"{words[i]}={words[i + 1]}")
            i += 2
        else:
            out.append(words[i])
            i += 1
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI and return its exit code."""
    words = list(sys.argv[1:] if argv is None else argv)
    # Only the named subcommand's parser is built (and its module imported); `oomkit`,
    # `oomkit --help` and unknown words get the summary parser, which lists every subcommand.
    command = _command_named(words)
    script_args: list[str] = []
    launched = _launch_read(words, command) if command in _SCRIPT_COMMANDS else None
    if launched is not None:  # `oomkit predict torchrun --nproc_per_node 8 train.py ARGS`
        print(f"oomkit: {launched.said}", file=sys.stderr)
        words, script_args = launched.words, launched.script_args
    elif command in _SCRIPT_COMMANDS and "--" in words:  # a script's own arguments follow `--`
        cut = words.index("--")
        words, script_args = words[:cut], words[cut + 1:]
    words = _dashed_values_joined(words)
    parser = summary_parser() if command is None else build_parser(command)
    args = _parse(parser, command, words)
    args.script_args = script_args
    if getattr(args, "run", None) is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    from oomkit.interfaces.cli._stdout import StdoutWriteError, guarded_stdout, stdout_failed

    try:
        with guarded_stdout():
            return int(args.run(args))
    except StdoutWriteError as exc:
        return stdout_failed(exc, EXIT_USAGE)
    except TorchRequiredError as exc:
        print(f"oomkit: {exc}", file=sys.stderr)
        return EXIT_MISSING_DEPENDENCY
    except OomkitError as exc:
        print(f"oomkit: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("oomkit: interrupted", file=sys.stderr)
        return 130


def console_main() -> None:
    """The ``oomkit`` command and ``python -m oomkit``: ``main``, then exit with its code.

    First the garbage collector runs less often (``_collect_cycles_rarely``).

    Before the interpreter shuts down, every object alive is frozen out of the garbage
    collector (``gc.freeze``): Python's shutdown runs full collections over every object still
    alive, and with torch imported those are a few million (0.5 s of `oomkit predict`'s wall
    time for torch alone, 0.8 s after a `fit` search: benchmarks/fit_cli_speed.py). Nothing a
    command made needs them: what module teardown releases is still freed, and its files
    closed, by reference counting, and atexit handlers (multiprocessing's, weakref finalizers)
    still run; only reference cycles alive at exit are left to the operating system, whose
    ``__del__`` Python never promises to run at exit anyway.

    Those cycles are what nanobind, at teardown, reports as "leaked instances" (triton's IR
    types, loaded by ``torch._dynamo`` wherever triton is installed: every Linux CUDA wheel of
    torch), a page of noise after the command's own output. ``_quiet_teardown`` is registered
    first, so it runs after every other atexit handler (their messages still show) and sends
    what module teardown writes to stderr to ``os.devnull``.
    """
    _collect_cycles_rarely()
    atexit.register(_quiet_teardown)
    code = main()
    gc.freeze()
    raise SystemExit(code)


def _collect_cycles_rarely() -> None:
    """Set this process's garbage-collection thresholds to ``_GC_THRESHOLDS`` (the first thing
    ``console_main`` does; benchmarks/startup_speed.py does it as the command does)."""
    gc.set_threshold(*_GC_THRESHOLDS)


def _quiet_teardown() -> None:
    """Point file descriptor 2 at ``os.devnull`` for the interpreter's teardown (``console_main``)."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):  # a closed pipe or stream: nothing left to lose
        pass
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)

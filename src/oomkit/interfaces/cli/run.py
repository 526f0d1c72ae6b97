"""``oomkit run -- python train.py ARGS``: run a script unmodified under ``oomkit.watch()``.

The script runs in a child Python (the interpreter the command names) through a small bootstrap
(``oomkit/runtime/_bootstrap.py``) that turns on memory-history recording and the OOM observer,
then runs the script with ``runpy`` as ``python train.py`` would. The child writes a small JSON
result; on an OOM this process diagnoses the snapshot taken at it and prints the report (on
stderr, since stdout is the script's; ``--json`` prints one object on stdout after the script's
own output). The exit code is the script's own (128+N when a signal N ended it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import oomkit
from oomkit.errors import OomkitError
from oomkit.interfaces.cli._common import (
    add_json_flag,
    add_script_command,
    positive_int,
    print_json,
    stderr_console,
)

__all__ = ["add_parser", "run", "split_python_command"]

_PYTHON_NAME = re.compile(r"^python(\d+(\.\d+)?)?(\.exe)?$|^pypy3?(\.\d+)?$")
# CPython options that take no value (python --help); they may be combined (-uB).
_FLAG_LETTERS = set("bBdEiIOPqsSuvx")
_VALUE_OPTIONS = ("-W", "-X")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from oomkit.runtime.watch import DEFAULT_MAX_ENTRIES, DEFAULT_SNAPSHOT_DIR

    parser = subparsers.add_parser(
        "run",
        help="run a Python script with OOM snapshots and diagnosis: oomkit run -- python train.py",
        epilog="`oomkit run train.py -- ARGS` is `oomkit run -- python train.py ARGS` with the "
        "Python that runs oomkit.",
        description="Run a Python script unmodified with CUDA memory-history recording (a ring "
        "buffer of --max-entries events) and an out-of-memory observer. On an OOM the snapshot "
        "is written to --snapshot-dir and the diagnosis printed. Exits with the script's own "
        "exit code; 2 when the command is not a Python script.",
    )
    parser.add_argument(
        "--snapshot-dir",
        metavar="DIR",
        default=DEFAULT_SNAPSHOT_DIR,
        help=f"where the snapshot at an OOM is written (default ./{DEFAULT_SNAPSHOT_DIR})",
    )
    parser.add_argument(
        "--max-entries",
        metavar="N",
        type=positive_int,
        default=DEFAULT_MAX_ENTRIES,
        help=f"events kept in the history ring buffer per device (default {DEFAULT_MAX_ENTRIES})",
    )
    add_json_flag(parser)
    add_script_command(parser)
    parser.set_defaults(run=run)
    return parser


_USAGE = {
    "run": "oomkit run [--snapshot-dir DIR] -- python train.py ARGS",
    "experiment": "oomkit experiment [--configs FILE] -- python train.py ARGS",
}


def split_python_command(
    command: list[str], *, by: str = "run"
) -> tuple[str, list[str], list[str]]:
    """Split ``python [options] script ARGS`` into interpreter, its options and the target,
    for the command ``by`` (``run`` or ``experiment``, named in the errors). ``script.py [--]
    ARGS`` is ``python script.py ARGS`` with this interpreter (``sys.executable``).

    Returns:
        ``(python, interpreter_options, target)`` where target is ``[script, *args]`` or
        ``["-m", module, *args]``.

    Raises:
        OomkitError: not a Python command, no script, ``-c`` code, or a missing script file.
    """
    if command and command[0] == "--":
        command = command[1:]
    usage = _USAGE[by]
    if not command:
        raise OomkitError(f"no command to run. Usage: {usage}")
    python = command[0]
    if python.endswith(".py") and not _PYTHON_NAME.match(os.path.basename(python)):
        # `oomkit run train.py -- ARGS`, as predict and fit take a script: this interpreter
        # runs it, and the `--` after the script separates oomkit's words from its own.
        if not Path(python).is_file():
            raise OomkitError(
                f"{python}: no such script. Check the path (it is relative to {Path.cwd()})."
            )
        rest = command[1:]
        return sys.executable, [], [python, *(rest[1:] if rest[:1] == ["--"] else rest)]
    if not _PYTHON_NAME.match(os.path.basename(python)) and os.path.realpath(
        python
    ) != os.path.realpath(sys.executable):
        raise OomkitError(
            f"`oomkit {by}` runs Python scripts; got `{python}`. Write `{usage}`. For launchers (torchrun, accelerate, deepspeed) put "
            "`with oomkit.watch(): ...` in the script instead."
        )
    options: list[str] = []
    i = 1
    while i < len(command):
        arg = command[i]
        if arg == "-m":
            if i + 1 >= len(command):
                raise OomkitError(f"`python -m` needs a module name: oomkit {by} -- python -m pkg")
            return python, options, command[i:]
        if arg.startswith("-c"):
            raise OomkitError(
                f"`python -c CODE` is not supported by `oomkit {by}`; put the code in a file, or "
                "use `with oomkit.watch(): ...` in it"
            )
        if arg in _VALUE_OPTIONS and i + 1 < len(command):
            options += [arg, command[i + 1]]
            i += 2
            continue
        if arg[:2] in _VALUE_OPTIONS and len(arg) > 2:
            options.append(arg)
        elif arg.startswith("-") and len(arg) > 1 and set(arg[1:]) <= _FLAG_LETTERS:
            options.append(arg)
        elif arg.startswith("-"):
            raise OomkitError(
                f"unknown Python option {arg!r} before the script; write `{usage}`"
            )
        else:
            if not Path(arg).is_file():
                raise OomkitError(
                    f"{arg}: no such script. Check the path (it is relative to {Path.cwd()})."
                )
            return python, options, command[i:]
        i += 1
    raise OomkitError(f"no script given after `{python}`. Usage: {usage}")


def _bootstrap_file() -> str:
    from oomkit.runtime import _bootstrap

    return os.path.abspath(_bootstrap.__file__)


def _wait(proc: subprocess.Popen) -> int:
    # Ctrl-C reaches the child too (same process group): let it decide, keep waiting for it.
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt:
            continue


def run(args: argparse.Namespace) -> int:
    python, options, target = split_python_command(list(args.script_command))
    snapshot_dir = Path(args.snapshot_dir).absolute()
    with tempfile.TemporaryDirectory(prefix="oomkit-run-") as tmp:
        config_path = Path(tmp) / "config.json"
        result_path = Path(tmp) / "result.json"
        config_path.write_text(
            json.dumps(
                {
                    "snapshot_dir": str(snapshot_dir),
                    "max_entries": args.max_entries,
                    "result_path": str(result_path),
                    "oomkit_root": str(Path(oomkit.__file__).resolve().parent.parent),
                }
            )
        )
        cmd = [python, *options, _bootstrap_file(), str(config_path), *target]
        try:
            proc = subprocess.Popen(cmd)
        except OSError as exc:
            raise OomkitError(f"could not start `{python}`: {exc.strerror or exc}") from exc
        returncode = _wait(proc)
        result = json.loads(result_path.read_text()) if result_path.is_file() else None
    exit_code = returncode if returncode >= 0 else 128 - returncode
    return _report(result, exit_code, json_output=args.json)


def _gpu_from_json(raw: dict | None):
    from oomkit.core.gpus import GpuSpec

    if raw is None:
        return None
    return GpuSpec(
        name=raw["name"],
        total_memory_bytes=raw["total_memory_bytes"],
        context_overhead_bytes=raw["context_overhead_bytes"],
    )


def _observed_from_json(raw: list[dict]):
    from oomkit.runtime.watch import ObservedOom

    if not raw:
        return None
    last = raw[-1]
    return ObservedOom(
        last["device"],
        last["requested_bytes"],
        last["device_limit_bytes"],
        last["device_free_bytes"],
        None,
    )


def _report(result: dict | None, exit_code: int, *, json_output: bool) -> int:
    from oomkit.interfaces.reports.diagnosis import diagnosis_to_json, render_diagnosis
    from oomkit.runtime.watch import diagnose_dump

    diagnosis = None
    diagnosis_error = None
    if result is not None and result["oom"]:
        snapshot = result["snapshot_path"]
        try:
            diagnosis = diagnose_dump(
                Path(snapshot) if snapshot is not None else None,
                result["message"],
                gpu=_gpu_from_json(result.get("gpu")),
                observed=_observed_from_json(result["observed_ooms"]),
            )
        except OomkitError as exc:
            diagnosis_error = str(exc)
    if json_output:
        print_json(
            {
                "exit_code": exit_code,
                "outcome": None if result is None else result["outcome"],
                "oom": bool(result and result["oom"]),
                "recording": bool(result and result["recording"]),
                "unwatched_reason": None if result is None else result.get("unwatched_reason"),
                "snapshot_path": None if result is None else result["snapshot_path"],
                "observed_ooms": [] if result is None else result["observed_ooms"],
                "diagnosis": None if diagnosis is None else diagnosis_to_json(diagnosis),
                "error": diagnosis_error or (None if result is None else result["error"]),
            }
        )
        return exit_code
    console = stderr_console()
    if result is None:
        console.print(
            f"oomkit: the script ended (exit code {exit_code}) before reporting; no diagnosis"
        )
        return exit_code
    if result["error"]:
        console.print(f"[yellow]oomkit: warning:[/yellow] {result['error']}")
    if result["oom"]:
        console.rule("oomkit: CUDA out of memory")
        if diagnosis is not None:
            render_diagnosis(diagnosis, console)
        else:
            console.print(f"oomkit: could not diagnose the OOM: {diagnosis_error}")
        if result["snapshot_path"]:
            console.print(
                f"Snapshot at the OOM: {result['snapshot_path']} "
                f"(oomkit explain {result['snapshot_path']}; pytorch.org/memory_viz opens it)",
                soft_wrap=True,
            )
    elif result.get("unwatched_reason"):
        pass  # the bootstrap said why before the script's first line
    elif not result["recording"]:
        console.print("oomkit: no CUDA device; the script ran without memory recording")
    elif result["observed_ooms"]:
        console.print(
            f"oomkit: the script caught {len(result['observed_ooms'])} out-of-memory error(s); "
            f"snapshot of the last: {result['snapshot_path']}",
            soft_wrap=True,
        )
    return exit_code

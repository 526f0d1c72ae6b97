"""Run ``python -m oomkit`` as a user or a script would, bounded in time and memory.

Shared by the hostile-input CLI tests: each input is given to every command that reads its
kind of file, in a fresh process (so a crash, a hang or a blown memory limit is seen as the
user would see it), and the input must come back unchanged.
"""

from __future__ import annotations

import hashlib
import os
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from _cli_in_process import CliResult

SRC = str(Path(__file__).resolve().parents[2] / "src")
# Wall clock for one command (the machine running tests may be busy: generous) and address
# space (a memo bomb or a 2**20000-byte request must not be able to take the machine).
CLI_SECONDS = 60.0
CLI_MEMORY_BYTES = 3 * 2**30

# Every command that reads a snapshot, and how to give it one (diff takes two).
SNAPSHOT_COMMANDS: tuple[tuple[str, ...], ...] = (
    ("explain", "{0}"),
    ("replay", "{0}"),
    ("replay", "--verify", "{0}"),
    ("tune", "{0}"),
    ("diff", "{0}", "{0}"),
    ("doctor", "{0}"),
)
MONITOR_LOG_COMMANDS: tuple[tuple[str, ...], ...] = (
    ("report", "{0}"),
    ("report", "--json", "{0}"),
    ("diff", "{0}", "{0}"),
)
TRACE_COMMANDS: tuple[tuple[str, ...], ...] = (
    ("simulate", "{0}"),
    ("tune", "{0}"),
)


def _limit_memory() -> None:  # runs in the child before exec
    resource.setrlimit(resource.RLIMIT_AS, (CLI_MEMORY_BYTES, CLI_MEMORY_BYTES))


def run_oomkit(argv: Sequence[str], *, cwd: Path, stdin: str = "") -> CliResult:
    """``python -m oomkit *argv`` in ``cwd``, bounded; never raises for the command's failure."""
    env = {**os.environ, "PYTHONPATH": SRC, "COLUMNS": "100", "NO_COLOR": "1"}
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "oomkit", *argv],
        cwd=cwd,
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        errors="replace",
        timeout=CLI_SECONDS,
        preexec_fn=_limit_memory,
    )
    return CliResult(
        tuple(argv), proc.returncode, proc.stdout, proc.stderr, time.perf_counter() - start
    )


def digest(path: Path) -> str:
    """The file's SHA-256, to show that a command left its input as it was."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def assert_refused(result: CliResult, *words: str) -> None:
    """Exit 2 with one line on stderr, no traceback, holding each of ``words``."""
    shown = f"{result.argv}: rc={result.returncode}\n{result.stderr[-2000:]}"
    assert result.returncode == 2, shown
    assert "Traceback" not in result.stderr, shown
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, shown
    assert lines[0].startswith("oomkit"), shown
    assert "\x1b" not in result.stderr and "\x1b" not in result.stdout, shown
    for word in words:
        assert word in lines[0], f"{word!r} not in: {lines[0]}"


def refused_by_every_command(
    path: Path, commands: Sequence[Sequence[str]], *words: str
) -> list[CliResult]:
    """Run each command on ``path``: each must refuse it (``assert_refused``) and leave it as it
    was. Returns the results."""
    before = digest(path)
    results = []
    for command in commands:
        argv = [part.format(path.name) for part in command]
        result = run_oomkit(argv, cwd=path.parent)
        assert_refused(result, *words)
        results.append(result)
    assert digest(path) == before, f"{path} was changed"
    return results

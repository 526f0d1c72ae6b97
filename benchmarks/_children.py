"""What the benchmarks that run each setting in a fresh process share: the child's JSON line,
and the last JSON line of the report (printed, and written where asked)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any


class ChildFailed(Exception):
    """A setting's child process exited non-zero (its stderr was passed on)."""

    def __init__(self, returncode: int) -> None:
        super().__init__(f"the child process exited {returncode}")
        self.returncode = returncode


def run_child(script: str, *args: str) -> dict[str, Any]:
    """Run ``python script *args`` and return the JSON object its last stdout line holds.

    Raises:
        ChildFailed: it exited non-zero (its stderr is written to ours first).
    """
    proc = subprocess.run(
        [sys.executable, script, *args], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise ChildFailed(proc.returncode)
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def emit(payload: dict[str, Any], write: str | None) -> None:
    """Print ``payload`` as the report's last line, one JSON object; also write it to ``write``."""
    line = json.dumps(payload)
    print(line)
    if write:
        with open(write, "w", encoding="utf-8") as out:
            out.write(line + "\n")

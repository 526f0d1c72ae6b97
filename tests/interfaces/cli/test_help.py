"""`predict --help` and `fit --help` read in a minute: grouped, under 100 lines; `oomkit --help`
groups the commands."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from oomkit.interfaces.cli import _GROUPS, _SUMMARIES


def _help(*argv: str, columns: int = 100) -> str:
    env = {**os.environ, "COLUMNS": str(columns)}
    proc = subprocess.run(
        [sys.executable, "-m", "oomkit", *argv, "--help"], capture_output=True, text=True,
        env=env, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("columns", [80, 100])
@pytest.mark.parametrize("command", ["predict", "fit"])
def test_predict_and_fit_help_is_grouped_and_short(command, columns):
    """Six groups a user looks for, the examples at the end, at most 100 lines on a terminal
    of 80 columns and of 100 (a pipe's width)."""
    text = _help(command, columns=columns)
    lines = text.splitlines()
    assert len(lines) <= 100, len(lines)
    for group in ("workload:", "precision and optimizer:", "fine-tuning:", "multi-GPU:",
                  "device and allocator:", "output:", "config files:"):
        assert group in lines, group
    examples = lines.index("examples:")
    assert lines[examples + 1].startswith(f"  oomkit {command} ")
    assert "--set SECTION.KEY=VALUE" in text and "--dump-config" in text


def test_root_help_groups_every_command():
    """`oomkit --help` lists every command once, in its group."""
    text = _help()
    grouped = [name for _, names in _GROUPS for name in names]
    assert sorted(grouped) == sorted(_SUMMARIES)
    for title, names in _GROUPS:
        block = text.split(f"{title}:\n", 1)[1].split("\n\n", 1)[0].splitlines()
        assert [line.split()[0] for line in block] == list(names)

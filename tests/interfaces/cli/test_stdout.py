"""Output that cannot be written: a closed pipe exits 141 in silence, any other failure is one line.

Before ``_stdout.guarded_stdout``, ``oomkit gpus | head -1`` exited 1 (rich's console turns a
broken pipe into ``SystemExit(1)``; 1 is "would run out of memory" to a script) and ``oomkit
gpus --json > /dev/full`` printed a traceback.
"""

from __future__ import annotations

import errno
import functools
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oomkit.interfaces.cli import main
from oomkit.interfaces.cli._stdout import EXIT_BROKEN_PIPE

SRC = str(Path(__file__).resolve().parents[3] / "src")


class _FailingStream(io.StringIO):
    """A terminal-less stdout that fails with ``code`` once ``after`` characters are written."""

    def __init__(self, code: int, after: int) -> None:
        super().__init__()
        self.code, self.after = code, after

    def write(self, text: str) -> int:
        if self.tell() + len(text) > self.after:
            raise OSError(self.code, os.strerror(self.code))
        return super().write(text)


COMMANDS = (("gpus",), ("gpus", "--json"), ("presets",), ("presets", "--json"), ("demo",))


@functools.cache
def _output_chars(argv: tuple[str, ...]) -> int:
    stream, saved = io.StringIO(), sys.stdout
    sys.stdout = stream
    try:
        assert main(list(argv)) == 0
    finally:
        sys.stdout = saved
    return len(stream.getvalue())


@settings(max_examples=25, deadline=None)
@given(
    argv=st.sampled_from(COMMANDS),
    code=st.sampled_from((errno.EPIPE, errno.ENOSPC, errno.EIO, errno.EDQUOT)),
    where=st.floats(0, 1, exclude_max=True),
)
def test_a_failed_write_is_an_exit_code_not_a_traceback(argv, code, where):
    """Wherever the output fails: 141 and nothing said for a closed pipe; else 2 and one line."""
    after = int(where * _output_chars(argv))  # a point inside the output
    stream, err = _FailingStream(code, after), io.StringIO()
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = stream, err
    try:
        result = main(list(argv))
    finally:
        sys.stdout, sys.stderr = saved
    if code == errno.EPIPE:
        assert (result, err.getvalue()) == (EXIT_BROKEN_PIPE, "")
    else:
        assert result == 2
        assert err.getvalue() == (
            f"oomkit: error: could not write the output to standard output "
            f"({os.strerror(code)}); free some space, or send the output elsewhere\n"
        )
    assert sys.stdout is saved[0]  # the guard is gone


def test_output_that_fits_is_written_whole():
    """The guard changes nothing when the writes succeed: the same JSON, exit 0."""
    stream = io.StringIO()
    saved = sys.stdout
    sys.stdout = stream
    try:
        assert main(["gpus", "--json"]) == 0
    finally:
        sys.stdout = saved
    assert stream.getvalue().startswith('{\n  "gpus": [')


def _oomkit(argv: list[str], stdout: int) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": SRC}
    return subprocess.run([sys.executable, "-m", "oomkit", *argv], stdout=stdout,
                          stderr=subprocess.PIPE, text=True, env=env, timeout=60)


def test_a_pipe_closed_before_the_output_exits_141_in_silence():
    """``oomkit gpus | head -0``: the reader is gone before the first write."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = _oomkit(["gpus"], write_end)
    finally:
        os.close(write_end)
    assert (proc.returncode, proc.stderr) == (EXIT_BROKEN_PIPE, "")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full on this system")
def test_a_full_disk_is_one_line_and_exit_2():
    """``oomkit gpus --json > /dev/full``: ENOSPC on the write, said once."""
    with open("/dev/full", "w") as full:
        proc = _oomkit(["gpus", "--json"], full.fileno())
    assert proc.returncode == 2
    assert proc.stderr == (
        "oomkit: error: could not write the output to standard output (No space left on "
        "device); free some space, or send the output elsewhere\n"
    )

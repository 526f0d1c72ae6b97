"""Standard output that fails in words: a closed pipe ends a command quietly, a full disk is one line.

``oomkit predict ... | head -3`` closes the pipe while oomkit still writes, and ``oomkit replay
... --json > out.json`` on a full disk fails its write. Unguarded, the first exited 1 (rich's
console turns ``BrokenPipeError`` into ``SystemExit(1)``, and 1 means "would run out of memory"
to a script) and the second printed a traceback. While a command runs, ``guarded_stdout`` puts a
proxy in front of ``sys.stdout`` whose ``write`` and ``flush`` raise :class:`StdoutWriteError`
(no ``OSError``, so no library catches it on the way) for ``main`` to turn into an exit code.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO

__all__ = ["EXIT_BROKEN_PIPE", "StdoutWriteError", "guarded_stdout", "stdout_failed"]

# What a shell reports for a command that a closed pipe stopped: 128 + SIGPIPE (13).
EXIT_BROKEN_PIPE = 128 + 13


class StdoutWriteError(Exception):
    """Writing the results to standard output failed with ``cause``."""

    def __init__(self, cause: OSError) -> None:
        super().__init__(str(cause))
        self.cause = cause


class _GuardedStream:
    """``stream`` with its write failures raised as :class:`StdoutWriteError`."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as exc:
            raise StdoutWriteError(exc) from exc

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            raise StdoutWriteError(exc) from exc

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, buffer...
        return getattr(self._stream, name)


@contextlib.contextmanager
def guarded_stdout() -> Iterator[None]:
    """``sys.stdout`` guarded while the block runs, and flushed at its end (a write to a file
    can sit in the buffer until then)."""
    stream = sys.stdout
    guarded = _GuardedStream(stream)
    sys.stdout = guarded
    try:
        yield
        guarded.flush()
    finally:
        if sys.stdout is guarded:
            sys.stdout = stream


def stdout_failed(exc: StdoutWriteError, usage_code: int) -> int:
    """The exit code of a command whose output could not be written, said in one line unless
    the reader went away (a closed pipe: nobody is left to read it)."""
    if exc.cause.errno == errno.EPIPE:
        # Later flushes (the interpreter's, at exit) go nowhere rather than fail again.
        with contextlib.suppress(OSError, ValueError, AttributeError):  # no descriptor
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        return EXIT_BROKEN_PIPE
    reason = exc.cause.strerror or str(exc.cause)
    print(
        f"oomkit: error: could not write the output to standard output ({reason}); free some "
        "space, or send the output elsewhere",
        file=sys.stderr,
    )
    return usage_code

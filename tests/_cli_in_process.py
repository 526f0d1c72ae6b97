"""Run ``oomkit`` in this process (``main``) as ``robustness/_cli_bounds.run_oomkit`` runs it in a
child.

For tests that check what a command prints and its exit code, not the process boundary (the
hostile-input tests, user code that exits, a cache test's uncached run to compare with): a
child costs an interpreter start and oomkit's imports each time. The
child's conditions are reproduced: a working folder, environment variables, an empty stdin,
stdout and stderr captured as text, warnings written to stderr as a child's interpreter prints
them, and argparse's ``SystemExit`` taken as the exit code. The folder, the environment and
the streams are restored afterwards. An exception that escapes ``main`` (a child would print
its traceback and exit 1) propagates and fails the test that ran it.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

__all__ = ["CliResult", "run_in_process"]


@dataclass(frozen=True)
class CliResult:
    """What one ``oomkit`` run did (in a child process or in this one)."""

    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    seconds: float


def _child_warning_filters() -> None:
    """The warning filters of a child interpreter started without ``-W``: deprecation, import
    and resource warnings ignored but in ``__main__``, every other warning shown once per place
    (Python's documented default filter list, ``warnings`` module, "Default Warning Filter")."""
    warnings.resetwarnings()
    warnings.simplefilter("default")
    for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
        warnings.filterwarnings("ignore", category=category)
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")


def _restore_environ(before: Mapping[str, str]) -> None:
    os.environ.clear()
    os.environ.update(before)


def run_in_process(
    argv: Sequence[str], *, cwd: Path | None = None, environ: Mapping[str, str] | None = None
) -> CliResult:
    """``oomkit *argv`` run by ``main`` in ``cwd`` (the current folder when ``None``) with
    ``environ`` set: its exit code and what it printed on stdout and stderr."""
    from oomkit.interfaces.cli import main

    out, err = io.StringIO(), io.StringIO()
    start = time.perf_counter()
    # The whole environment as it was: a command may set variables of its own as it runs
    # (torch sets TORCHINDUCTOR_CACHE_DIR), which a child's exit would have dropped.
    before = dict(os.environ)
    with contextlib.ExitStack() as stack:
        stack.callback(_restore_environ, before)
        patch = stack.enter_context(pytest.MonkeyPatch.context())
        if cwd is not None:
            patch.chdir(cwd)
        for name, value in (environ or {}).items():
            patch.setenv(name, value)
        patch.setattr(sys, "stdin", io.StringIO(""))
        stack.enter_context(contextlib.redirect_stdout(out))
        stack.enter_context(contextlib.redirect_stderr(err))
        caught = stack.enter_context(warnings.catch_warnings(record=True))
        _child_warning_filters()
        try:
            code = main(list(argv))
        except SystemExit as exc:  # argparse's usage errors exit 2 from parse_args
            code = exc.code if isinstance(exc.code, int) else 1
        for warning in caught:
            err.write(warnings.formatwarning(
                warning.message, warning.category, warning.filename, warning.lineno
            ))
    return CliResult(tuple(argv), code, out.getvalue(), err.getvalue(), time.perf_counter() - start)

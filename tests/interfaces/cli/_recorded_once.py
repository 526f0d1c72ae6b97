"""Predictions that several CLI test modules read, recorded once per test process.

A recording of the tiny Llama (``use_tiny_llama``) or of torchtitan's debugmodel costs seconds of
CPU, and several modules assert on the same one: ``predict llama3-8b --fsdp 2 --batch 1 --seq 16
--steps 2`` of the tiny Llama is read by test_compile_parallel_cli.py, test_float8_cli.py and
test_hsdp_cli.py, torchtitan's debugmodel on FSDP 2 by test_torchtitan_cli.py and
test_torchtitan_compile_cli.py. The exit code and the printed JSON of each command line are kept
(``functools.cache``, for the life of the test process: a pytest-xdist worker) and every reader
parses its own copy, so no test sees another's changes.

Only the command line is the key, so only commands whose recording is settled by it are kept
here: a preset of the tiny Llama (its shape is this module's, patched in while it records) or a
torchtitan job (the job and its overrides name all it builds). Neither is kept in oomkit's own
recording cache (``scenario/recording_reuse.py``: a sharded step, a torchtitan job and a process
that imported torch are recorded afresh), so each first call here records.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
from collections.abc import Sequence

import pytest
from _parallel_helpers import use_tiny_llama

from oomkit.interfaces.cli import main

__all__ = ["tiny_llama_json", "torchtitan_json"]


@functools.cache
def _printed(argv: tuple[str, ...], tiny_llama: bool) -> tuple[int, str]:
    """The exit code of ``oomkit ARGV`` and what it printed on stdout, recorded on the first
    call (with the tiny Llama patched in for the preset builders when ``tiny_llama``)."""
    with pytest.MonkeyPatch.context() as patch:
        if tiny_llama:
            use_tiny_llama(patch)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(list(argv))
    return code, out.getvalue()


def tiny_llama_json(argv: Sequence[str]) -> tuple[int, dict]:
    """The exit code and a fresh copy of the JSON of ``oomkit ARGV`` (``predict PRESET ...
    --json``) with the tiny Llama as every preset, recorded once per process."""
    code, printed = _printed(tuple(argv), True)
    return code, json.loads(printed)


def torchtitan_json(argv: Sequence[str]) -> tuple[int, dict]:
    """The exit code and a fresh copy of the JSON of ``oomkit ARGV`` (``predict --torchtitan
    MODULE:CONFIG ... --json -- OVERRIDES``), recorded once per process."""
    code, printed = _printed(tuple(argv), False)
    return code, json.loads(printed)

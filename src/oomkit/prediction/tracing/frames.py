"""Finding the user's own line: the innermost stack frame outside torch, oomkit and the stdlib."""

from __future__ import annotations

import inspect
import os
import sys
import sysconfig
import types
from collections.abc import Sequence
from pathlib import Path

from oomkit.core.trace import Frame

__all__ = ["library_prefixes", "UserFrameFinder"]

_SUSPENDABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


def library_prefixes() -> tuple[str, ...]:
    """Directories whose frames are never the user's: torch, oomkit and Python's stdlib."""
    import torch

    import oomkit

    prefixes = [
        str(Path(torch.__file__).parent) + os.sep,
        str(Path(oomkit.__file__).parent) + os.sep,
    ]
    for key in ("stdlib", "platstdlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            prefixes.append(str(Path(path)) + os.sep)
    return tuple(dict.fromkeys(prefixes))


class UserFrameFinder:
    """Walks the stack to the innermost user frame, caching the verdict per code object."""

    def __init__(self, prefixes: Sequence[str] | None = None) -> None:
        self._prefixes = tuple(prefixes) if prefixes is not None else library_prefixes()
        self._is_user: dict[types.CodeType, bool] = {}
        # A frame that stays on the stack while every op of a recording runs (the frame that
        # entered the Tracer), and the answer for the frames above it: those are suspended in
        # their calls, so their lines cannot change until it returns (``hold``).
        self._held: types.FrameType | None = None
        self._above_held: tuple[Frame, ...] = ()

    def hold(self, frame: types.FrameType | None) -> None:
        """Walk no further than ``frame`` while it is on the stack: the frames above it are
        answered once (issue 19 item 6: the walk was up to the interpreter's first frame, per
        allocation). ``None`` lets go (call it before ``frame`` returns)."""
        if frame is not None and frame.f_code.co_flags & _SUSPENDABLE:
            # A generator's frame can be resumed from elsewhere, under other frames: no hold.
            frame = None
        self._held = frame
        self._above_held = () if frame is None else self._walk(frame.f_back, None)

    def _user_code(self, code: types.CodeType) -> bool:
        filename = code.co_filename
        verdict = not (filename.startswith(self._prefixes) or filename.startswith("<frozen"))
        try:
            self._is_user[code] = verdict
        except TypeError:  # unhashable constants (see _walk): judged again next time
            pass
        return verdict

    def find(self) -> tuple[Frame, ...]:
        """The innermost user frame as a one-element tuple, or ``()`` when there is none."""
        return self._walk(sys._getframe(1), self._held)

    def _walk(
        self, frame: types.FrameType | None, held: types.FrameType | None
    ) -> tuple[Frame, ...]:
        # Called once per allocation with dozens of library frames above it: the cached verdict
        # is read inline, without a method call per frame (issue 19 item 6).
        is_user = self._is_user
        while frame is not None:
            code = frame.f_code
            try:
                verdict = is_user.get(code)
            except TypeError:
                # A code object hashes its constants; bytecode dynamo rewrote (a frame it runs
                # transformed, e.g. under --compile with checkpointing) can hold a dict there.
                verdict = None
            if verdict is None:
                verdict = self._user_code(code)
            if verdict:
                return (Frame(code.co_filename, frame.f_lineno, code.co_name),)
            if frame is held:
                return self._above_held
            frame = frame.f_back
        return ()

"""Finding the user's own line: the innermost stack frame outside torch, oomkit and the stdlib."""

from __future__ import annotations

import os
import sys
import sysconfig
import types
from collections.abc import Sequence
from pathlib import Path

from oomkit.core.trace import Frame

__all__ = ["library_prefixes", "UserFrameFinder"]


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

    def _user_code(self, code: types.CodeType) -> bool:
        verdict = self._is_user.get(code)
        if verdict is None:
            filename = code.co_filename
            verdict = not (filename.startswith(self._prefixes) or filename.startswith("<frozen"))
            self._is_user[code] = verdict
        return verdict

    def find(self) -> tuple[Frame, ...]:
        """The innermost user frame as a one-element tuple, or ``()`` when there is none."""
        # Called once per allocation with dozens of library frames above it: the cached verdict
        # is read inline, without a method call per frame (issue 19 item 6).
        is_user = self._is_user
        frame: types.FrameType | None = sys._getframe(1)
        while frame is not None:
            code = frame.f_code
            verdict = is_user.get(code)
            if verdict is None:
                verdict = self._user_code(code)
            if verdict:
                return (Frame(code.co_filename, frame.f_lineno, code.co_name),)
            frame = frame.f_back
        return ()

"""What a run left in a user's folder, as the tests that say "nothing else was written" read it."""

from __future__ import annotations

from pathlib import Path

__all__ = ["files_in"]


def files_in(folder: Path) -> list[str]:
    """Every path under ``folder``, relative and sorted, without Python's bytecode caches.

    Importing the user's modules (``twin.py``, nanoGPT's ``model.py``) writes
    ``__pycache__/*.pyc`` beside them wherever ``PYTHONDONTWRITEBYTECODE`` is unset, as
    ``python train.py`` does: Python's doing, not oomkit's, so it is not counted.
    """
    return sorted(
        path.relative_to(folder).as_posix()
        for path in folder.rglob("*")
        if "__pycache__" not in path.relative_to(folder).parts
    )

"""Where the tests find the real snapshots every session shares (``../shared/snapshots``, or
``$OOMKIT_SHARED_SNAPSHOTS``): read in place, never copied into the repository. ``tests/`` is on
``sys.path`` through its conftest (pytest's ``prepend`` import mode)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

__all__ = ["SHARED_FILES", "SHARED_SNAPSHOTS", "needs_shared"]

SHARED_SNAPSHOTS = Path(
    os.environ.get("OOMKIT_SHARED_SNAPSHOTS")
    or Path(__file__).resolve().parents[1].parent / "shared" / "snapshots"
)
# Each recorded snapshot (<repository>/<file>.pickle), in a stable order; none when absent.
SHARED_FILES = (
    sorted(
        p for p in SHARED_SNAPSHOTS.glob("*/*") if p.is_file() and p.suffix in (".pickle", ".pkl")
    )
    if SHARED_SNAPSHOTS.is_dir()
    else []
)
needs_shared = pytest.mark.skipif(
    not SHARED_FILES, reason="the shared snapshots are not available (set OOMKIT_SHARED_SNAPSHOTS)"
)

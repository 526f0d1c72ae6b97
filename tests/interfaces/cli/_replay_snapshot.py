"""The snapshot the `oomkit replay` tests run on, written with the labelled cases' Recorder."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "diagnose"))
from cases.oom_cases import GiB, MiB, Recorder  # noqa: E402

__all__ = ["MiB", "replay_snapshot"]


def replay_snapshot(directory: Path) -> Path:
    """``directory/s.pickle``: 300 MiB (its own segment), 5 MiB (a 20 MiB segment), free the
    300 MiB, 200 MiB (split from the cached 300 MiB block), 1000 B (a 2 MiB small segment):
    3 cudaMallocs, 322 MiB, on a 1 GiB device with nothing outside PyTorch."""
    recorder = Recorder(capacity_bytes=GiB, outside_bytes=0)
    first = recorder.alloc(300 * MiB)
    recorder.alloc(5 * MiB)
    recorder.free(first)
    recorder.alloc(200 * MiB)
    recorder.alloc(1000)
    return recorder.write(directory / "s.pickle")

"""A step whose peak reserved memory is exact in MiB: the search tests' common workload."""

from __future__ import annotations

from collections.abc import Callable

MiB = 2**20


def linear_step(batch: int, per_batch: int = 1, path_change_at: int | None = None) -> Callable[[], None]:
    """A step reserving (per_batch * batch + 4) * 2 MiB; from ``path_change_at`` on, 20 MiB more
    held beside it (another code path above some batch size)."""
    import torch

    def step() -> None:
        kept = torch.empty((per_batch * batch + 4) * 2 * MiB, dtype=torch.uint8)
        if path_change_at is not None and batch >= path_change_at:
            torch.empty(20 * MiB, dtype=torch.uint8)
        del kept

    return step

"""The compiled data-parallel tests' block: ``x + down(gelu(up(x)))``, two linears around a
GELU with a residual, as a transformer's MLP (one graph per block when compiled)."""

from __future__ import annotations

import torch

__all__ = ["ResidualMLP"]


class ResidualMLP(torch.nn.Module):
    """``x + down(gelu(up(x)))``: ``hidden`` -> ``wide`` -> ``hidden``, with biases."""

    def __init__(self, hidden: int, wide: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(hidden, wide)
        self.down = torch.nn.Linear(wide, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))

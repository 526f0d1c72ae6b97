"""Dropout as CUDA runs it, so that tracing on meta records CUDA's bool mask."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["FusedDropout"]


class FusedDropout(nn.Module):
    """``nn.Dropout`` that calls the fused ``native_dropout`` kernel, as CUDA does.

    aten/src/ATen/native/Dropout.cpp ``dropout``: on CUDA (``is_fused_kernel_acceptable``) it runs
    ``native_dropout``, which keeps a 1-byte bool mask for backward; on other devices, meta
    included, it decomposes into ``empty_like(input).bernoulli_()`` and keeps a noise tensor of
    the input's dtype (2 or 4 bytes per element). Calling ``native_dropout`` directly records the
    CUDA mask wherever the model runs.
    """

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        return torch.native_dropout(x, self.p, True)[0]

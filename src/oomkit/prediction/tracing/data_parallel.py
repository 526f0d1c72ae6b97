"""``torch.nn.DataParallel`` as on a machine of one GPU, whose tensors land on meta.

torch/nn/parallel/data_parallel.py ``forward`` with one device id (``device_count()`` is 1 in a
recording: ``cuda_device.as_one_cuda_gpu``): the scatter puts each input on that device
(comm.scatter: a tensor already there is its own chunk, no copy; a CPU one is copied) and the
module runs once, on the one replica it is. Its check that the parameters are on ``cuda:0``
would read the meta device as another device, so the forward is that, run directly. With more
device ids (a machine of several GPUs) it is torch's own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_map

__all__ = ["data_parallel_on_one_gpu"]


@contextlib.contextmanager
def data_parallel_on_one_gpu() -> Iterator[None]:
    """While open, ``DataParallel.forward`` on one device runs as the module docstring says."""
    original = torch.nn.DataParallel.forward

    def forward(self: Any, *inputs: Any, **kwargs: Any) -> Any:
        if len(self.device_ids) != 1:
            return original(self, *inputs, **kwargs)
        args, kwargs = tree_map(_on_the_device, (inputs, kwargs))
        return self.module(*args, **kwargs)

    torch.nn.DataParallel.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.DataParallel.forward = original  # type: ignore[method-assign]


def _on_the_device(value: Any) -> Any:
    """A tensor put on the one GPU (``.to("cuda")``: meta there); anything else as it is."""
    return value.to("cuda") if isinstance(value, torch.Tensor) else value

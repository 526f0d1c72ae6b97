"""Activations saved to host memory (``torch.autograd.graph.save_on_cpu``), on the emulated GPU.

``save_on_cpu`` (torch/autograd/graph.py) is a ``saved_tensors_hooks`` pair: its pack hook
copies each tensor autograd saves for backward to the host (``tensor.cpu()``, or a copy into a
pinned ``torch.empty(..., pin_memory=True)``), so autograd keeps the host copy and not the
device tensor, whose memory goes back to the caching allocator once the step's own references
to it are gone; its unpack hook copies it back in backward (``tensor.to(device)``): a new
device allocation per saved tensor, made where backward needs it. FSDP's ``offload_wrapper``
(torch/distributed/algorithms/_checkpoint/checkpoint_wrapper.py) is the same hooks.

On the emulated GPU neither copy can run (a meta tensor has no values to copy: "Cannot copy
out of meta tensor"), and pinned memory needs a real accelerator. While :func:`saving_on_host`
is open, ``save_on_cpu`` packs a tensor that stands for device memory (a meta one, or a fake
one of a distributed recording's fake process group: ``fake_storages.stands_for_cuda``) into a
:class:`HostCopy` of its shape, strides and dtype, which holds no device memory, and unpacks it
into a new device tensor of that layout (``torch.empty_strided``: the recorder records it as
backward's allocation). Host memory, pinned or not, is not device memory and is not counted (as
for any host tensor). A host tensor is packed as torch packs it, without pinning (which needs
a real accelerator).

Where it may differ: the copy back to the GPU is made on the current stream, as torch's
``non_blocking`` copy is; its values are unknown, as every device tensor's are here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch._prims_common import compute_elementwise_output_strides
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from oomkit.prediction.tracing.fake_storages import stands_for_cuda

__all__ = ["HostCopy", "saving_on_host"]


@dataclass(frozen=True)
class HostCopy:
    """A device tensor's copy in host memory: what backward's copy back allocates."""

    device: torch.device
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    # A distributed recording's fake mode, where the tensor was one of its fakes; else None.
    fake_mode: FakeTensorMode | None = None


def _pack(tensor: torch.Tensor) -> object:
    if not stands_for_cuda(tensor):
        return None  # a host tensor: torch's own hooks
    # Tensor.cpu()'s copy keeps the layout where it can (empty_like's preserve_format): a
    # dense tensor's strides, else the layout its elements suggest.
    stride = tuple(compute_elementwise_output_strides(tensor))
    fake_mode = tensor.fake_mode if isinstance(tensor, FakeTensor) else None
    return HostCopy(tensor.device, tuple(tensor.shape), stride, tensor.dtype, fake_mode)


def _unpack(packed: HostCopy) -> torch.Tensor:
    # unpack_from_cpu: tensor.to(device), a new device tensor of the host copy's layout.
    # On a fake process group, within the recording's fake mode (the same mode entered again
    # is a no-op), so that the copy is a fake tensor of its device, never real host memory.
    with contextlib.nullcontext() if packed.fake_mode is None else packed.fake_mode:
        return torch.empty_strided(
            packed.size, packed.stride, dtype=packed.dtype, device=packed.device
        )


@contextlib.contextmanager
def saving_on_host() -> Iterator[None]:
    """While open, ``torch.autograd.graph.save_on_cpu`` offloads the emulated GPU's saved
    tensors as described above; its own hooks serve host tensors. Restored on exit."""
    save_on_cpu = torch.autograd.graph.save_on_cpu
    own_init = save_on_cpu.__init__

    def init(
        self: torch.autograd.graph.save_on_cpu, pin_memory: bool = False, device_type: str = "cuda"
    ) -> None:
        # Pinned or not, host memory is not counted; torch's own pinning needs a real
        # accelerator (torch.empty(..., pin_memory=True) raises without one).
        own_init(self, False, device_type)
        own_pack, own_unpack = self.pack_hook, self.unpack_hook

        def pack(tensor: torch.Tensor) -> object:
            packed = _pack(tensor)
            return own_pack(tensor) if packed is None else packed

        def unpack(packed: object) -> torch.Tensor:
            return _unpack(packed) if isinstance(packed, HostCopy) else own_unpack(packed)

        torch.autograd.graph.saved_tensors_hooks.__init__(self, pack, unpack)

    save_on_cpu.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        save_on_cpu.__init__ = own_init  # type: ignore[method-assign]

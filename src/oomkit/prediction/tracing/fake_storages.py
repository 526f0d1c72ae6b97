"""Fake tensors' storages as device memory: what the recorder accounts under ``FakeTensorMode``.

``torch.distributed`` cannot run on the meta device (FSDP2 refuses meta parameters at lazy init,
torch/distributed/fsdp/_fully_shard/_fsdp_param.py ``reset_sharded_param``), but it runs under
``FakeTensorMode`` on a fake process group. A ``FakeTensor`` reports its fake device (``cpu``
here) while its ``StorageImpl`` lives on the meta device (torch/_subclasses/fake_tensor.py
``FakeTensor.__new__`` wraps a meta ``elem``), and that storage is reference counted exactly as a
meta tensor's: views, ``.grad``, autograd's saved variables all hold it. So the recorder accounts
fake tensors through the same storage table, by their meta storage, allocations and frees by
lifetime as for meta tensors (``storages.py``).

Two rules make a fake world look like one CUDA device's memory:
- A wrapper subclass with one inner tensor (DTensor: ``_local_tensor``) holds no memory of its
  own; its inner tensor's storage is what the rank holds (torch/distributed/tensor/_api.py
  ``DTensor.__tensor_flatten__``).
- Tensors made from Python data (``torch.tensor(0.0)``: ``aten.lift_fresh``) are host memory, as
  they are on a CUDA run unless given ``device="cuda"`` (AdamW's ``step`` counters:
  torch/optim/adam.py ``_init_group``, "Deliberately host `step` on CPU"). In a fake world every
  tensor shares one fake device, so ``distributed.HOST_TENSOR_EMULATIONS`` marks those storages
  as host (:func:`mark_host`).

The CUDA emulations (``emulations/``) apply to tensors that :func:`stands_for_cuda`: meta
tensors, and fake tensors that are not host memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from oomkit.prediction.tracing._modes import untraced

__all__ = [
    "detach_saved",
    "fake_tensor_storage",
    "host_tensor",
    "is_fake_or_wrapper",
    "mark_host",
    "stands_for_cuda",
]

# Set on the (preserved) Python storage object of a host tensor; see storages.py for why the
# object lives exactly as long as its StorageImpl.
_HOST_ATTR = "_oomkit_host_memory"

# torchao's float8 all-gather weight (torchao/float8/fsdp_utils.py): the memory it stands for
# is its weight, ``_tensor``. Its __tensor_flatten__ is not asked: once torchao's
# precompute_float8_dynamic_scale_for_fsdp has set ``_precomputed_scale`` (a 0-d view of the one
# scales tensor it keeps for all the module's float8 weights, accounted by its own storage) it
# tests ``if self._precomputed_scale``, a read of a value a fake tensor has not.
_TORCHAO_FLOAT8_WEIGHT = "torchao.float8.fsdp_utils.WeightWithDynamicFloat8CastTensor"


def mark_host(tensor: torch.Tensor) -> None:
    """Record that the fake ``tensor``'s storage is host memory, not device memory."""
    if isinstance(tensor, FakeTensor):
        setattr(tensor.untyped_storage(), _HOST_ATTR, True)


def host_tensor(make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``make()``, a tensor CUDA would keep in host memory (``device="cpu"``), made unrecorded and,
    on a fake process group, whose every tensor has the host's fake device, marked as host."""
    with untraced():
        tensor = make()
    mark_host(tensor)
    return tensor


def stands_for_cuda(tensor: Any) -> bool:
    """Whether ``tensor`` stands for CUDA memory while tracing: meta, or fake and not host.

    A ``FunctionalTensor`` (what AOTAutograd traces a compiled graph with,
    torch/_subclasses/functional_tensor.py) stands for what it wraps (``torch._from_functional_tensor``
    of its ``elem``): on the fake group, a fake tensor of the ``cpu`` fake device.
    """
    if isinstance(tensor, FunctionalTensor):
        tensor = torch._from_functional_tensor(tensor.elem)
    device = getattr(tensor, "device", None)
    if device is not None and device.type == "meta":
        return True
    if isinstance(tensor, FakeTensor):
        storage = tensor.untyped_storage()
        return storage.device.type == "meta" and not getattr(storage, _HOST_ATTR, False)
    return False


def is_fake_or_wrapper(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a FakeTensor or a wrapper subclass (DTensor): see this module."""
    return isinstance(tensor, FakeTensor) or is_traceable_wrapper_subclass(tensor)


def fake_tensor_storage(tensor: torch.Tensor, device_type: str) -> torch.UntypedStorage | None:
    """The device storage a FakeTensor or a one-tensor wrapper subclass stands for, if any.

    Args:
        tensor: a tensor for which :func:`is_fake_or_wrapper` holds.
        device_type: the device whose storages stand for CUDA memory (``"meta"``).

    Returns:
        The meta storage of the fake tensor (of the wrapped one for DTensor, or the wrapped real
        tensor's storage on ``device_type``; the weight of torchao's float8 all-gather wrapper,
        not its precomputed scale); None for host tensors made from Python data, wrappers of
        several tensors and other devices.
    """
    if isinstance(tensor, FakeTensor):
        storage = tensor.untyped_storage()
        if storage.device.type != device_type or getattr(storage, _HOST_ATTR, False):
            return None
        return storage
    if f"{type(tensor).__module__}.{type(tensor).__qualname__}" == _TORCHAO_FLOAT8_WEIGHT:
        inner_names = ["_tensor"]
    else:
        # torch 2.13's DTensor also lists its (opaque) device mesh among the inner attributes.
        inner_names, _ = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
    inner = [getattr(tensor, name) for name in inner_names]
    tensors = [t for t in inner if isinstance(t, torch.Tensor)]
    if len(tensors) != 1:
        return None
    if is_fake_or_wrapper(tensors[0]):
        return fake_tensor_storage(tensors[0], device_type)
    # A real DTensor (SimulatedCudaDevice running FSDP2 on gloo): its local tensor's storage.
    if tensors[0].device.type != device_type:
        return None
    return tensors[0].untyped_storage()


def detach_saved(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor.detach()`` for autograd's saved-tensor pack hook; a real tensor saved under
    ``FakeTensorMode`` comes back as a fake one marked host (:func:`mark_host`).

    A real tensor (neither meta, fake nor a wrapper subclass) saved while a fake world records
    is an RNG state: a compiled selective checkpoint's forward saves it for the backward's
    recompute of a seeded op (torch/_functorch/partitioners.py ``functionalize_rng_ops``), and
    ``run_and_save_rng_state`` returns ``torch.get_rng_state()``, the CPU generator's 5056-byte
    state, for the fake group's ``cpu`` device, where a GPU saves its generator's seed and
    offset, on the host too (torch/_prims/rng_prims.py ``register_run_and_save_rng_state_op``).
    ``FakeTensorMode`` refuses real inputs, both to ``detach`` and to the backward's
    ``run_with_rng_state`` (whose fake kernel ignores the state), so it is saved as the fake
    tensor AOTAutograd itself traced it as (partitioners.py ``get_sample_rng_state``:
    ``fake_mode.from_tensor``); as host memory, no device allocation is recorded for it.
    """
    if tensor.device.type == "meta" or is_fake_or_wrapper(tensor):
        return tensor.detach()
    fake_mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
    if fake_mode is None:
        return tensor.detach()
    with unset_fake_temporarily():
        fake = fake_mode.from_tensor(tensor.detach())
    mark_host(fake)
    return fake

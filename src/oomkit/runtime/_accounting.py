"""The dispatch mode behind ``SimulatedCudaDevice``: every op's new storages become allocations.

Written for the simulated device, not shared with ``oomkit.prediction.tracing.Tracer``: the Tracer records
a step to replay it later (with CUDA emulations, roles, categories); this mode asks the
simulated allocator *now*, so that an allocation that would not fit raises ``torch.
OutOfMemoryError`` inside the op that made it, exactly where CUDA would raise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from oomkit.prediction.tracing.storages import Allocation

if TYPE_CHECKING:
    from oomkit.core.allocator import SimulatedOutOfMemoryError
    from oomkit.runtime.simulated import SimulatedCudaDevice

__all__ = [
    "AccountingMode",
    "Allocation",
    "storage_resize_accounted",
    "tensor_storage",
    "tensors_of",
]


def tensor_storage(tensor: torch.Tensor, device_type: str) -> torch.UntypedStorage | None:
    """The storage of ``tensor`` if it lives on ``device_type`` and has one, else None."""
    if tensor.device.type != device_type or tensor.is_sparse:
        return None
    try:
        return tensor.untyped_storage()
    except (NotImplementedError, RuntimeError):
        # Tensors without a storage (nested, some wrapper subclasses) hold no device memory
        # of their own here; what they wrap is seen when the wrapped tensors are.
        return None


class AccountingMode(TorchDispatchMode):
    """Accounts every storage an aten op creates or grows on the simulated device.

    Before the op, storages of inputs not seen yet (a model built before the device was
    entered) are accounted; after it, the outputs' new storages in order, then arguments the op
    resized (``resize_``, ``out=`` variants). The first allocation the simulated allocator
    refuses makes the op raise ``torch.OutOfMemoryError`` with PyTorch's message.
    """

    def __init__(self, device: SimulatedCudaDevice) -> None:
        super().__init__()
        self._device = device

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        error = self._sync_all((args, kwargs), None)
        if error is not None:
            raise self._device._raise_oom(error)
        out = func(*args, **kwargs)
        error = self._sync_all((out, args, kwargs), func)
        if error is not None:
            # Drop the outputs before raising, so their storages (and the blocks already
            # given to them) are freed now, as a failed CUDA op frees its partial outputs; the
            # traceback keeps this frame, not them.
            del out
            raise self._device._raise_oom(error)
        return out

    def _sync_all(self, tree: Any, func: Any) -> SimulatedOutOfMemoryError | None:
        device = self._device
        device_type = device.device_type
        op = None if func is None else str(func)
        for leaf in tree_leaves(tree):
            if isinstance(leaf, torch.Tensor):
                storage = tensor_storage(leaf, device_type)
                if storage is not None:
                    error = device._sync_storage(storage, op)
                    if error is not None:
                        return error
        return None


def tensors_of(objects: tuple[Any, ...]) -> list[torch.Tensor]:
    """Every tensor held by modules, optimizers and (nested) tensors, in a stable order."""
    found: list[torch.Tensor] = []
    for obj in tree_leaves(list(objects)):
        if isinstance(obj, torch.nn.Module):
            for param in obj.parameters():
                found.append(param)
                if param.grad is not None:
                    found.append(param.grad)
            found.extend(obj.buffers())
        elif isinstance(obj, torch.optim.Optimizer):
            for group in obj.param_groups:
                found.extend(p for p in group["params"] if isinstance(p, torch.Tensor))
            for state in obj.state.values():
                found.extend(v for v in tree_leaves(state) if isinstance(v, torch.Tensor))
        elif isinstance(obj, torch.Tensor):
            found.append(obj)
    return found


@contextlib.contextmanager
def storage_resize_accounted(device: SimulatedCudaDevice) -> Iterator[None]:
    """While open, ``UntypedStorage.resize_`` is accounted at once.

    ``storage.resize_(n)`` (FSDP frees and refills flat parameters this way) calls the storage
    implementation directly, without an aten op the dispatch mode could see. CUDA's
    ``resize_bytes`` allocates the new size and frees the old block, or raises without changing
    the storage (aten/src/ATen/native/cuda/Resize.cpp); the wrapper does the same: a refused
    size puts the storage back to its old size and raises ``torch.OutOfMemoryError``.
    """
    original = torch.UntypedStorage.resize_
    own = "resize_" in vars(torch.UntypedStorage)  # else inherited from torch._C.StorageBase

    def resize_(storage: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
        old_size = storage.nbytes()
        result = original(storage, size)
        if storage.device.type == device.device_type:
            error = device._sync_storage(storage, "UntypedStorage.resize_")
            if error is not None:
                original(storage, old_size)
                raise device._raise_oom(error)
        return result

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        if own:
            torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]
        else:
            del torch.UntypedStorage.resize_

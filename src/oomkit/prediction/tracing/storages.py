"""Live storages and their lifetimes: one ``Allocation`` per storage, freed when torch frees it.

A meta tensor has no memory, but its ``StorageImpl`` is reference counted exactly as a CUDA one
is: views, ``nn.Parameter(t)``, autograd's saved variables and ``.grad`` all hold the same
``StorageImpl``. The Python ``UntypedStorage`` object is *preserved* with its ``StorageImpl``
(torch/csrc/Storage.cpp with c10/core/impl/PyObjectSlot.h: once created, the PyObject lives
exactly as long as the C++ storage), so ``weakref.finalize`` on it fires when the storage is
really released, which is when CUDACachingAllocator would get the block back. Checked on torch
2.3.1 to 2.13.0; not so in 2.1.2 (``_torch_version.MIN_TORCH`` is 2.5 for other reasons).
tests/tracing/test_storages.py checks this on the installed torch.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from oomkit.core.trace import Frame
from oomkit.prediction.tracing.categories import Category, Phase, Role, infer_category
from oomkit.prediction.tracing.fake_storages import fake_tensor_storage, is_fake_or_wrapper

__all__ = ["Allocation", "StorageTable", "parameter_name", "tensor_storage", "tensors_of"]


@dataclass(eq=False)
class Allocation:
    """One device allocation seen by the recorder; roles keep growing while the step runs."""

    alloc_id: int
    size_bytes: int
    phase: Phase
    module: str | None
    op: str | None
    frames: tuple[Frame, ...]
    root_call: int | None = None
    roles: set[Role] = field(default_factory=set)
    explicit: Category | None = None
    live: bool = True
    # The module owning the parameter this storage serves (parameter, its grad, its state).
    owner: weakref.ref[torch.nn.Module] | None = None
    # The parameter's name in that module (``weight``), and for optimizer state the optimizer's
    # class (``AdamW``): what the verdict names at an OOM in the optimizer step.
    param_name: str | None = None
    optimizer: str | None = None
    # What an emulation hook allocated it for (``"cublas_workspace"``); None for a storage.
    emulated: str | None = None
    # The CUDA stream it was allocated on; its block goes back to that stream's pool.
    stream: int = 0

    @property
    def category(self) -> Category:
        """The category implied by what has been observed so far."""
        return infer_category(self.roles, self.phase, self.explicit)


def parameter_name(module: torch.nn.Module | None, param: object) -> str | None:
    """The name ``module`` registered ``param`` under (``weight``), if it still holds it."""
    if module is None:
        return None
    return next((n for n, p in module.named_parameters(recurse=False) if p is param), None)


def tensor_storage(tensor: object, device_type: str) -> torch.UntypedStorage | None:
    """The storage of ``tensor`` if it is a tensor on ``device_type`` with one, else None.

    A FakeTensor's storage is on meta whatever device it reports, and a DTensor's is its local
    tensor's (``fake_storages.py``).
    """
    if not isinstance(tensor, torch.Tensor):
        return None
    if type(tensor) is not torch.Tensor and is_fake_or_wrapper(tensor):
        return fake_tensor_storage(tensor, device_type)
    if tensor.device.type != device_type or tensor.is_sparse:
        return None
    try:
        return tensor.untyped_storage()
    except (NotImplementedError, RuntimeError):
        # Tensors without a storage (nested, some wrapper subclasses) hold no device memory
        # of their own here; what they wrap is seen when the wrapped tensors are.
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


class StorageTable:
    """Maps live storages to their current ``Allocation`` and reports when a storage dies."""

    def __init__(self, on_release: Callable[[Allocation], None]) -> None:
        self._on_release = on_release
        # Keyed by the StorageImpl address (``UntypedStorage._cdata``): stable while the storage
        # lives, and the finalizer removes the key before the address can be reused.
        self._by_key: dict[int, Allocation] = {}
        self._finalizers: dict[int, weakref.finalize] = {}
        self._closed = False

    def lookup(self, storage: torch.UntypedStorage) -> Allocation | None:
        """The live allocation backing ``storage``, if it is known."""
        return self._by_key.get(storage._cdata)

    def bind(self, storage: torch.UntypedStorage, alloc: Allocation) -> Allocation | None:
        """Make ``alloc`` the allocation of ``storage``; returns the one it replaces (resize)."""
        key = storage._cdata
        previous = self._by_key.get(key)
        self._by_key[key] = alloc
        if key not in self._finalizers:
            finalizer = weakref.finalize(storage, self._released, key)
            finalizer.atexit = False
            self._finalizers[key] = finalizer
        return previous

    def unbind(self, storage: torch.UntypedStorage) -> Allocation | None:
        """Forget the allocation of a storage that shrank to zero bytes; returns it."""
        return self._by_key.pop(storage._cdata, None)

    def live(self) -> Iterator[Allocation]:
        """Allocations whose storage is still alive."""
        return iter(list(self._by_key.values()))

    def close(self) -> None:
        """Stop watching: storages that die from now on are not reported."""
        self._closed = True
        for finalizer in self._finalizers.values():
            finalizer.detach()
        self._finalizers.clear()
        self._by_key.clear()

    def _released(self, key: int) -> None:
        # Runs inside a decref, possibly in the middle of an op: only bookkeeping here.
        self._finalizers.pop(key, None)
        alloc = self._by_key.pop(key, None)
        if alloc is not None and not self._closed:
            self._on_release(alloc)

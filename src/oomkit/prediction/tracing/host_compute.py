"""A torchrun script's host work runs for real on its fake process group.

A distributed recording runs under ``FakeTensorMode`` (``distributed.FakeWorld``), which fakes
every tensor made inside it, the host's too. A builder makes little on the host; a whole script
does: a ``DataLoader`` seeds its workers from ``torch.empty((), dtype=torch.int64).random_()``
and a ``DistributedSampler`` shuffles with ``torch.randperm(n).tolist()`` (torch/utils/data),
nanoGPT's ``get_batch`` indexes its data with ``torch.randint`` on the CPU. On a GPU those are
host tensors with values, and the script reads them.

:class:`HostComputeReal` (a ``TorchFunctionMode`` entered innermost, so it sees each call as the
script wrote it, before ``cuda_device`` puts CUDA on the fake device) runs a call with the fake
mode paused (``unset_fake_temporarily``) when it is host work: no fake or meta tensor among its
arguments, and no CUDA named (``device="cuda"``, ``.to(local_rank)``, ``.cuda()``, a CUDA default
device). Its tensors are then real CPU tensors, with values, and not device memory (the
recorder records only what stands for CUDA: ``fake_storages.stands_for_cuda``). Moving one to
CUDA (``.to("cuda")``, ``.cuda()``) is a host-to-device copy of its fake twin
(``FakeTensorMode.from_tensor``, marked host: ``cuda_device._host_copied``). Brought back
(``.cpu()``) while provably unchanged (its version counter as at the copy, or moved on only by
a broadcast from the recorded rank, which leaves it as it was: accelerate broadcasts its RNG
state so), the copy is the host tensor's values again; otherwise it stays fake. Mixing it with
device tensors goes the usual way: the fake mode takes it as an input
(``FakeTensorMode(allow_non_fake_inputs=True)``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from oomkit.prediction.tracing.cuda_device import cuda_default, is_cuda
from oomkit.prediction.tracing.fake_storages import mark_host
from oomkit.prediction.tracing.stand_ins import is_hidden_file

__all__ = ["HostComputeReal"]

# Calls that concern the device even on a host tensor: left to cuda_device's rules.
_DEVICE_CALLS = frozenset(
    {torch.Tensor.cuda, torch.Tensor.pin_memory, torch.Tensor.is_pinned, torch.Tensor.to}
)


class HostComputeReal(TorchFunctionMode):
    """Runs host work with real tensors inside a distributed recording (module docstring).

    Args:
        fake_mode: the recording's ``FakeTensorMode`` (``FakeWorld.fake_mode``).
    """

    def __init__(self, fake_mode: FakeTensorMode) -> None:
        super().__init__()
        self._fake_mode = fake_mode
        # A device copy of a host tensor -> (the host tensor, the copy's version while it still
        # holds the host tensor's values); an entry goes with its copy (weak, by identity).
        self._copies: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():
            return func(*args, **kwargs)
        if _host_work(func, args, kwargs) and not _from_distributed_code():
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        if func in _MOVES and args and _real_host_tensor(args[0]):
            # To CUDA: its fake twin, host memory, which the move copies onto the device.
            host = args[0]
            twin = self._fake_mode.from_tensor(host)
            mark_host(twin)
            out = func(twin, *args[1:], **kwargs)
            if isinstance(out, FakeTensor) and out is not twin:
                self._copies[out] = (host, out._version)
            return out
        if func in _BACK_TO_HOST and args and isinstance(args[0], FakeTensor):
            host = self._unchanged_host(args[0])
            if host is not None and _to_host(func, args, kwargs):
                with unset_fake_temporarily():
                    return host.clone()
        return func(*args, **kwargs)

    def _unchanged_host(self, copy: torch.Tensor) -> torch.Tensor | None:
        """The host tensor ``copy`` was made from, while it holds the same values."""
        host, version = self._copies.get(copy, (None, -1))
        return host if copy._version == version else None

    @contextlib.contextmanager
    def broadcasts_kept(self) -> Iterator[None]:
        """``torch.distributed.broadcast(t, src)`` from the recorded rank leaves ``t``'s
        values as they were: a device copy of a host tensor still holds them after it."""
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        original = c10d.broadcast

        def broadcast(tensor: torch.Tensor, src: int | None = None, *args: Any,
                      **kwargs: Any) -> Any:
            work = original(tensor, src, *args, **kwargs)
            host, _ = self._copies.get(tensor, (None, -1))
            if host is not None and src == dist.get_rank():
                self._copies[tensor] = (host, tensor._version)
            return work

        with contextlib.ExitStack() as stack:
            for module in (dist, c10d):
                # By name: torch.distributed defines broadcast only in builds with distributed.
                stack.callback(setattr, module, "broadcast", getattr(module, "broadcast"))  # noqa: B009
                setattr(module, "broadcast", broadcast)  # noqa: B010
            yield


_MOVES = (torch.Tensor.to, torch.Tensor.cuda)
_BACK_TO_HOST = (torch.Tensor.cpu, torch.Tensor.to)


def _to_host(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the call is ``.cpu()`` or ``.to("cpu")`` (a plain move, no cast)."""
    if func is torch.Tensor.cpu:
        return not kwargs
    device = args[1] if len(args) == 2 and not kwargs else kwargs.get("device")
    if len(args) > 2 or set(kwargs) - {"device", "non_blocking"}:
        return False
    return isinstance(device, torch.device | str) and torch.device(device).type == "cpu"


# torch's parallel code (FSDP2, DDP, DTensor, collectives) names the fake group's device, "cpu",
# for what is CUDA memory on a GPU (its all-gather outputs, its shards): its calls stay fake.
_DISTRIBUTED_CODE = (f"{os.sep}torch{os.sep}distributed{os.sep}",
                     f"{os.sep}torch{os.sep}nn{os.sep}parallel{os.sep}")


def _from_distributed_code() -> bool:
    """Whether torch's parallel code made the call: the frames above it, up to the first that is
    neither torch's nor oomkit's nor the standard library's, include one of its files."""
    frame: types.FrameType | None = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if any(part in name for part in _DISTRIBUTED_CODE):
            return True
        if not (name.startswith(_TORCH_ROOT) or is_hidden_file(name)):
            return False
        frame = frame.f_back
    return False


_TORCH_ROOT = os.path.dirname(torch.__file__) + os.sep


def _real_host_tensor(value: Any) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and not isinstance(value, FakeTensor)
        and value.device.type == "cpu"
    )


def _host_work(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    leaves = tree_leaves((args, kwargs))
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and (isinstance(leaf, FakeTensor) or leaf.is_meta):
            return False
        if isinstance(leaf, torch.device | str) and is_cuda(leaf):
            return False
    if func in _DEVICE_CALLS:
        # .to(dtype) of a host tensor stays on the host; .to(0) / .to(local_rank) is CUDA.
        return func is torch.Tensor.to and not any(
            is_cuda(a) for a in (*args[1:2], kwargs.get("device"))
        )
    if any(isinstance(leaf, torch.Tensor) for leaf in leaves):
        return True
    # A factory: on the host when its device is, or unnamed under a host default device. A
    # meta one (FSDP2's deferred init) stays the fake mode's.
    device = kwargs.get("device")
    if device is None:
        return cuda_default() is None
    # device=local_rank, a bare index, is CUDA's (torch.device(0) would ask for the accelerator).
    return not is_cuda(device) and torch.device(device).type == "cpu"

"""The one CUDA emulation engine: runs torch ops on meta/CPU tensors and accounts their storages.

Both users of it sit on top of the same loop: ``Tracer`` (records a step to replay it later) and
``oomkit.runtime.SimulatedCudaDevice`` (asks a live simulated allocator at once, so an allocation
that does not fit raises inside the op that made it, as CUDA would). The engine intercepts every
aten op (a ``TorchDispatchMode``) and the watched Python functions (a ``TorchFunctionMode``),
runs the registered CUDA emulations in place of the plain op (``emulation.EmulationContext``),
and keeps one ``Allocation`` per live storage (``storages.StorageTable``). What an allocation
*is* (its id, its tags, whether it fits) is the sink's business: an ``AllocationSink``.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import torch

from oomkit.core.gpus import GpuSpec
from oomkit.prediction.tracing._leaves import tensor_leaves
from oomkit.prediction.tracing._modes import (
    DivergenceFunctionMode,
    OpDispatchMode,
    watched_functions,
)
from oomkit.prediction.tracing.categories import Category, Phase
from oomkit.prediction.tracing.emulation import EmulationContext, OpEmulation
from oomkit.prediction.tracing.storages import Allocation, StorageTable, tensor_storage

__all__ = ["AllocationSink", "CudaEmulationEngine"]


class AllocationSink(Protocol):
    """What the engine asks of its user: make, free and refuse allocations."""

    def allocate(self, size_bytes: int, op: str | None, *, first_seen: bool) -> Allocation | Exception:
        """A new allocation of ``size_bytes`` made by ``op``, or the error if it does not fit.

        ``first_seen`` is True for a storage an op uses before the engine saw it made.
        """
        ...

    def free(self, alloc: Allocation) -> None:
        """``alloc`` is given back now (a resized storage's old block, a synthetic free)."""
        ...

    def storage_released(self, alloc: Allocation) -> None:
        """The storage of ``alloc`` died (runs inside a decref, possibly mid-op)."""
        ...

    def refused(self, error: Exception) -> BaseException:
        """The exception an op raises when ``error`` came back from :meth:`allocate`."""
        ...

    def op_failed(self, op: str, error: BaseException) -> None:
        """``op`` (or its emulation hook) raised ``error``."""
        ...

    def phase(self) -> Phase:
        """Where the step is: ``forward``, ``backward`` (autograd's thread on CUDA), ..."""
        ...


class CudaEmulationEngine:
    """Runs ops as a CUDA device would, memory-wise, and hands each storage to a sink.

    Attributes:
        sink: where allocations go.
        gpu: the target device the emulations model.
        device_type: the torch device whose storages stand for CUDA memory.
        table: the live storages and their allocations.
        state: scratch space shared by the emulation hooks (e.g. which cuBLAS handles exist).
        divergent_calls: calls of ``divergent_ops`` that ran with no hook, by name.
        partial_calls: (op, what is left out) -> calls only partly emulated.
        kernel_choices: kernel choices the hooks made (``"SDPA flash_attention"``) -> calls.
        assumptions: facts about the target the choices rest on (``"cuDNN"`` -> version).
        sites: (kind, params, the allocation id of the op's output) of each call whose
            temporaries depend on a size (``oomkit.prediction.tracing.emulation_sites``), in order.
    """

    def __init__(
        self,
        sink: AllocationSink,
        *,
        gpu: GpuSpec,
        device_type: str,
        emulations: Mapping[str, OpEmulation],
        divergent_ops: Mapping[str, str],
    ) -> None:
        """Create the engine; nothing is intercepted until :meth:`intercept` is entered.

        Args:
            sink: makes, frees and refuses allocations.
            gpu: the target device the emulations model.
            device_type: ``"meta"`` or ``"cpu"``: whose storages are accounted.
            emulations: hooks by aten overload or dotted torch function name.
            divergent_ops: ops whose CUDA memory differs from what meta records (name ->
                reason); a call with no hook is counted in :attr:`divergent_calls`.
        """
        self.sink = sink
        self.gpu = gpu
        self.device_type = device_type
        self._emulations = emulations
        self._divergent_ops = divergent_ops
        self.table = StorageTable(sink.storage_released)
        self.state: dict[str, Any] = {}
        self._synthetic: dict[int, Allocation] = {}
        self.divergent_calls: Counter[str] = Counter()
        self.partial_calls: Counter[tuple[str, str]] = Counter()
        self.kernel_choices: Counter[str] = Counter()
        self.assumptions: dict[str, str] = {}
        self.sites: list[tuple[str, tuple[int, ...], int]] = []

    def partial_warnings(self) -> list[str]:
        """One warning per part of the CUDA memory left out, naming each op that leaves it out
        (a convolution's forward and backward both leave out cuDNN's workspace)."""
        ran_by_part: dict[str, list[str]] = {}
        for (name, what), count in sorted(self.partial_calls.items()):
            ran_by_part.setdefault(what, []).append(f"{name} ran {count} time(s)")
        return [
            f"{', '.join(ran)}; {'its' if len(ran) == 1 else 'their'} CUDA memory is emulated "
            f"except {what}, which is not included"
            for what, ran in ran_by_part.items()
        ]

    # ------------------------------------------------------------------ interception

    def emulation(self, name: str) -> OpEmulation | None:
        """The hook registered for ``name`` (an aten overload or a dotted torch function),
        ``None`` without one: the compiled path runs the same hook as the eager one."""
        return self._emulations.get(name)

    @contextlib.contextmanager
    def intercept(self) -> Iterator[None]:
        """While open, every op and watched function runs through the engine."""
        with contextlib.ExitStack() as stack:
            watched = watched_functions([*self._divergent_ops, *self._emulations])
            if watched:
                function_mode = DivergenceFunctionMode(watched, self.run_function)
                stack.enter_context(function_mode)
                # Torch-function modes do not follow into backward, so checkpoint's
                # recomputation would miss them (and record another SDPA backend than forward did).
                stack.enter_context(function_mode.reach_backward())
            stack.enter_context(OpDispatchMode(self.run_op, self.has_emulation))
            yield

    @contextlib.contextmanager
    def storage_resize_accounted(self) -> Iterator[None]:
        """While open, ``UntypedStorage.resize_`` is accounted at once.

        ``storage.resize_(n)`` (FSDP frees and refills flat parameters this way) calls the
        storage implementation directly, without an aten op the dispatch mode could see. CUDA's
        ``resize_bytes`` allocates the new size and frees the old block, or raises without
        changing the storage (aten/src/ATen/native/cuda/Resize.cpp); the wrapper does the same:
        a refused size puts the storage back to its old size and raises the sink's error.
        """
        original = torch.UntypedStorage.resize_
        own = "resize_" in vars(torch.UntypedStorage)  # else inherited from torch._C.StorageBase
        engine = self

        def resize_(storage: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
            old_size = storage.nbytes()
            result = original(storage, size)
            if storage.device.type == engine.device_type:
                error = engine.sync_storage(storage, "UntypedStorage.resize_")
                if error is not None:
                    original(storage, old_size)
                    raise engine.sink.refused(error)
            return result

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]
        try:
            yield
        finally:
            if own:
                torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]
            else:
                del torch.UntypedStorage.resize_

    # ------------------------------------------------------------------ ops

    def run_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One aten op: its emulation hook or the op, then its new storages in order.

        Before the op, storages of inputs not seen yet are accounted; after it, the outputs'
        new storages in order, then arguments the op resized (``resize_``, ``out=`` variants).
        """
        name = str(func)
        error = self._sync_all((args, kwargs), None, before_op=True)
        if error is not None:
            raise self.sink.refused(error)
        hook = self._emulations.get(name)
        try:
            if hook is not None:
                out = hook(EmulationContext(name, func, args, kwargs, self))
            else:
                out = func(*args, **kwargs)
        except Exception as exc:
            self.sink.op_failed(name, exc)
            raise
        if hook is None and name in self._divergent_ops:
            self.divergent_calls[name] += 1
        # Outputs first (in order), then arguments an op may have resized or re-pointed.
        error = self._sync_all((out, args, kwargs), name, before_op=False)
        if error is not None:
            # Drop the outputs before raising, so their storages (and the blocks already given
            # to them) are freed now, as a failed CUDA op frees its partial outputs; the
            # traceback keeps this frame, not them.
            del out
            raise self.sink.refused(error)
        return out

    def note_site(self, kind: str, params: tuple[int, ...], output: Any) -> None:
        """Note a site (``emulation_sites.EmulationSite``) anchored at ``output``'s allocation,
        which must be accounted already (``record_outputs``); not noted when it is not (a
        tensor on another device, no storage)."""
        storage = tensor_storage(output, self.device_type)
        alloc = None if storage is None else self.table.lookup(storage)
        if alloc is not None:
            self.sites.append((kind, params, alloc.alloc_id))

    def has_emulation(self, name: str) -> bool:
        """Whether ``name`` (an aten overload or torch function name) has an emulation hook."""
        return name in self._emulations

    def run_function(
        self, name: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """A watched torch function: its emulation hook, or the function counted as divergent."""
        hook = self._emulations.get(name)
        if hook is None:
            if name in self._divergent_ops:
                self.divergent_calls[name] += 1
            return func(*args, **kwargs)
        return hook(EmulationContext(name, func, args, kwargs, self))

    def record_outputs(self, outputs: Any, op: str) -> None:
        """Account ``outputs``' new storages now (an emulation's ``ctx.record_outputs``)."""
        error = self._sync_all(outputs, op, before_op=False)
        if error is not None:
            raise self.sink.refused(error)

    # ------------------------------------------------------------------ storages

    def _sync_all(self, tree: Any, op: str | None, *, before_op: bool) -> Exception | None:
        device_type = self.device_type
        for leaf in tensor_leaves(tree):
            storage = tensor_storage(leaf, device_type)
            if storage is not None:
                error = self.sync_storage(storage, op, before_op=before_op)
                if error is not None:
                    return error
        return None

    def sync_storage(
        self, storage: torch.UntypedStorage, op: str | None, *, before_op: bool = False
    ) -> Exception | None:
        """Bring the allocations in line with ``storage``; the refused request, if any.

        A storage not seen yet is a new allocation (``first_seen`` when an op uses it before
        the engine saw it made); one whose size changed (``resize_``) gets an allocation of the
        new size before the old one is freed, as CUDA's ``resize_bytes`` allocates, copies,
        then frees (aten/src/ATen/native/cuda/Resize.cpp).
        """
        table = self.table
        alloc = table.lookup(storage)
        size = storage.nbytes()
        if alloc is not None and alloc.size_bytes == size:
            return None
        if alloc is None and size == 0:
            return None
        if size == 0:
            # resize_(0) (FSDP frees parameters this way): the block goes, the storage lives on.
            assert alloc is not None
            table.unbind(storage)
            self.sink.free(alloc)
            return None
        result = self.sink.allocate(size, op, first_seen=alloc is None and before_op)
        if isinstance(result, Exception):
            return result
        table.bind(storage, result)
        if alloc is not None:
            self.sink.free(alloc)
        return None

    def allocate_synthetic(
        self, size_bytes: int, category: Category, op: str, what: str | None = None
    ) -> int:
        """An allocation no storage backs (an emulated workspace); returns its id."""
        result = self.sink.allocate(size_bytes, op, first_seen=False)
        if isinstance(result, Exception):
            raise self.sink.refused(result)
        result.explicit = category
        result.emulated = what
        self._synthetic[result.alloc_id] = result
        return result.alloc_id

    def free_synthetic(self, alloc_id: int) -> None:
        """Give back an allocation made by :meth:`allocate_synthetic`."""
        alloc = self._synthetic.pop(alloc_id, None)
        if alloc is None:
            raise ValueError(f"allocation id {alloc_id} is not a live synthetic allocation")
        self.sink.free(alloc)

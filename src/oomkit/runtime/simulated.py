"""A simulated CUDA device: real PyTorch code on CPU (or meta), memory accounted as on a GPU.

Inside ``with SimulatedCudaDevice("24GiB") as device:`` every storage that an aten op creates on
the chosen torch device (``"cpu"`` by default) is handed to oomkit's simulated caching allocator
(``oomkit.core.allocator.CachingAllocator``) as a CUDA allocation of its ``nbytes``, and given back
when the storage really dies (``weakref.finalize`` on the preserved ``UntypedStorage``, see
``oomkit.prediction.tracing.storages``). When the simulated allocator cannot serve a request the op raises
the real ``torch.OutOfMemoryError`` with PyTorch's message, so OOM recovery code, batch-size
finders and monitors run unchanged on a machine without a GPU. ``use_device(device)`` is
installed too, so ``oomkit.runtime.current_device()`` answers with the simulated numbers.

The ops run through ``oomkit.prediction.tracing.engine``, the engine the recorder uses: pass
``emulations`` (e.g. the SDPA hook) to run ops as CUDA would; none by default.

What it does not model: streams (everything is on stream 0, frees complete at once), CUDA
kernels' own workspaces (cuBLAS, cuDNN, SDPA backends: the CPU kernels allocate what they
allocate) unless ``emulations`` add them, and host memory: with ``device_type="cpu"`` *every* CPU storage counts, including
data-loader batches that a real run would keep in host memory until ``.to("cuda")``.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import threading
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

from oomkit.core.allocator import AllocatorConfig, CachingAllocator, SimulatedOutOfMemoryError
from oomkit.core.gpus import GpuSpec, get_gpu
from oomkit.core.snapshot import snapshot_to_data
from oomkit.core.trace import Frame, TraceEvent
from oomkit.errors import SimulatedDeviceError, TorchRequiredError
from oomkit.runtime.device import use_device

if TYPE_CHECKING:
    import torch

    from oomkit.prediction.tracing.categories import Phase
    from oomkit.prediction.tracing.emulation import OpEmulation
    from oomkit.prediction.tracing.engine import CudaEmulationEngine
    from oomkit.prediction.tracing.storages import Allocation

__all__ = ["OomObserver", "SimulatedCudaDevice"]

# fn(device, alloc_size, allowed_max_or_device_total, device_free), as
# torch._C._cuda_attach_out_of_memory_observer observers are called (ref §4 step 10).
OomObserver = Callable[[int, int, int, int], Any]

_DEVICE_TYPES = ("cpu", "meta")
# The one simulated device that may be active: two would both account the same storages.
_active: list[SimulatedCudaDevice] = []



class SimulatedCudaDevice:
    """A GPU of a chosen size, simulated on CPU; implements ``oomkit.runtime.DeviceMemory``.

    Example::

        with SimulatedCudaDevice("24GiB", context_overhead_bytes=0) as device:
            model = torch.nn.Linear(1024, 1024)      # accounted as CUDA allocations
            loss = model(x).sum(); loss.backward()
            device.max_memory_allocated()             # what torch.cuda would report

    Storages that existed before the ``with`` block are accounted when :meth:`track` is called
    or, failing that, when an op first uses them. The device is not reentrant and only one can
    be active at a time; entering it again after it exited continues with the same state
    (frees of its storages are accounted in between too).

    Attributes:
        gpu: the simulated device (total memory and CUDA context size).
        config: the allocator setting in effect.
        allocator: the simulated caching allocator (read-only use: stats, snapshot).
        device_type: the torch device whose storages are accounted (``"cpu"`` or ``"meta"``).
        name: ``"simulated <gpu name>"``.
        oom_count: how many ``torch.OutOfMemoryError`` it raised.
        last_oom: the simulator's error behind the last one (requested and rounded bytes), or
            None.
    """

    def __init__(
        self,
        gpu: str | GpuSpec = "24GiB",
        *,
        alloc_conf: str | AllocatorConfig | None = None,
        context_overhead_bytes: int | None = None,
        torch_version: str | None = None,
        device_type: str = "cpu",
        record_history: bool = False,
        max_entries: int = sys.maxsize,
        get_time_us: Callable[[], int] | None = None,
        emulations: Mapping[str, OpEmulation] | None = None,
    ) -> None:
        """Create the device; nothing is installed until the ``with`` block starts.

        Args:
            gpu: a catalog name (``"a100-40gb"``), a size (``"24GiB"``) or a ``GpuSpec``.
            alloc_conf: a ``PYTORCH_CUDA_ALLOC_CONF`` value or ``AllocatorConfig``; ``None`` is
                PyTorch's default (the environment is not read).
            context_overhead_bytes: device memory held outside the allocator (CUDA context);
                ``None`` uses the GPU's estimate. Pass 0 for round numbers in tests.
            torch_version: the PyTorch version whose allocator to model; ``None`` = newest.
            device_type: which torch device's storages stand for CUDA memory: ``"cpu"`` to run
                real code, ``"meta"`` to run a step without compute (no values, no data-
                dependent ops).
            record_history: keep trace events (with the user's frame) for :meth:`events` and
                :meth:`snapshot`, as ``torch.cuda.memory._record_memory_history()`` does.
            max_entries: keep at most this many trace events (the newest), as
                ``_record_memory_history(max_entries=...)``.
            get_time_us: clock for the events' ``time_us``; ``None`` leaves it unset.
            emulations: CUDA emulation hooks by aten overload or torch function name (see
                ``oomkit.prediction.tracing.emulation``), run on ``gpu`` in place of the plain
                op; their synthetic allocations are accounted like storages. ``None``: none.

        Raises:
            UnknownGpuError: ``gpu`` is neither a catalog GPU nor a size with a unit.
            ConfigError: ``alloc_conf`` is a setting PyTorch would reject.
            GpuSpecError: ``context_overhead_bytes`` is negative or not below the total.
            SimulatedDeviceError: an unknown ``device_type`` or a ``max_entries`` below 1.
        """
        if device_type not in _DEVICE_TYPES:
            raise SimulatedDeviceError(
                f"device_type must be 'cpu' or 'meta'; got {device_type!r}. Use 'cpu' to run "
                "real code, 'meta' to run a step without compute."
            )
        if max_entries < 1:
            raise SimulatedDeviceError(
                f"max_entries must be at least 1; got {max_entries}. Example: max_entries=100000"
            )
        try:
            # torch is imported here, not with the module: oomkit.runtime imports without it.
            from oomkit.prediction.tracing import storages
            from oomkit.prediction.tracing.engine import CudaEmulationEngine
            from oomkit.prediction.tracing.frames import UserFrameFinder
        except ImportError as exc:
            raise TorchRequiredError(
                "SimulatedCudaDevice runs PyTorch code and needs torch; install it with "
                "`pip install oomkit[torch]`"
            ) from exc
        self._storages = storages
        self.gpu = get_gpu(gpu, context_overhead_bytes=context_overhead_bytes)
        self.config = AllocatorConfig.coerce(alloc_conf, torch_version)
        self.torch_version = torch_version
        self.allocator = CachingAllocator(
            self.config,
            capacity_bytes=self.gpu.total_memory_bytes,
            reserved_outside_bytes=self.gpu.context_overhead_bytes,
            torch_version=torch_version,
        )
        self.device_type = device_type
        self.name = f"simulated {self.gpu.name}"
        self.record_history = record_history
        self.oom_count = 0
        self.last_oom: SimulatedOutOfMemoryError | None = None
        self._get_time_us = get_time_us
        self._frame_finder = UserFrameFinder()
        self._frames = self._frame_finder if record_history else None
        self._events: collections.deque[TraceEvent] = collections.deque(maxlen=max_entries)
        self._observers: list[OomObserver] = []
        # Runs the ops (and ``emulations``) and keeps the live storages, as for the recorder.
        self._engine: CudaEmulationEngine = CudaEmulationEngine(
            _DeviceSink(self),
            gpu=self.gpu,
            device_type=device_type,
            emulations=emulations or {},
            divergent_ops={},
        )
        # Live allocations by block address (frames for the snapshot's blocks).
        self._live: dict[int, Allocation] = {}
        # Frees reported while the allocator is busy (a finalizer run by a gc pass inside
        # malloc, or another thread) wait here; CUDACachingAllocator takes a mutex instead.
        self._pending: collections.deque[Allocation] = collections.deque()
        self._lock = threading.Lock()
        self._entered = False
        self._stack: contextlib.ExitStack | None = None

    # ------------------------------------------------------------------ context manager

    def __enter__(self) -> SimulatedCudaDevice:
        if self._entered:
            raise SimulatedDeviceError(
                f"{self.name} is already active; it is not reentrant. Use one `with` block."
            )
        if _active:
            raise SimulatedDeviceError(
                f"another simulated device ({_active[-1].name}) is active; exit it first, only "
                "one SimulatedCudaDevice can account storages at a time"
            )
        with contextlib.ExitStack() as stack:
            stack.enter_context(use_device(self))
            stack.enter_context(self._engine.storage_resize_accounted())
            stack.enter_context(self._engine.intercept())
            self._stack = stack.pop_all()
        self._entered = True
        _active.append(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self._entered:
            return
        self._entered = False
        _active.remove(self)
        stack, self._stack = self._stack, None
        assert stack is not None
        stack.__exit__(exc_type, exc, tb)

    @property
    def active(self) -> bool:
        """Whether the ``with`` block is open."""
        return self._entered

    # ------------------------------------------------------------------ accounting

    def track(self, *objects: Any) -> None:
        """Account storages that exist already as allocated now.

        Args:
            objects: ``nn.Module`` (parameters, buffers and their ``.grad``), ``torch.optim``
                optimizers (their state) and tensors, possibly nested in lists, tuples and
                dicts. Storages on other devices and ones seen before are skipped.

        Raises:
            torch.OutOfMemoryError: they do not fit on the simulated device.
        """
        for tensor in self._storages.tensors_of(objects):
            storage = self._storages.tensor_storage(tensor, self.device_type)
            if storage is None:
                continue
            error = self._engine.sync_storage(storage, None)
            if error is not None:
                raise self._raise_oom(error)

    def _malloc(self, size: int, op: str | None) -> Allocation | SimulatedOutOfMemoryError:
        frames = self._frames.find() if self._frames is not None else ()
        allocator = self.allocator
        with self._lock:
            self._drain_locked()
            mark = len(allocator.segment_log)
            try:
                ptr = allocator.malloc(size)
            except SimulatedOutOfMemoryError as error:
                self._segment_events(mark, frames)
                if not error.rejected:
                    # Step 10: the oom trace entry holds device_free and the rounded size.
                    self._record("oom", error.free_bytes, error.rounded_bytes, frames)
                self._drain_locked()
                # The traceback's frames link back (f_back) to the op being accounted and its
                # outputs: dropping it lets those die when the op raises.
                error.__traceback__ = None
                failure = error
            else:
                self._segment_events(mark, frames)
                self._record("alloc", ptr, size, frames)
                alloc = self._storages.Allocation(ptr, size, "user", None, op, frames)
                self._live[ptr] = alloc
                self._drain_locked()
                return alloc
        if not failure.rejected:
            # Observers run after the allocator's lock is released, as PyTorch calls them
            # after unlocking (they may read the stats).
            allowed = failure.allowed_bytes
            total = allowed if allowed is not None else failure.capacity_bytes
            for observer in list(self._observers):
                observer(self.allocator.device, failure.alloc_size_bytes, total, failure.free_bytes)
        return failure

    def _raise_oom(self, error: Exception) -> torch.OutOfMemoryError:
        """The exception user code sees: torch's own type with the simulator's message."""
        import torch

        assert isinstance(error, SimulatedOutOfMemoryError)
        self.oom_count += 1
        self.last_oom = error
        return torch.OutOfMemoryError(str(error))

    def _on_release(self, alloc: Allocation) -> None:
        # Runs inside a decref, possibly in the middle of an op or of malloc (a gc pass):
        # queue the free and apply it now only if the allocator is not busy.
        self._pending.append(alloc)
        if self._lock.acquire(blocking=False):
            try:
                self._drain_locked()
            finally:
                self._lock.release()

    def _release(self, alloc: Allocation) -> None:
        self._pending.append(alloc)
        with self._lock:
            self._drain_locked()

    def _drain_locked(self) -> None:
        pending = self._pending
        while pending:
            alloc = pending.popleft()
            frames = self._frames.find() if self._frames is not None else ()
            ptr = alloc.alloc_id
            self._live.pop(ptr, None)
            mark = len(self.allocator.segment_log)
            self.allocator.free(ptr)
            # free() then free_block(): with no stream uses both entries come at once (§5.1).
            self._record("free_requested", ptr, alloc.size_bytes, frames)
            self._record("free_completed", ptr, alloc.size_bytes, frames)
            self._segment_events(mark, frames)

    def _drain(self) -> None:
        if self._pending:
            with self._lock:
                self._drain_locked()

    # ------------------------------------------------------------------ history

    def _record(self, action: str, address: int, size: int, frames: tuple[Frame, ...]) -> None:
        if not self.record_history:
            return
        time_us = self._get_time_us() if self._get_time_us is not None else None
        self._events.append(TraceEvent(action, address, size, 0, time_us, frames))

    def _segment_events(self, mark: int, frames: tuple[Frame, ...]) -> None:
        if not self.record_history:
            return
        for action, address, size in self.allocator.segment_log[mark:]:
            self._record(action, address, size, frames)

    def record_memory_history(self, max_entries: int | None = None) -> None:
        """Start keeping trace events, as ``torch.cuda.memory._record_memory_history()``.

        Args:
            max_entries: keep at most this many (the newest); ``None`` keeps the current bound.

        Raises:
            SimulatedDeviceError: ``max_entries`` is below 1.
        """
        if max_entries is not None:
            if max_entries < 1:
                raise SimulatedDeviceError(
                    f"max_entries must be at least 1; got {max_entries}. Example: "
                    "record_memory_history(max_entries=100000)"
                )
            with self._lock:
                self._events = collections.deque(self._events, maxlen=max_entries)
        self.record_history = True
        self._frames = self._frame_finder

    def stop_memory_history(self) -> None:
        """Stop recording and drop the trace, as ``_record_memory_history(enabled=None)``."""
        with self._lock:
            self._drain_locked()
            self.record_history = False
            self._frames = None
            self._events.clear()

    def events(self) -> tuple[TraceEvent, ...]:
        """The trace so far, oldest first (empty unless ``record_history``).

        Actions: ``alloc`` (requested bytes), ``free_requested``/``free_completed``,
        ``segment_alloc``/``segment_free`` (and ``segment_map``/``segment_unmap`` with
        expandable segments), ``oom`` (address = device free bytes, size = rounded request).
        Frames hold the innermost user frame.
        """
        self._drain()
        return tuple(self._events)

    def snapshot(self) -> dict[str, Any]:
        """The dict ``torch.cuda.memory._snapshot()`` returns, for ``write_snapshot`` users.

        ``segments`` (blocks of live allocations carry their frames when history is
        recorded), ``device_traces`` (one list: device 0) and ``allocator_settings``.
        """
        self._drain()
        segments = self.allocator.snapshot()
        for segment in segments:
            for block in segment["blocks"]:
                alloc = self._live.get(block["address"])
                if alloc is not None and block["state"] == "active_allocated":
                    block["frames"] = list(alloc.frames)
        return snapshot_to_data(segments, {0: tuple(self._events)}, self._allocator_settings())

    def _allocator_settings(self) -> dict[str, Any]:
        # _snapshot()["allocator_settings"] (ref §11.2); SIZE_MAX shows as -1 there.
        config = self.config
        max_split = config.max_split_size_bytes
        divisions = config.roundup_power2_divisions
        return {
            "PYTORCH_CUDA_ALLOC_CONF": str(config),
            "max_split_size": -1 if max_split is None else max_split,
            "garbage_collection_threshold": config.garbage_collection_threshold,
            "expandable_segments": config.expandable_segments,
            "release_lock_on_cudamalloc": config.release_lock_on_cudamalloc,
            "roundup_power2_divisions": {str(1 << k): divisions[k] for k in range(16)},
        }

    # ------------------------------------------------------------------ DeviceMemory

    def attach_oom_observer(self, observer: OomObserver) -> None:
        """Call ``observer(device, alloc_size, total, device_free)`` on every OOM.

        Like ``torch._C._cuda_attach_out_of_memory_observer``: ``alloc_size`` is the segment
        size that could not be obtained and ``total`` the per-process limit if one is set,
        else the device total (ref §4 step 10). It runs before the exception is raised.
        """
        self._observers.append(observer)

    def detach_oom_observer(self, observer: OomObserver) -> None:
        """Stop calling an observer given to :meth:`attach_oom_observer` (no-op if unknown)."""
        with contextlib.suppress(ValueError):
            self._observers.remove(observer)

    def memory_stats(self) -> dict[str, int]:
        """``torch.cuda.memory_stats()`` of the simulated device."""
        self._drain()
        return self.allocator.memory_stats()

    def memory_allocated(self) -> int:
        """``torch.cuda.memory_allocated()`` in bytes."""
        self._drain()
        return self.allocator.memory_allocated()

    def memory_reserved(self) -> int:
        """``torch.cuda.memory_reserved()`` in bytes."""
        self._drain()
        return self.allocator.memory_reserved()

    def max_memory_allocated(self) -> int:
        """``torch.cuda.max_memory_allocated()`` in bytes."""
        self._drain()
        return self.allocator.max_memory_allocated()

    def max_memory_reserved(self) -> int:
        """``torch.cuda.max_memory_reserved()`` in bytes."""
        self._drain()
        return self.allocator.max_memory_reserved()

    def reset_peak_memory_stats(self) -> None:
        """``torch.cuda.reset_peak_memory_stats()``: every peak becomes the current value."""
        with self._lock:
            self._drain_locked()
            self.allocator.reset_peak_memory_stats()

    def reset_accumulated_memory_stats(self) -> None:
        """``torch.cuda.reset_accumulated_memory_stats()`` (also zeroes ``num_ooms``)."""
        with self._lock:
            self._drain_locked()
            self.allocator.reset_accumulated_memory_stats()

    def mem_get_info(self) -> tuple[int, int]:
        """``torch.cuda.mem_get_info()``: (free bytes, total bytes) of the device."""
        self._drain()
        return self.allocator.device_free_bytes, self.allocator.capacity_bytes

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: release every unused cached segment."""
        frames = self._frames.find() if self._frames is not None else ()
        with self._lock:
            self._drain_locked()
            mark = len(self.allocator.segment_log)
            self.allocator.empty_cache()
            self._segment_events(mark, frames)

    def synchronize(self) -> None:
        """``torch.cuda.synchronize()``: pending frees complete (none wait on streams here)."""
        with self._lock:
            self._drain_locked()
            self.allocator.synchronize()

    def __repr__(self) -> str:
        return (
            f"SimulatedCudaDevice({self.gpu.name!r}, alloc_conf={str(self.config)!r}, "
            f"device_type={self.device_type!r})"
        )


class _DeviceSink:
    """The device's side of the engine (``engine.AllocationSink``): the simulated allocator."""

    def __init__(self, device: SimulatedCudaDevice) -> None:
        self._device = device

    def allocate(
        self, size_bytes: int, op: str | None, *, first_seen: bool
    ) -> Allocation | SimulatedOutOfMemoryError:
        # A storage made before the device was entered is allocated when first used.
        return self._device._malloc(size_bytes, op)

    def free(self, alloc: Allocation) -> None:
        self._device._release(alloc)

    def storage_released(self, alloc: Allocation) -> None:
        self._device._on_release(alloc)

    def refused(self, error: Exception) -> BaseException:
        return self._device._raise_oom(error)

    def op_failed(self, op: str, error: BaseException) -> None:
        # Nothing kept: holding the error would keep its traceback's tensors alive.
        pass

    def phase(self) -> Phase:
        import torch

        # The autograd engine sets a graph task id on the thread running backward.
        return "backward" if torch._C._current_graph_task_id() != -1 else "user"

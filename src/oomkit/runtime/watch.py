"""``oomkit.watch()``: record memory history, dump a snapshot at the OOM, diagnose it.

``with oomkit.watch(): train()`` (or ``@oomkit.watch`` on a function) turns on PyTorch's memory
history (a bounded ring buffer of ``max_entries`` alloc/free events per device) and attaches an
out-of-memory observer. When the allocator is about to raise ``torch.OutOfMemoryError``, the
observer dumps ``torch.cuda.memory._snapshot()`` to ``snapshot_dir``; when the error leaves the
``with`` block, the watcher diagnoses that snapshot, logs the verdict and adds it to the
exception as a note (Python 3.11+). The exception always propagates.

Every ``torch.cuda`` call goes through a :class:`MemoryRecorder`: :class:`TorchCudaRecorder` on a
real GPU, :class:`SimulatedDeviceRecorder` for ``SimulatedCudaDevice`` (tests, CPU demos), or a
fake with the same four methods.

Overhead (PyTorch's own figures, torch/cuda/memory.py ``_record_memory_history``): about 2 us per
event for the Python stacks, and "several KB" per recorded entry in a snapshot, so the file is
bounded by ``max_entries`` times the stack depth. ``benchmarks/watch_overhead.py`` measures both.
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar, runtime_checkable

from oomkit.errors import OomkitError
from oomkit.runtime.device import is_out_of_memory

if TYPE_CHECKING:
    from oomkit.core.gpus import GpuSpec
    from oomkit.diagnose.diagnosis import Diagnosis

__all__ = [
    "DEFAULT_MAX_ENTRIES",
    "DEFAULT_SNAPSHOT_DIR",
    "MemoryRecorder",
    "ObservedOom",
    "OomObserver",
    "SimulatedDeviceRecorder",
    "TorchCudaRecorder",
    "Watch",
    "default_recorder",
    "diagnose_dump",
    "verdict_line",
    "watch",
]

logger = logging.getLogger(__name__)

# A ring of 100k entries keeps the last few steps of a typical training loop (a transformer step
# makes thousands of alloc/free events) while bounding the snapshot to a few hundred MB at the
# "several KB per entry" PyTorch documents for _record_memory_history.
DEFAULT_MAX_ENTRIES = 100_000
DEFAULT_SNAPSHOT_DIR = "oomkit_snapshots"

# (device, requested bytes, allowed maximum or device total, device free): the arguments
# CUDACachingAllocator passes to every OOM observer before raising (ref §10 step 10).
OomObserver = Callable[[int, int, int, int], None]
Context = Literal["alloc", "all"]


@dataclass(frozen=True)
class ObservedOom:
    """One call of the out-of-memory observer: the allocator's figures as it gave up.

    Attributes:
        device: the CUDA device index.
        requested_bytes: the allocation that failed (``alloc_size``).
        device_limit_bytes: the per-process limit when a memory fraction is set, else the
            device's total memory.
        device_free_bytes: free device memory (``cudaMemGetInfo``) at that moment.
        snapshot_path: where the snapshot of this moment was written; None when dumping failed.
    """

    device: int
    requested_bytes: int
    device_limit_bytes: int
    device_free_bytes: int
    snapshot_path: Path | None


@runtime_checkable
class MemoryRecorder(Protocol):
    """The ``torch.cuda`` memory-history calls ``watch`` needs, behind one seam."""

    def record_history(self, max_entries: int, context: Context) -> None:
        """Start recording alloc/free events (a ring buffer of ``max_entries`` per device)."""
        ...

    def stop(self) -> None:
        """Stop recording."""
        ...

    def attach_oom_observer(self, observer: OomObserver) -> Callable[[], None]:
        """Call ``observer`` before each OOM is raised; returns a function that detaches it."""
        ...

    def dump_snapshot(self, path: Path) -> None:
        """Write ``torch.cuda.memory._snapshot()`` to ``path`` as a pickle."""
        ...

    def gpu_spec(self, device: int) -> GpuSpec | None:
        """The GPU behind ``device`` (snapshots do not record it), or None when unknown."""
        ...


class TorchCudaRecorder:
    """The real recorder: ``torch.cuda.memory._record_memory_history`` and friends.

    PyTorch has no call to detach an OOM observer (torch/csrc/cuda/Module.cpp
    ``_cuda_attach_out_of_memory_observer`` only appends), so one dispatcher is attached per
    process, the first time it is needed, and forwards to the observers attached here.
    """

    _lock = threading.Lock()
    _observers: list[OomObserver] = []
    _dispatcher_attached = False

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self._legacy = False

    def record_history(self, max_entries: int, context: Context) -> None:
        memory = self._torch.cuda.memory
        try:
            # torch 2.1+ (torch/cuda/memory.py _record_memory_history_impl): string modes;
            # stacks="python" leaves out C++ frames, the costly part of "all".
            memory._record_memory_history(
                enabled="all", context=context, stacks="python", max_entries=max_entries
            )
        except TypeError:
            # torch 2.0 takes booleans only (the later _record_memory_history_legacy).
            self._legacy = True
            memory._record_memory_history(
                True,
                record_context=True,
                trace_alloc_max_entries=max_entries,
                trace_alloc_record_context=True,
            )

    def stop(self) -> None:
        memory = self._torch.cuda.memory
        if self._legacy:
            memory._record_memory_history(False)
        else:
            memory._record_memory_history(enabled=None)

    def attach_oom_observer(self, observer: OomObserver) -> Callable[[], None]:
        cls = type(self)
        with cls._lock:
            if not cls._dispatcher_attached:
                # The binding (torch/csrc/cuda/Module.cpp) is missing from torch/_C/__init__.pyi.
                torch_c: Any = self._torch._C
                torch_c._cuda_attach_out_of_memory_observer(cls._dispatch)
                cls._dispatcher_attached = True
            cls._observers.append(observer)

        def detach() -> None:
            with cls._lock:
                if observer in cls._observers:
                    cls._observers.remove(observer)

        return detach

    @classmethod
    def _dispatch(cls, device: int, alloc: int, device_limit: int, device_free: int) -> None:
        with cls._lock:
            observers = list(cls._observers)
        for observer in observers:
            observer(device, alloc, device_limit, device_free)

    def dump_snapshot(self, path: Path) -> None:
        self._torch.cuda.memory._dump_snapshot(str(path))

    def gpu_spec(self, device: int) -> GpuSpec | None:
        from oomkit.core.gpus import get_gpu
        from oomkit.errors import UnknownGpuError

        total = int(self._torch.cuda.get_device_properties(device).total_memory)
        try:
            spec = get_gpu(self._torch.cuda.get_device_name(device))
        except UnknownGpuError:
            return get_gpu(f"{total}B")
        # A catalog entry of the same name but another memory size (a 40 GB vs 80 GB part):
        # the device's own total wins.
        return spec if spec.total_memory_bytes == total else get_gpu(f"{total}B")


class SimulatedDeviceRecorder:
    """The recorder of a ``SimulatedCudaDevice``: its allocator's trace and snapshot.

    ``SimulatedCudaDevice`` records history when created with ``record_history=True`` (and
    ``max_entries``); ``record_history``/``stop`` call the device's ``record_memory_history`` /
    ``stop_memory_history`` where it has them, and do nothing otherwise.
    """

    def __init__(self, device: Any) -> None:
        self.device = device

    def record_history(self, max_entries: int, context: Context) -> None:
        start = getattr(self.device, "record_memory_history", None)
        if start is not None:
            start(max_entries=max_entries)

    def stop(self) -> None:
        stop = getattr(self.device, "stop_memory_history", None)
        if stop is not None:
            stop()

    def attach_oom_observer(self, observer: OomObserver) -> Callable[[], None]:
        self.device.attach_oom_observer(observer)
        detach = getattr(self.device, "detach_oom_observer", None)
        return (lambda: detach(observer)) if detach is not None else (lambda: None)

    def dump_snapshot(self, path: Path) -> None:
        with open(path, "wb") as out:
            pickle.dump(self.device.snapshot(), out, protocol=pickle.HIGHEST_PROTOCOL)

    def gpu_spec(self, device: int) -> GpuSpec | None:
        return getattr(self.device, "gpu", None)


def default_recorder() -> MemoryRecorder | None:
    """The recorder for the device runtime code works on, or None when there is no GPU.

    A simulated device installed with ``use_device`` (or entered as a context manager) wins over
    CUDA, as everywhere in ``oomkit.runtime``.
    """
    from oomkit.runtime import device as seam

    if not seam._override:
        # Not current_device(): TorchCudaDevice() calls torch.cuda.current_device(), which
        # initialises CUDA; `oomkit run` must leave that to the script (CUDA_VISIBLE_DEVICES).
        import torch

        return TorchCudaRecorder() if torch.cuda.is_available() else None
    device = seam.current_device()
    if isinstance(device, seam.TorchCudaDevice):
        return TorchCudaRecorder()
    if hasattr(device, "attach_oom_observer") and hasattr(device, "snapshot"):
        return SimulatedDeviceRecorder(device)
    return None


# Watches that are inside their `with` block, innermost last. The innermost one takes the
# snapshot at an OOM; outer ones adopt its result when the same exception reaches them.
_active: list[Watch] = []
_active_lock = threading.Lock()
_last_result: dict[int, tuple[Path | None, Diagnosis | None]] = {}
_dump_counter = [0]

F = TypeVar("F", bound=Callable[..., Any])


class Watch:
    """Records memory history while active and explains an OOM that escapes it.

    Use :func:`watch` to make one. After an OOM, read:

    Attributes:
        snapshot_path: the snapshot taken at the last OOM inside the block, or None.
        diagnosis: the diagnosis of that OOM once it left the block, or None.
        ooms: every observer call while active (caught OOMs included), oldest first.
        error: why there is no snapshot or no diagnosis when something failed, else None.
        gpu: the GPU of the last OOM as the recorder describes it, or None.
    """

    def __init__(
        self,
        snapshot_dir: str | os.PathLike[str] = DEFAULT_SNAPSHOT_DIR,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        *,
        context: Context = "alloc",
        diagnose: bool = True,
        recorder: MemoryRecorder | None = None,
    ) -> None:
        if not isinstance(max_entries, int) or max_entries < 1:
            raise OomkitError(
                f"max_entries must be a positive number of events; got {max_entries!r}. "
                f"Example: oomkit.watch(max_entries={DEFAULT_MAX_ENTRIES})"
            )
        if context not in ("alloc", "all"):
            raise OomkitError(
                f"context must be 'alloc' (stacks of allocations) or 'all' (frees too); "
                f"got {context!r}"
            )
        self.snapshot_dir = Path(snapshot_dir)
        self.max_entries = max_entries
        self.context: Context = context
        self.diagnose = diagnose
        self._recorder_arg = recorder
        self._recorder: MemoryRecorder | None = None
        self._detach: Callable[[], None] | None = None
        self._depth = 0
        self._owns_recording = False
        self.snapshot_path: Path | None = None
        self.diagnosis: Diagnosis | None = None
        self.ooms: list[ObservedOom] = []
        self.error: str | None = None
        self.gpu: GpuSpec | None = None
        self._dump_name: str | None = None

    # -- context manager ---------------------------------------------------------------
    def __enter__(self) -> Watch:
        self._depth += 1
        if self._depth > 1:  # re-entered (a recursive decorated function): already watching
            return self
        self.snapshot_path = None
        self._dump_name = None
        self.diagnosis = None
        self.ooms = []
        self.error = None
        self.gpu = None
        recorder = self._recorder_arg if self._recorder_arg is not None else default_recorder()
        self._recorder = recorder
        if recorder is None:
            logger.warning("oomkit.watch: no CUDA device; nothing is recorded")
        else:
            with _active_lock:
                self._owns_recording = not any(w._recorder is not None for w in _active)
            if self._owns_recording:
                recorder.record_history(self.max_entries, self.context)
            self._detach = recorder.attach_oom_observer(self._observe)
        with _active_lock:
            _active.append(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        self._depth -= 1
        if self._depth > 0:
            return False
        with _active_lock:
            if self in _active:
                _active.remove(self)
            outermost = not _active
        try:
            if self._detach is not None:
                self._detach()
                self._detach = None
            if self._recorder is not None and self._owns_recording:
                self._recorder.stop()
        finally:
            if exc is not None and is_out_of_memory(exc):
                self._explain(exc)
            if outermost:
                _last_result.clear()
        return False

    def __call__(self, func: F) -> F:
        """Use the watch as a decorator: every call of ``func`` runs inside it."""

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self:
                return func(*args, **kwargs)

        wrapper.watch = self  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    # -- at the OOM --------------------------------------------------------------------
    def _observe(self, device: int, alloc: int, device_limit: int, device_free: int) -> None:
        # Runs inside the allocator, just before it raises: it must never raise itself, or
        # the user would get this error instead of their OOM.
        try:
            with _active_lock:
                if self not in _active:  # a device that cannot detach observers
                    return
                innermost = _active[-1] is self
            path = self._dump() if innermost else None
            self.ooms.append(ObservedOom(device, alloc, device_limit, device_free, path))
        except Exception as exc:  # noqa: BLE001 - see the comment above
            self.error = f"the OOM observer failed: {type(exc).__name__}: {exc}"
            logger.warning("oomkit.watch: %s", self.error)

    def _dump(self) -> Path | None:
        assert self._recorder is not None
        try:
            self.snapshot_dir.mkdir(parents=True, exist_ok=True)
            if self._dump_name is None:
                _dump_counter[0] += 1
                self._dump_name = f"oom_{os.getpid()}_{_dump_counter[0]}.pickle"
            # A caught OOM followed by another overwrites: the last one is what escapes.
            # Written aside, then renamed, so that a reader never sees half a file.
            path = self.snapshot_dir / self._dump_name
            partial = path.with_name(path.name + ".partial")
            self._recorder.dump_snapshot(partial)
            os.replace(partial, path)
            self.snapshot_path = path
        except OSError as exc:
            self.error = f"could not write the OOM snapshot to {self.snapshot_dir}: {exc}"
            logger.warning("oomkit.watch: %s", self.error)
            return None
        logger.info("oomkit.watch: OOM snapshot written to %s", self.snapshot_path)
        return self.snapshot_path

    def _explain(self, exc: BaseException) -> None:
        adopted = _last_result.get(id(exc))
        if adopted is not None and self.snapshot_path is None:
            self.snapshot_path, self.diagnosis = adopted
            return
        if self.diagnose:
            try:
                observed = self.ooms[-1] if self.ooms else None
                if observed is not None and self._recorder is not None:
                    self.gpu = self._recorder.gpu_spec(observed.device)
                self.diagnosis = diagnose_dump(
                    self.snapshot_path, _message(exc), gpu=self.gpu, observed=observed
                )
            except Exception as err:  # noqa: BLE001 - never replace the user's OOM with ours
                self.error = f"could not diagnose the OOM: {type(err).__name__}: {err}"
                logger.warning("oomkit.watch: %s", self.error)
        _last_result[id(exc)] = (self.snapshot_path, self.diagnosis)
        line = verdict_line(self.diagnosis, self.snapshot_path)
        if line is None or not self.diagnose:  # without diagnosis the caller reports
            return
        logger.warning("%s", line)
        if hasattr(exc, "add_note"):  # Python 3.11+
            exc.add_note(line)


def _message(exc: BaseException) -> str:
    return str(exc.args[0]) if exc.args else str(exc)


def diagnose_dump(
    snapshot_path: Path | None,
    message: str | None = None,
    *,
    gpu: GpuSpec | None = None,
    observed: ObservedOom | None = None,
) -> Diagnosis:
    """Diagnose an OOM from the snapshot taken at it, else from the error's message.

    Args:
        snapshot_path: a snapshot written at the OOM (by ``watch`` or ``_dump_snapshot``).
        message: the ``torch.OutOfMemoryError`` message: diagnosed when there is no snapshot or
            the snapshot cannot be diagnosed (the diagnosis then says so in its warnings).
        gpu: the device it ran on (snapshots do not record it).
        observed: the observer's figures at the OOM; a limit below ``gpu``'s total memory is
            a per-process memory fraction.

    Returns:
        The diagnosis.

    Raises:
        OomkitError: nothing to diagnose, or the snapshot is unreadable and there is no
            message (``SnapshotFormatError``, ``OomTextError`` are subclasses).
    """
    from dataclasses import replace

    from oomkit.diagnose.diagnosis import diagnose_oom_text
    from oomkit.diagnose.oom_text import parse_oom_text
    from oomkit.diagnose.snapshot_diagnosis import diagnose_snapshot

    fallback_reason = None
    if snapshot_path is not None:
        from oomkit.core.snapshot import load_snapshot

        fraction = None
        if gpu is not None and observed is not None:
            if observed.device_limit_bytes < gpu.total_memory_bytes:
                fraction = observed.device_limit_bytes / gpu.total_memory_bytes
        try:
            return diagnose_snapshot(
                load_snapshot(snapshot_path),
                device=None if observed is None else observed.device,
                gpu=gpu,
                memory_fraction=fraction,
            )
        except OomkitError as exc:
            if message is None:
                raise
            fallback_reason = f"the snapshot {snapshot_path} could not be diagnosed ({exc})"
    if message is None:
        raise OomkitError(
            "no snapshot and no error message to diagnose; run the script with `oomkit run` "
            "on a GPU so that a snapshot is taken at the OOM"
        )
    diagnosis = diagnose_oom_text(parse_oom_text(message), gpu)
    if fallback_reason is not None:
        diagnosis = replace(
            diagnosis,
            warnings=(*diagnosis.warnings, fallback_reason + "; diagnosed from the message"),
        )
    return diagnosis


def verdict_line(diagnosis: Diagnosis | None, snapshot_path: Path | None) -> str | None:
    """One line for a log or an exception note: the cause, the top remedy, the snapshot."""
    parts = []
    if diagnosis is not None:
        parts.append(f"oomkit: cause {diagnosis.cause}: {diagnosis.causes[0].summary}")
        if diagnosis.remedies:
            parts.append(f"try first: {diagnosis.remedies[0].title}")
    if snapshot_path is not None:
        parts.append(f"snapshot at the OOM: {snapshot_path} (oomkit explain {snapshot_path})")
    if not parts:
        return None
    if diagnosis is None:
        parts[0] = "oomkit: " + parts[0]
    return "; ".join(parts)


def watch(
    func: Callable[..., Any] | None = None,
    /,
    *,
    snapshot_dir: str | os.PathLike[str] = DEFAULT_SNAPSHOT_DIR,
    max_entries: int = DEFAULT_MAX_ENTRIES,
    context: Context = "alloc",
    diagnose: bool = True,
    recorder: MemoryRecorder | None = None,
) -> Any:
    """Watch a block or a function for CUDA out-of-memory errors.

    ``with oomkit.watch() as w: ...``, ``@oomkit.watch`` or ``@oomkit.watch(snapshot_dir=...)``.

    Args:
        func: the function to decorate (when used as ``@oomkit.watch`` without parentheses).
        snapshot_dir: where the snapshot at an OOM is written (created when first needed).
        max_entries: the history ring buffer's size in events, per device; bounds the overhead
            and the snapshot size.
        context: ``"alloc"`` records the stack of each allocation; ``"all"`` also of each free
            (more overhead, a larger snapshot).
        diagnose: diagnose the OOM when it leaves the block (``oomkit run`` turns this off and
            diagnoses in the parent process).
        recorder: the ``torch.cuda`` seam; None picks the current device's.

    Returns:
        A :class:`Watch` (a context manager and decorator), or the decorated ``func``.

    Raises:
        OomkitError: ``max_entries`` or ``context`` is not valid.
    """
    w = Watch(snapshot_dir, max_entries, context=context, diagnose=diagnose, recorder=recorder)
    return w if func is None else w(func)

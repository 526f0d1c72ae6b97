"""``oomkit.Monitor``: per-step memory numbers of a training run, as records and a JSONL log.

Example::

    with oomkit.Monitor(log_path="memory.jsonl") as monitor:
        for batch in loader:
            loss = model(batch).sum(); loss.backward(); opt.step(); opt.zero_grad()
            monitor.step()                      # one StepRecord per step
    # oomkit report memory.jsonl --html memory.html

Each :meth:`Monitor.step` reads ``memory_stats()`` once (allocated, reserved, active,
inactive-split bytes, the peaks since the previous step, the cumulative retry / OOM /
cudaMalloc / cudaFree counters), then resets the peaks (``reset_peak_memory_stats``) so the
next record's peaks cover one step. Device-level used memory (NVML, all processes) is read in
a background thread. Nothing here prints: a live display is a ``sink`` called with each record
(``oomkit.interfaces.reports.monitor_live.live_line_sink``).

Under ``torch.distributed`` every rank records its own numbers (``rank`` in each record, and
``{rank}`` in ``log_path`` is replaced); :meth:`Monitor.gather` brings every rank's summary to
rank 0. The log's format and reader live in ``_monitor_log.py`` (re-exported here).
"""

from __future__ import annotations

import json
import logging
import os
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Literal

from oomkit.errors import ConfigError
from oomkit.runtime._monitor_log import (
    GATHERED_KEY,
    HEADER_KEY,
    LOG_FORMAT_VERSION,
    MonitorLog,
    MonitorSummary,
    StepRecord,
    is_monitor_log,
    load_monitor_log,
    read_monitor_log,
    summarize,
)
from oomkit.runtime._nvml import BackgroundSampler, open_nvml
from oomkit.runtime.device import DeviceMemory, TorchCudaDevice, current_device

__all__ = [
    "Findings",
    "LOG_FORMAT_VERSION",
    "Monitor",
    "MonitorLog",
    "MonitorSummary",
    "StepRecord",
    "is_monitor_log",
    "load_monitor_log",
    "read_monitor_log",
    "summarize",
]

logger = logging.getLogger(__name__)

# torch.cuda.memory_stats() keys (c10/cuda/CUDACachingAllocator.h DeviceStats, named by
# torch/cuda/memory.py memory_stats(): "<stat>.<pool>.<current|peak>" and "num_*").
_ALLOCATED = "allocated_bytes.all.current"
_ALLOCATED_PEAK = "allocated_bytes.all.peak"
_RESERVED = "reserved_bytes.all.current"
_RESERVED_PEAK = "reserved_bytes.all.peak"
_ACTIVE = "active_bytes.all.current"
_INACTIVE_SPLIT = "inactive_split_bytes.all.current"


def _distributed_rank() -> tuple[int | None, int | None]:
    """``(rank, world_size)`` when torch.distributed is initialised, else ``(None, None)``."""
    import sys

    torch = sys.modules.get("torch")  # never import torch just to learn there is no rank
    if torch is None:
        return None, None
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return None, None
    return int(dist.get_rank()), int(dist.get_world_size())


def _largest_free_block(device: DeviceMemory) -> int | None:
    """The largest cached free block, for devices that can tell cheaply (the simulated one)."""
    allocator = getattr(device, "allocator", None)
    snapshot = getattr(allocator, "snapshot", None)
    if snapshot is None:
        return None
    # torch.cuda.memory._snapshot() segments: free blocks have state "inactive".
    return max(
        (b["size"] for seg in snapshot() for b in seg["blocks"] if b["state"] == "inactive"),
        default=0,
    )


def _alloc_conf(device: DeviceMemory) -> str | None:
    config = getattr(device, "config", None)
    if config is not None:
        return str(config)
    # c10/core/AllocatorConfig.cpp reads PYTORCH_ALLOC_CONF first, then the CUDA-specific name.
    return os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF")


UsedMemory = Callable[[], int]


class Findings(list):
    """``Monitor.findings``: a list of ``LeakFinding`` / ``FragmentationFinding`` that prints
    one readable line per finding (what, and how much) instead of the records' reprs."""

    def __str__(self) -> str:
        if not self:
            return "no memory leak or fragmentation found"
        return "\n".join(str(finding) for finding in self)


class Monitor:
    """Records memory per training step; a context manager with :meth:`step`.

    Args:
        log_path: write a JSONL log here (``{rank}`` and ``{pid}`` are replaced); None: keep
            records in memory only.
        device: the device to watch; None: :func:`~oomkit.runtime.current_device` at start.
        every: record every N-th step (peaks and step times then cover the N steps).
        auto_step: call :meth:`step` from a global ``torch.optim`` optimizer-step post hook,
            so an unmodified script is monitored. With several optimizers, only the first
            one that steps counts.
        sink: called with each record (e.g. a live terminal line); an exception there is
            logged once and the sink dropped.
        get_time: clock in seconds.
        detect_leaks: include leak findings in :attr:`findings`.
        device_used: device-level used memory: ``"auto"`` reads NVML (nvidia-ml-py) for a
            real CUDA device; a callable returning bytes is used as given (read in a
            background thread); None turns it off.
        reset_peaks: reset the device's peak stats at each record (needed for per-step peaks;
            it also resets what ``torch.cuda.max_memory_allocated()`` reports to your code).
        keep_records: keep records in :attr:`records` (turn off for very long runs with a log).

    Attributes:
        records: the records so far.
        log_path: the log file (with ``{rank}`` replaced), or None.
        rank: the ``torch.distributed`` rank at start, or None.
        unavailable: what could not be measured, one line each (logged once).
    """

    def __init__(
        self,
        *,
        log_path: str | os.PathLike[str] | None = None,
        device: DeviceMemory | None = None,
        every: int = 1,
        auto_step: bool = False,
        sink: Callable[[StepRecord], None] | None = None,
        get_time: Callable[[], float] = time.perf_counter,
        detect_leaks: bool = True,
        device_used: UsedMemory | Literal["auto"] | None = "auto",
        reset_peaks: bool = True,
        keep_records: bool = True,
    ) -> None:
        if not isinstance(every, int) or every < 1:
            raise ConfigError(f"every must be a positive int; got {every!r}. Example: every=10")
        self._log_template = None if log_path is None else str(log_path)
        if self._log_template is not None:
            try:  # a bad template fails here, not at the start of a GPU run
                self._log_template.format(rank=0, pid=0)
            except (KeyError, IndexError, ValueError, AttributeError, TypeError) as exc:
                raise ConfigError(
                    f"log_path {self._log_template!r}: a template may name {{rank}} and {{pid}} "
                    f"only ({type(exc).__name__}: {exc}); write {{{{ and }}}} for a brace"
                ) from None
        self.log_path: Path | None = None
        self._device = device
        self.every = every
        self.auto_step = auto_step
        self.sink = sink
        self._get_time = get_time
        self.detect_leaks = detect_leaks
        self._device_used = device_used
        self.reset_peaks = reset_peaks
        self.keep_records = keep_records
        self.records: list[StepRecord] = []
        self.rank: int | None = None
        self.world_size: int | None = None
        self.unavailable: list[str] = []
        self.header: dict[str, Any] = {}
        self.last_record: StepRecord | None = None
        self._started = False
        self._closed = False
        self._file: IO[str] | None = None
        self._sampler: BackgroundSampler | None = None
        self._closer: Callable[[], None] | None = None
        self._hook: Any = None
        self._hook_optimizer: weakref.ref[Any] | None = None
        self._calls = 0
        self._t0 = 0.0
        self._last_record_time: float | None = None
        self._last_record_step = 0
        # Allocator trace cut at record boundaries (devices that keep one: the simulated device
        # with record_history), for leak attribution by site; None when not available.
        self._events_by_step: list[tuple[Any, ...]] | None = None
        self._event_mark = 0
        self._first_event: Any = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def device(self) -> DeviceMemory:
        """The watched device (resolved at start)."""
        if self._device is None:
            self._device = current_device()
        return self._device

    def start(self) -> Monitor:
        """Open the log, reset the peaks and install the hook; ``with`` calls it for you."""
        if self._started:
            return self
        self._started = True
        device = self.device
        self.rank, self.world_size = _distributed_rank()
        try:
            capacity = int(device.mem_get_info()[1])
        except Exception:  # noqa: BLE001 - a device that cannot tell its size
            capacity = None
        self._start_device_used(device)
        self.header = {
            HEADER_KEY: LOG_FORMAT_VERSION,
            "device": device.name,
            "capacity_bytes": capacity,
            "rank": self.rank,
            "world_size": self.world_size,
            "alloc_conf": _alloc_conf(device),
            "started_unix_s": time.time(),
            "every": self.every,
            "pid": os.getpid(),
            "unavailable": list(self.unavailable),
        }
        if self._log_template is not None:
            rank = 0 if self.rank is None else self.rank
            self.log_path = Path(self._log_template.format(rank=rank, pid=os.getpid()))
            if self.log_path.parent != Path():
                self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.log_path, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
            self._write(self.header)
        if self.reset_peaks:
            device.reset_peak_memory_stats()
        if self.detect_leaks and getattr(device, "record_history", False):
            events = getattr(device, "events", None)
            if callable(events):
                current = events()
                self._events_by_step = []
                self._event_mark = len(current)
                self._first_event = current[0] if current else None
        if self.auto_step:
            self._install_hook()
        self._t0 = self._get_time()
        return self

    def close(self) -> None:
        """Remove the hook, stop the sampler and close the log (idempotent)."""
        if self._closed or not self._started:
            self._closed = True
            return
        self._closed = True
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._sampler is not None:
            self._sampler.close()
        if self._closer is not None:
            try:
                self._closer()
            except Exception:  # noqa: BLE001
                pass
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> Monitor:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _start_device_used(self, device: DeviceMemory) -> None:
        source = self._device_used
        if source is None:
            return
        if source == "auto":
            if not isinstance(device, TorchCudaDevice):
                return  # NVML describes real GPUs only; nothing to report
            reader, why = open_nvml(device.index)
            if reader is None:
                # Not installed is a choice, not a fault: said once at INFO level.
                installed = why is None or "not installed" not in why
                self._unavailable(
                    f"device-level used memory: {why}", logging.WARNING if installed else logging.INFO
                )
                return
            source, self._closer = reader, reader.close
        assert callable(source)
        self._sampler = BackgroundSampler(source)
        if self._sampler.error is not None:
            self._unavailable(f"device-level used memory: {self._sampler.error}")

    def _unavailable(self, what: str, level: int = logging.WARNING) -> None:
        if what not in self.unavailable:
            self.unavailable.append(what)
            logger.log(level, "oomkit.Monitor: %s (said once)", what)

    # ------------------------------------------------------------------ auto_step

    def _install_hook(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._hook = register_optimizer_step_post_hook(self._on_optimizer_step)

    def _on_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        # One step per iteration: only the first optimizer seen counts (a GAN's two optimizers
        # would double-count); a new one is adopted when that one is gone.
        owner = self._hook_optimizer() if self._hook_optimizer is not None else None
        if owner is None:
            self._hook_optimizer = weakref.ref(optimizer)
        elif owner is not optimizer:
            return
        self.step()

    # ------------------------------------------------------------------ step

    def step(self) -> StepRecord | None:
        """Mark the end of a training step; the new record, or None on a step ``every`` skips."""
        if not self._started:
            self.start()
        index = self._calls
        self._calls += 1
        if index % self.every:
            return None
        now = self._get_time()
        device = self.device
        stats = device.memory_stats()
        largest = _largest_free_block(device)
        if self._events_by_step is not None:
            self._cut_events(device)
        if self.reset_peaks:
            device.reset_peak_memory_stats()
        sampler = self._sampler
        used = None
        if sampler is not None:
            used = sampler.latest
            if sampler.error is not None:
                self._unavailable(f"device-level used memory: {sampler.error}")
            sampler.request()
        if self._last_record_time is None:
            step_time = None
        else:
            step_time = (now - self._last_record_time) / (index - self._last_record_step)
        self._last_record_time = now
        self._last_record_step = index
        get = stats.get
        record = StepRecord(
            step=index + 1,  # counted from 1, as users count (issue 16 item 12)
            time_s=now - self._t0,
            step_time_s=step_time,
            allocated_bytes=int(get(_ALLOCATED, 0)),
            reserved_bytes=int(get(_RESERVED, 0)),
            active_bytes=int(get(_ACTIVE, 0)),
            inactive_split_bytes=int(get(_INACTIVE_SPLIT, 0)),
            peak_allocated_bytes=int(get(_ALLOCATED_PEAK, 0)),
            peak_reserved_bytes=int(get(_RESERVED_PEAK, 0)),
            num_alloc_retries=int(get("num_alloc_retries", 0)),
            num_ooms=int(get("num_ooms", 0)),
            num_device_alloc=int(get("num_device_alloc", 0)),
            num_device_free=int(get("num_device_free", 0)),
            largest_free_block_bytes=largest,
            device_used_bytes=used,
            rank=self.rank,
        )
        self.last_record = record
        if self.keep_records:
            self.records.append(record)
        if self._file is not None:
            self._write(record.to_json())
        if self.sink is not None:
            try:
                self.sink(record)
            except Exception as exc:  # noqa: BLE001 - a display must not stop training
                self.sink = None
                self._unavailable(f"the live display failed ({type(exc).__name__}: {exc})")
        return record

    def _cut_events(self, device: DeviceMemory) -> None:
        """Keep the trace events since the previous record as this record's."""
        events = device.events()  # type: ignore[attr-defined]
        first = events[0] if events else None
        if len(events) < self._event_mark or (
            self._first_event is not None and first is not self._first_event
        ):
            # The ring buffer dropped old events (max_entries) or history was stopped: the
            # cut no longer lines up with the records.
            self._events_by_step = None
            self._unavailable("leak attribution by site: the allocator trace was truncated")
            return
        if self._first_event is None:
            self._first_event = first
        assert self._events_by_step is not None
        self._events_by_step.append(tuple(events[self._event_mark :]))
        self._event_mark = len(events)

    def _write(self, obj: dict[str, Any]) -> None:
        assert self._file is not None
        self._file.write(json.dumps(obj, separators=(",", ":")) + "\n")
        self._file.flush()

    # ------------------------------------------------------------------ results

    def summary(self) -> MonitorSummary:
        """This process's summary of the records so far."""
        return summarize(self.header, self.records)

    def gather(self, dst: int = 0) -> list[MonitorSummary] | None:
        """Bring every rank's summary to rank ``dst`` (a collective: every rank must call it).

        Uses ``torch.distributed.gather_object``; rank ``dst`` also appends the summaries to
        its log, so ``oomkit report`` on that one file shows every rank.

        Returns:
            On rank ``dst``: the summaries ordered by rank. On other ranks: None. Without
            torch.distributed: a list holding this process's summary.
        """
        own = self.summary()
        rank, world = _distributed_rank()
        if rank is None or world is None:
            return [own]
        import torch.distributed as dist

        gathered: list[Any] | None = [None] * world if rank == dst else None
        dist.gather_object(own.to_json(), gathered, dst=dst)
        if gathered is None:
            return None
        summaries = [MonitorSummary.from_json(s) for s in gathered]
        line = {GATHERED_KEY: [s.to_json() for s in summaries]}
        if self._file is not None:
            self._write(line)
        elif self.log_path is not None:  # gathered after the with block: append
            with open(self.log_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(line, separators=(",", ":")) + "\n")
        return summaries

    @property
    def findings(self) -> Findings:
        """Leak and fragmentation findings over the records so far (computed on demand).

        ``oomkit.diagnose.memory_health.memory_findings`` on :attr:`records`; on a device that
        keeps an allocator trace (``SimulatedCudaDevice(record_history=True)``) a leak is
        attributed to the allocation sites that grow. Leak findings are left out when
        ``detect_leaks`` is False.

        Returns:
            ``LeakFinding`` and ``FragmentationFinding`` objects; empty when neither.
        """
        from oomkit.diagnose.memory_health import LeakFinding, memory_findings

        if not self.records:
            return Findings()
        by_step = self._events_by_step
        if by_step is not None and len(by_step) != len(self.records):
            by_step = None  # keep_records=False or a record taken before the trace started
        found = memory_findings(
            self.records,
            events_by_step=by_step,
            capacity_bytes=self.header.get("capacity_bytes"),
        )
        if not self.detect_leaks:
            found = [f for f in found if not isinstance(f, LeakFinding)]
        return Findings(found)

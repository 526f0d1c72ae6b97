"""``torch.cuda``'s memory counters while a step is recorded: the recording so far, replayed.

A script that logs its memory (``print(torch.cuda.max_memory_allocated())``,
``torch.cuda.memory_stats()["reserved_bytes.all.peak"]`` as torchtitan's memory monitor reads
it) reads, under the recorder, what oomkit's simulated caching allocator
(``oomkit.core.allocator.CachingAllocator``) holds after the device requests recorded up to that
line: each ``("alloc", ...)`` of the recorder's log is a ``malloc`` on its stream, each
``("free", ...)`` a ``free``, replayed from where the last read stopped. The allocator has the
target's ``PYTORCH_CUDA_ALLOC_CONF`` and PyTorch version and no memory limit (as the
prediction's ``required_bytes``): a step that would run out of memory on the GPU keeps being
recorded, and its reads go on past the limit (a request the allocator refuses even so, over
1 EiB, is left out of them). ``reset_peak_memory_stats()`` restarts the peaks.
``empty_cache()`` is a request of the step: logged as ``("empty_cache",)``, it releases the
cached blocks in the reads after it and in the report's replay (an ``empty_cache`` trace event).
``set_per_process_memory_fraction(f)`` is one too: logged as ``("memory_fraction", f)``, the
report's replay limits the allocator to that share of the GPU (the reads, without a memory
limit, are unchanged). So is ``torch.cuda.memory._set_allocator_settings(text)``: logged as
``("allocator_settings", text)``, it updates the live allocator's settings from that point, as
PyTorch does (c10/core/AllocatorConfig.cpp ``setAllocatorSettings`` -> ``parseArgs``), in the
reads after it and in the report's replay (an ``allocator_settings`` trace event); a text the
target's PyTorch refuses raises ``RuntimeError`` in the step, as its ``TORCH_CHECK`` does.
``torch.cuda.memory._snapshot()`` is the allocator's segments at that line
(``CachingAllocator.snapshot``) and, once ``_record_memory_history`` turned the history
on, its ``alloc``, ``free_requested`` and ``free_completed`` entries since, with the segment
events between them (``segment_alloc`` / ``segment_map`` before the request that made them,
``segment_free`` / ``segment_unmap`` where memory went back), so ``_dump_snapshot`` writes a file
that oomkit and memory_viz read as PyTorch's.

Within ``ooms_raised`` (``record_script(ooms=True)``) each request is first served by a second
allocator, with the target GPU's memory and its CUDA context outside it (the report's replay's
capacity): where it cannot be, ``torch.OutOfMemoryError`` is raised in the step with PyTorch's
message, as on the GPU, and the request is not logged, so code that catches it goes on as there.

Where it may differ from the report: the report replays the finished recording, in which a
free that waits on another stream's work (a distributed step's collectives) may come later
than here, where every free completes at once; and on the GPU's memory a step near the limit
frees its cache and retries (``required_bytes`` is the same either way). Reads before the
recorder starts, or outside one, see an allocator that has served nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from oomkit.core.allocator import AllocatorConfig, CachingAllocator, SimulatedOutOfMemoryError
from oomkit.core.allocator.constants import UNLIMITED_CAPACITY_BYTES
from oomkit.core.snapshot.writer import snapshot_to_data
from oomkit.core.target import Target
from oomkit.core.trace import TraceEvent
from oomkit.errors import ConfigError

__all__ = ["OomsRaised", "StepMemory", "ooms_raised"]

_FREED = ("free_requested", "free_completed")  # a free completes at once here


@dataclass
class OomsRaised:
    """How many out-of-memory errors ``ooms_raised`` raised.

    ``config_of(target)`` is the allocator setting the GPU's allocator runs with, asked at the
    step's first request (PyTorch reads its variable then: a script may set it itself);
    ``None``: the target's.
    """

    count: int = 0
    config_of: Callable[[Target], AllocatorConfig] | None = None


# The open ``ooms_raised`` block's record; None: requests are not limited.
_RAISING: contextvars.ContextVar[OomsRaised | None] = contextvars.ContextVar(
    "oomkit_ooms_raised", default=None
)


@contextlib.contextmanager
def ooms_raised(
    config_of: Callable[[Target], AllocatorConfig] | None = None,
) -> Iterator[OomsRaised]:
    """While open, a request the target GPU cannot serve raises ``torch.OutOfMemoryError``, as
    on the GPU (``StepMemory.admit``), so code that catches it (a batch finder retrying a
    smaller batch) runs as it would there. The request is then not recorded. ``config_of``:
    as ``OomsRaised.config_of``."""
    raised = OomsRaised(config_of=config_of)
    token = _RAISING.set(raised)
    try:
        yield raised
    finally:
        _RAISING.reset(token)


class StepMemory:
    """The simulated allocator's state after the requests of a recording's log so far.

    Args:
        log: the recorder's event log (``("alloc", Allocation)``, ``("free", Allocation,
            frames)``, ``("step",)``, ``("empty_cache",)``, ``("memory_fraction", f)``,
            ``("allocator_settings", text)``), appended to while the step runs.
        target: the machine whose allocator settings and PyTorch release are replayed;
            ``None``: PyTorch's defaults, its newest release.
    """

    def __init__(self, log: list[tuple[Any, ...]], target: Target | None = None) -> None:
        self._log = log
        self._read = 0
        self._allocator = CachingAllocator(
            None if target is None else target.allocator_config,
            capacity_bytes=UNLIMITED_CAPACITY_BYTES,
            torch_version=None if target is None else target.torch_version,
        )
        self._addresses: dict[int, int] = {}
        # The settings as the step's _set_allocator_settings calls left them so far (each call
        # is checked against them when made).
        self._config = self._allocator.config
        self.reads = 0
        # torch.cuda.get_per_process_memory_fraction(): 1.0 until the step sets one.
        self.memory_fraction = 1.0
        # torch.cuda.memory._record_memory_history: the entries since it was turned on, at
        # most max_entries of them, the oldest going first; None: off.
        self.history: deque[TraceEvent] | None = None
        # torch.cuda.memory._set_allocator_settings calls: (setting, after the first request).
        self.settings_calls: list[tuple[str, bool]] = []
        # With ooms_raised open: the allocator with the target GPU's memory that serves each
        # request first (admit), its read position in the log and its addresses.
        self._target = target
        self._limited: CachingAllocator | None = None
        self._limited_read = 0
        self._limited_addresses: dict[int, int] = {}

    def admit(self, alloc: Any) -> None:
        """A request about to be logged. With ``ooms_raised`` open it is served first by an
        allocator with the target GPU's memory and the CUDA context outside it, as the
        report's replay has (a GPU of one rank: no NCCL); where that allocator cannot serve
        it, even after freeing its cache and retrying (CUDACachingAllocator.cpp ``malloc``),
        ``torch.OutOfMemoryError`` is raised with PyTorch's message, and nothing is logged."""
        raised = _RAISING.get()
        if raised is None or self._target is None:
            return
        limited = self._limited_caught_up(self._target, raised)
        try:
            address = limited.malloc(alloc.size_bytes, alloc.stream)
        except SimulatedOutOfMemoryError as exc:
            raised.count += 1
            raise torch.OutOfMemoryError(str(exc)) from None
        self._limited_addresses[alloc.alloc_id] = address

    def _limited_caught_up(self, target: Target, raised: OomsRaised) -> CachingAllocator:
        if self._limited is None:
            config_of = raised.config_of
            self._limited = CachingAllocator(
                target.allocator_config if config_of is None else config_of(target),
                capacity_bytes=target.gpu.total_memory_bytes,
                reserved_outside_bytes=target.gpu.context_overhead_bytes,
                torch_version=target.torch_version,
            )
        limited, addresses = self._limited, self._limited_addresses
        for index in range(self._limited_read, len(self._log)):
            entry = self._log[index]
            if entry[0] == "alloc" and entry[1].alloc_id not in addresses:
                # Requested before the block opened: served if it can be, else left out.
                with contextlib.suppress(SimulatedOutOfMemoryError):
                    addresses[entry[1].alloc_id] = limited.malloc(entry[1].size_bytes, entry[1].stream)
            elif entry[0] == "free" and entry[1].alloc_id in addresses:
                limited.free(addresses.pop(entry[1].alloc_id))
            elif entry[0] == "empty_cache":
                limited.empty_cache()
            elif entry[0] == "memory_fraction":
                limited.set_per_process_memory_fraction(entry[1])
            elif entry[0] == "allocator_settings":
                limited.set_allocator_settings(entry[1])
        self._limited_read = len(self._log)
        return limited

    def _catch_up(self, read: bool = True) -> CachingAllocator:
        self.reads += read
        allocator, addresses, log = self._allocator, self._addresses, self._log
        for index in range(self._read, len(log)):
            entry = log[index]
            if entry[0] == "alloc":
                alloc = entry[1]
                logged = len(allocator.segment_log)
                try:
                    addresses[alloc.alloc_id] = allocator.malloc(alloc.size_bytes, alloc.stream)
                except SimulatedOutOfMemoryError:
                    continue  # past even 1 EiB ("more than 1EB"): left out of the reads, not raised
                if self.history is not None:
                    self._remember_segments(logged, alloc.stream, alloc.frames)
                    self._remember(("alloc",), addresses[alloc.alloc_id], alloc, alloc.frames)
            elif entry[0] == "free":
                if entry[1].alloc_id not in addresses:
                    continue  # its allocation was left out above
                address = addresses.pop(entry[1].alloc_id)
                allocator.free(address)
                if self.history is not None:
                    self._remember(_FREED, address, entry[1], entry[2])
            elif entry[0] == "empty_cache":
                logged = len(allocator.segment_log)
                allocator.empty_cache()
                if self.history is not None:
                    self._remember_segments(logged, 0, ())
            elif entry[0] == "allocator_settings":
                allocator.set_allocator_settings(entry[1])
        self._read = len(log)
        return allocator

    @property
    def entries(self) -> int:
        """Entries of the recorder's log so far (requests, frees and markers)."""
        return len(self._log)

    def used(self) -> bool:
        """Whether the step has requested device memory yet (PyTorch has read its allocator
        setting by then: the variable is parsed once, at the allocator's first use)."""
        return any(entry[0] == "alloc" for entry in self._log)

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: the step's request to return the cached blocks to the
        device (c10/cuda/CUDACachingAllocator.cpp ``emptyCache``: ``release_cached_blocks``),
        logged among its allocations, so that the report's replay releases them at the same
        point, and the reads after it see them released."""
        self._log.append(("empty_cache",))

    def set_memory_fraction(self, fraction: float) -> None:
        """``torch.cuda.set_per_process_memory_fraction(fraction)``, its argument checked by
        torch already: the step's request to limit the allocator to that share of the GPU
        (c10/cuda/CUDACachingAllocator.cpp ``setMemoryFraction``), logged for the report's
        replay."""
        self._log.append(("memory_fraction", fraction))
        self.memory_fraction = fraction

    def record_history(self, enabled: object, max_entries: int) -> None:
        """``torch.cuda.memory._record_memory_history(enabled, max_entries=...)``: ``None`` or
        ``False`` turns the history off (and drops it), anything else on from this line."""
        self._catch_up(read=False)  # what came before is not in the history
        if enabled is None or enabled is False:
            self.history = None
        else:
            kept = () if self.history is None else self.history
            self.history = deque(kept, maxlen=max(int(max_entries), 0))

    def snapshot(self, include_traces: bool = True) -> dict[str, Any]:
        """``torch._C._cuda_memorySnapshot``: the segments at this line and the history."""
        allocator = self._catch_up()
        traces = list(self.history) if include_traces and self.history is not None else []
        # The setting the simulated allocator runs now, as a snapshot's allocator_settings
        # names it, so that a replay of the file runs it too (core/replay/_recorded.py).
        alloc_conf = str(allocator.config)
        settings = {"PYTORCH_CUDA_ALLOC_CONF": alloc_conf} if alloc_conf else None
        return snapshot_to_data(allocator.snapshot(), [traces], allocator_settings=settings)

    def _remember_segments(self, logged: int, stream: int, frames: Any) -> None:
        """The allocator's segment events since its log held ``logged`` of them, into the
        history: PyTorch records each ``segment_alloc`` / ``segment_map`` inside the malloc
        that made it, before the request's ``alloc`` (CUDACachingAllocator.cpp ``alloc_block``
        and ``map_block``), and ``segment_free`` / ``segment_unmap`` where memory goes back."""
        assert self.history is not None
        segment_log = self._allocator.segment_log
        for action, address, size in segment_log[logged:]:
            self.history.append(TraceEvent(action, address, size, stream, frames=tuple(frames)))

    def _remember(self, actions: tuple[str, ...], address: int, alloc: Any, frames: Any) -> None:
        assert self.history is not None
        for action in actions:
            self.history.append(
                TraceEvent(action, address, alloc.size_bytes, alloc.stream, frames=tuple(frames))
            )

    def memory_allocated(self) -> int:
        """``torch.cuda.memory_allocated()``."""
        return self._catch_up().memory_allocated()

    def max_memory_allocated(self) -> int:
        """``torch.cuda.max_memory_allocated()``."""
        return self._catch_up().max_memory_allocated()

    def memory_reserved(self) -> int:
        """``torch.cuda.memory_reserved()``."""
        return self._catch_up().memory_reserved()

    def max_memory_reserved(self) -> int:
        """``torch.cuda.max_memory_reserved()``."""
        return self._catch_up().max_memory_reserved()

    def memory_stats(self) -> dict[str, int]:
        """``torch.cuda.memory_stats()``: PyTorch's keys (``"allocated_bytes.all.peak"``)."""
        return self._catch_up().memory_stats()

    def reset_peak_memory_stats(self) -> None:
        """``torch.cuda.reset_peak_memory_stats()``: every peak restarts from now."""
        self._catch_up().reset_peak_memory_stats()

    def reset_accumulated_memory_stats(self) -> None:
        """``torch.cuda.reset_accumulated_memory_stats()``."""
        self._catch_up().reset_accumulated_memory_stats()

    def set_allocator_settings(self, setting: object) -> None:
        """``torch.cuda.memory._set_allocator_settings(setting)``: PyTorch re-parses its live
        allocator's settings from then on (c10/core/AllocatorConfig.cpp ``setAllocatorSettings``
        -> ``parseArgs``; ``AllocatorConfig.runtime_update`` here), so the call is logged among
        the step's requests and replayed at its point. A text the target's PyTorch refuses
        raises ``RuntimeError``, as its ``TORCH_CHECK`` does, and changes nothing."""
        text = str(setting)
        try:
            config = self._config.runtime_update(text, self._allocator.torch_version)
        except ConfigError as exc:
            raise RuntimeError(str(exc)) from None
        self.settings_calls.append((text, self.used()))
        self._config = config
        self._log.append(("allocator_settings", text))

    def assumptions(self) -> dict[str, str]:
        """How the step's reads of the counters were answered, and its allocator settings
        calls (replayed at their points)."""
        said = {}
        if self.settings_calls:
            setting, late = self.settings_calls[-1]
            when = "after its first CUDA allocation" if late else "before its first allocation"
            said["torch.cuda allocator settings"] = (
                f"torch.cuda.memory._set_allocator_settings({setting!r}) (the last of "
                f"{len(self.settings_calls)} call(s), {when}) is replayed where the step made "
                "each call, as PyTorch updates its live allocator's settings then"
            )
        if not self.reads:
            return said
        return {
            **said,
            "torch.cuda memory counters": (
                f"read {self.reads} time(s) by the step (memory_allocated, memory_reserved, "
                "their peaks, memory_stats, mem_get_info), answered by replaying the requests recorded up to "
                "each read on the simulated caching allocator (the target's settings, no memory "
                "limit; frees complete at once)"
            )
        }

"""The monitor's JSONL log: one ``StepRecord`` a line after a header, read back with a summary.

The first line is a header object (``{"oomkit_monitor": LOG_FORMAT_VERSION, ...}``: device,
capacity, rank, setting); each further line is one :class:`StepRecord`; after
``Monitor.gather()`` rank 0 appends one line with every rank's :class:`MonitorSummary`.
:class:`~oomkit.runtime.monitor.Monitor` writes it; ``load_monitor_log`` reads it back.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oomkit._files import input_file_error, refuse_special_file
from oomkit.errors import MonitorLogError

__all__ = [
    "GATHERED_KEY",
    "HEADER_KEY",
    "LOG_FORMAT_VERSION",
    "MonitorLog",
    "MonitorSummary",
    "StepRecord",
    "is_monitor_log",
    "load_monitor_log",
    "read_monitor_log",
    "summarize",
]

# First key of a log's header line, and its format version.
LOG_FORMAT_VERSION = 1
HEADER_KEY = "oomkit_monitor"
# Key of the line rank 0 appends after Monitor.gather(): every rank's summary.
GATHERED_KEY = "oomkit_ranks"


@dataclass(frozen=True)
class StepRecord:
    """Memory of one training step, as ``torch.cuda.memory_stats()`` tells it.

    Attributes:
        step: the ``step()`` call this record was taken at, counted from 1 (logs written
            before oomkit 0.1's step renumbering counted from 0).
        time_s: seconds since the monitor started (its ``get_time`` clock).
        step_time_s: mean seconds per step since the previous record (with ``every=1``: since
            the previous ``step()``); None for the first record.
        allocated_bytes: bytes in live tensors now.
        reserved_bytes: bytes the caching allocator holds from the driver now.
        active_bytes: allocated bytes plus freed blocks still waiting on a stream.
        inactive_split_bytes: free bytes inside split blocks (fragmentation).
        peak_allocated_bytes: the highest allocated level since the previous record.
        peak_reserved_bytes: the highest reserved level since the previous record.
        num_alloc_retries: cudaMalloc failures that freed the cache and retried (cumulative).
        num_ooms: out-of-memory errors raised (cumulative).
        num_device_alloc: cudaMalloc calls (cumulative).
        num_device_free: cudaFree calls (cumulative).
        largest_free_block_bytes: the largest cached free block, where the device can tell
            (the simulated device can; a real GPU would need a snapshot per step: None).
        device_used_bytes: the whole GPU's used memory (NVML, every process), else None.
        rank: the ``torch.distributed`` rank, None when not initialised.
    """

    step: int
    time_s: float
    step_time_s: float | None
    allocated_bytes: int
    reserved_bytes: int
    active_bytes: int
    inactive_split_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    num_alloc_retries: int
    num_ooms: int
    num_device_alloc: int
    num_device_free: int
    largest_free_block_bytes: int | None = None
    device_used_bytes: int | None = None
    rank: int | None = None

    def to_json(self) -> dict[str, Any]:
        """The record as a JSON-ready dict (one line of the log)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StepRecord:
        """The record written by :meth:`to_json` (unknown keys are ignored).

        Raises:
            MonitorLogError: a required field is missing.
        """
        try:
            return cls(**{f.name: data[f.name] for f in _FIELDS if f.name in data})
        except TypeError as exc:
            raise MonitorLogError(
                f"a monitor record lacks fields ({exc}); was the log written by oomkit's Monitor?"
            ) from exc


_FIELDS = dataclasses.fields(StepRecord)

# torch.cuda.memory_stats() counts are int64 and byte counts size_t: every count in a log is a
# whole number in 0 to 2**64 - 1; times are finite seconds. A string, a list, Infinity or a
# 400-digit number is damage, and would become a wrong figure or invalid JSON in a report.
_U64 = 1 << 64
_COUNTS = frozenset(
    {
        "step",
        "allocated_bytes",
        "reserved_bytes",
        "active_bytes",
        "inactive_split_bytes",
        "peak_allocated_bytes",
        "peak_reserved_bytes",
        "num_alloc_retries",
        "num_ooms",
        "num_device_alloc",
        "num_device_free",
        "largest_free_block_bytes",
        "device_used_bytes",
        "max_inactive_split_bytes",
        "max_device_used_bytes",
        "capacity_bytes",
        "steps",
        "last_step",
    }
)
_SECONDS = frozenset({"time_s", "step_time_s", "mean_step_time_s"})
# c10d ranks are int (ProcessGroup::getRank).
_RANK_LIMIT = 1 << 31


def _field_problem(key: str, value: Any) -> str | None:
    """Why ``value`` cannot be the log field ``key``; None when it can (or is not checked)."""
    if value is None:
        return None
    if key in _COUNTS:
        if type(value) is not int or not 0 <= value < _U64:
            return "a whole number of 0 to 2**64 - 1"
    elif key in _SECONDS:
        if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
            return "a finite number of seconds >= 0"
    elif key == "rank":
        if type(value) is not int or not 0 <= value < _RANK_LIMIT:
            return "a rank: a whole number of 0 to 2**31 - 1"
    elif key == "device" and type(value) is not str:
        return "a device name (a string)"
    return None


def _check_fields(data: dict[str, Any], where: str) -> None:
    """Refuse the first field of a log line (header, record or summary) of the wrong type.

    Raises:
        MonitorLogError: naming ``where`` (the file and line), the field and what it must be.
    """
    for key, value in data.items():
        problem = _field_problem(key, value) if type(key) is str else None
        if problem is not None:
            raise MonitorLogError(
                f"{where}: {key!r} is {_short(value)}, not {problem}; the log is damaged or was "
                "not written by oomkit.Monitor (write one with oomkit.Monitor(log_path=...))"
            )


def _short(value: Any) -> str:
    if type(value) is int:
        return str(value) if -(10**30) < value < 10**30 else f"a {value.bit_length()}-bit number"
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True)
class MonitorSummary:
    """What a run (one rank) amounted to: the worst levels and final counters.

    Attributes:
        rank: the ``torch.distributed`` rank (None when not distributed).
        device: the device's name.
        capacity_bytes: the device's total memory, if known.
        steps: number of records.
        last_step: the last recorded step index (None without records).
        peak_allocated_bytes: the highest allocated level over the run.
        peak_reserved_bytes: the highest reserved level over the run.
        max_inactive_split_bytes: the most fragmentation seen at a step boundary.
        max_device_used_bytes: the most NVML used memory seen (None without NVML).
        num_alloc_retries: retries over the run (last record's counter).
        num_ooms: OOMs over the run.
        mean_step_time_s: mean step time, first step excluded (None with < 2 records).
    """

    rank: int | None
    device: str
    capacity_bytes: int | None
    steps: int
    last_step: int | None
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    max_inactive_split_bytes: int
    max_device_used_bytes: int | None
    num_alloc_retries: int
    num_ooms: int
    mean_step_time_s: float | None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MonitorSummary:
        names = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: v for k, v in data.items() if k in names})
        except TypeError as exc:
            raise MonitorLogError(f"a gathered rank summary lacks fields ({exc})") from exc


def summarize(header: dict[str, Any], records: Sequence[StepRecord]) -> MonitorSummary:
    """The :class:`MonitorSummary` of one log (its header and records)."""
    timed = [r.step_time_s for r in records if r.step_time_s is not None]
    used = [r.device_used_bytes for r in records if r.device_used_bytes is not None]
    last = records[-1] if records else None
    return MonitorSummary(
        rank=header.get("rank"),
        device=str(header.get("device", "?")),
        capacity_bytes=header.get("capacity_bytes"),
        steps=len(records),
        last_step=None if last is None else last.step,
        peak_allocated_bytes=max(
            (max(r.peak_allocated_bytes, r.allocated_bytes) for r in records), default=0
        ),
        peak_reserved_bytes=max(
            (max(r.peak_reserved_bytes, r.reserved_bytes) for r in records), default=0
        ),
        max_inactive_split_bytes=max((r.inactive_split_bytes for r in records), default=0),
        max_device_used_bytes=max(used) if used else None,
        num_alloc_retries=0 if last is None else last.num_alloc_retries,
        num_ooms=0 if last is None else last.num_ooms,
        mean_step_time_s=sum(timed) / len(timed) if timed else None,
    )


@dataclass(frozen=True)
class MonitorLog:
    """A monitor log as read back: header, records, and the gathered rank summaries if any."""

    path: Path
    header: dict[str, Any]
    records: tuple[StepRecord, ...]
    rank_summaries: tuple[MonitorSummary, ...] = ()
    truncated: bool = False

    def summary(self) -> MonitorSummary:
        """This log's own summary."""
        return summarize(self.header, self.records)


def load_monitor_log(path: str | os.PathLike[str]) -> MonitorLog:
    """Read a monitor JSONL log; a truncated last line (a run killed mid-write) is dropped.

    Raises:
        MonitorLogError: not a monitor log, a damaged line before the last one, or a field of
            the wrong type or range (naming the line and field).
        InputFileError: the file cannot be read.
    """
    path = Path(path)
    refuse_special_file(path, what="monitor log")
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as exc:
        raise input_file_error(path, exc, what="monitor log") from None
    if not lines or not lines[0].strip():
        raise MonitorLogError(f"{path}: empty file; a monitor log starts with a header line")
    try:
        header = json.loads(lines[0])
    except (ValueError, RecursionError):
        header = None
    if not isinstance(header, dict) or HEADER_KEY not in header:
        raise MonitorLogError(
            f"{path}: not an oomkit monitor log (the first line must be a JSON object with "
            f"{HEADER_KEY!r}); write one with oomkit.Monitor(log_path=...)"
        )
    version = header[HEADER_KEY]
    if type(version) is not int or version < 1:
        raise MonitorLogError(
            f"{path}: the header's {HEADER_KEY!r} is {version!r}, not a format version (a "
            "whole number); the log is damaged or was not written by oomkit.Monitor"
        )
    if version > LOG_FORMAT_VERSION:
        raise MonitorLogError(
            f"{path}: log format {header[HEADER_KEY]} is newer than this oomkit reads "
            f"({LOG_FORMAT_VERSION}); upgrade oomkit"
        )
    _check_fields(header, f"{path}:1 (header)")
    records: list[StepRecord] = []
    gathered: tuple[MonitorSummary, ...] = ()
    truncated = False
    body = lines[1:]
    for number, line in enumerate(body, start=2):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except (ValueError, RecursionError) as exc:
            if number == len(lines):
                truncated = True  # the writer was killed mid-line: keep what came before
                break
            raise MonitorLogError(f"{path}:{number}: damaged line ({exc})") from exc
        if not isinstance(data, dict):
            raise MonitorLogError(f"{path}:{number}: expected a JSON object")
        where = f"{path}:{number}"
        if GATHERED_KEY in data:
            summaries = data[GATHERED_KEY]
            if not isinstance(summaries, list) or not all(isinstance(x, dict) for x in summaries):
                raise MonitorLogError(f"{where}: {GATHERED_KEY!r} is not a list of objects")
            for summary in summaries:
                _check_fields(summary, where)
            gathered = tuple(MonitorSummary.from_json(x) for x in summaries)
            continue
        _check_fields(data, where)
        records.append(StepRecord.from_json(data))
    return MonitorLog(path, header, tuple(records), gathered, truncated)


# How much of a file's first line is read to tell a monitor log from other JSONL.
_HEADER_PROBE_BYTES = 1 << 16


def is_monitor_log(path: str | os.PathLike[str]) -> bool:
    """Whether the file starts with a monitor log's header line (reads at most 64 KiB).

    Lets ``oomkit report DIR`` pass over other ``*.jsonl`` files in a directory of logs.

    Raises:
        OSError: the file cannot be read.
    """
    refuse_special_file(path, what="monitor log")
    try:
        with open(path, "rb") as stream:
            first = stream.readline(_HEADER_PROBE_BYTES)
    except OSError as exc:
        raise input_file_error(path, exc, what="monitor log") from None
    try:
        header = json.loads(first)
    except (ValueError, RecursionError):
        return False
    return isinstance(header, dict) and HEADER_KEY in header


def read_monitor_log(path: str | os.PathLike[str]) -> tuple[dict[str, Any], list[StepRecord]]:
    """``(header, records)`` of a monitor log (see :func:`load_monitor_log`)."""
    log = load_monitor_log(path)
    return log.header, list(log.records)

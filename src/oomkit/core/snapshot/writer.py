"""``write_snapshot``: write the newest snapshot layout as plain data, as ``_dump_snapshot`` does."""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import is_dataclass
from pathlib import Path
from typing import Any

from oomkit.core.snapshot.model import SnapshotSegment
from oomkit.core.trace import Frame, TraceEvent

__all__ = ["snapshot_to_data", "write_snapshot"]


def write_snapshot(
    path: str | os.PathLike[str],
    segments: Iterable[Mapping[str, Any] | SnapshotSegment],
    device_traces: Mapping[int, Sequence[TraceEvent]] | Sequence[Sequence[TraceEvent]],
    allocator_settings: Mapping[str, Any] | None = None,
    user_metadata: Mapping[str, Any] | None = None,
) -> Path:
    """Write a memory snapshot pickle in PyTorch's newest ``_snapshot()`` layout.

    The file holds plain data only, so ``load_snapshot`` (and pytorch.org/memory_viz) read it.

    Args:
        path: the file to create or overwrite.
        segments: segment dicts as ``CachingAllocator.snapshot()`` (or ``torch.cuda.memory.
            _snapshot()["segments"]``) returns them, or ``SnapshotSegment`` records. Missing
            ``allocated_size`` / ``active_size`` / ``requested_size`` are summed from the blocks.
        device_traces: per device, its events oldest first: a mapping device -> events, or a
            sequence indexed by device.
        allocator_settings: written as ``allocator_settings`` when given (PyTorch's dict).
        user_metadata: written as a top-level ``user_metadata`` dict when given.

    Returns:
        The path written.
    """
    path = Path(path)
    data = snapshot_to_data(segments, device_traces, allocator_settings, user_metadata)
    with open(path, "wb") as out:
        pickle.dump(data, out, protocol=pickle.HIGHEST_PROTOCOL)
    return path


def snapshot_to_data(
    segments: Iterable[Mapping[str, Any] | SnapshotSegment],
    device_traces: Mapping[int, Sequence[TraceEvent]] | Sequence[Sequence[TraceEvent]],
    allocator_settings: Mapping[str, Any] | None = None,
    user_metadata: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The plain dict ``write_snapshot`` pickles (arguments as there)."""
    segment_dicts = [_segment_dict(s) for s in segments]
    if isinstance(device_traces, Mapping):
        by_device = {int(d): list(events) for d, events in device_traces.items()}
    else:
        by_device = {d: list(events) for d, events in enumerate(device_traces)}
    devices = set(by_device) | {s["device"] for s in segment_dicts}
    count = max(devices) + 1 if devices else 0
    # _snapshot(): segments device by device, each device's part sorted by address (§11.2).
    segment_dicts.sort(key=lambda s: (s["device"], s["address"]))
    data: dict[str, Any] = {
        "segments": segment_dicts,
        "device_traces": [[_entry(ev) for ev in by_device.get(d, ())] for d in range(count)],
    }
    if allocator_settings is not None:
        data["allocator_settings"] = dict(allocator_settings)
    data["external_annotations"] = []
    if user_metadata is not None:
        data["user_metadata"] = dict(user_metadata)
    return data


def _frames(frames: Iterable[Frame | Mapping[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for f in frames:
        if isinstance(f, Frame):
            out.append({"filename": f.filename, "line": f.line, "name": f.name})
        else:
            out.append({"filename": f["filename"], "line": f["line"], "name": f["name"]})
    return out


def _segment_dict(segment: Mapping[str, Any] | SnapshotSegment) -> dict[str, Any]:
    raw: Mapping[str, Any]
    if isinstance(segment, SnapshotSegment):
        raw = {
            "device": segment.device,
            "address": segment.address,
            "total_size": segment.total_size,
            "stream": segment.stream,
            "segment_type": segment.segment_type,
            "segment_pool_id": segment.pool_id,
            "allocated_size": segment.allocated_size,
            "active_size": segment.active_size,
            "requested_size": segment.requested_size,
            "is_expandable": segment.is_expandable,
            "frames": segment.frames,
            "blocks": [
                {
                    "address": b.address,
                    "size": b.size,
                    "requested_size": b.requested_size,
                    "state": b.state,
                    "frames": b.frames,
                }
                for b in segment.blocks
            ],
        }
    elif is_dataclass(segment):
        raise TypeError(f"segments must be dicts or SnapshotSegment; got {type(segment).__name__}")
    else:
        raw = segment
    blocks: list[dict[str, Any]] = []
    for b in raw.get("blocks", ()):
        size = int(b["size"])
        blocks.append(
            {
                "address": int(b["address"]),
                "size": size,
                "requested_size": int(b.get("requested_size", size)),
                "state": str(b.get("state", "active_allocated")),
                "frames": _frames(b.get("frames", ())),
            }
        )
    active = [b for b in blocks if b["state"] != "inactive"]
    pool_id = raw.get("segment_pool_id", (0, 0))
    return {
        "device": int(raw.get("device", 0)),
        "address": int(raw["address"]),
        "total_size": int(raw.get("total_size", sum(b["size"] for b in blocks))),
        "allocated_size": int(
            raw.get(
                "allocated_size",
                sum(b["size"] for b in blocks if b["state"] == "active_allocated"),
            )
        ),
        "active_size": int(raw.get("active_size", sum(b["size"] for b in active))),
        "requested_size": int(raw.get("requested_size", sum(b["requested_size"] for b in active))),
        "stream": int(raw.get("stream", 0)),
        "segment_type": str(raw.get("segment_type", "large")),
        "segment_pool_id": (int(pool_id[0]), int(pool_id[1])),
        "is_expandable": bool(raw.get("is_expandable", False)),
        "frames": _frames(raw.get("frames", ())),
        "blocks": blocks,
    }


def _entry(event: TraceEvent) -> dict[str, Any]:
    # TraceEntry as _snapshot() emits it (§11.2); an oom entry carries device_free, not addr.
    entry: dict[str, Any] = {"action": event.action}
    entry["device_free" if event.action == "oom" else "addr"] = event.address
    entry["size"] = event.size
    entry["stream"] = event.stream
    if event.time_us is not None:
        entry["time_us"] = event.time_us
    tags = dict(event.tags)
    for key in ("compile_context", "user_metadata"):
        if key in tags:
            entry[key] = tags[key]
    if "pool_id" in tags:
        entry["pool_id"] = tuple(int(p) for p in tags["pool_id"].split(","))
    entry["frames"] = _frames(event.frames)
    return entry

"""What a snapshot says about its own recording: setting, version and final segments."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from operator import attrgetter

from oomkit.core.allocator import AllocatorConfig
from oomkit.core.allocator.constants import SIZE_MAX
from oomkit.core.replay.reconstruct import SeedSegment, new_seed_block, new_seed_segment
from oomkit.core.snapshot import Snapshot, infer_torch_version
from oomkit.core.trace import TraceEvent
from oomkit.errors import ConfigError

__all__ = [
    "config_from_settings",
    "default_pool_events",
    "final_segments_for",
    "recorded_torch_version",
]

# _snapshot()["allocator_settings"]["roundup_power2_divisions"]: keys are the MB interval starts
# "1", "2", "4", ... "32768", one per slot (§11.2).
_ROUNDUP_KEYS = tuple(str(1 << k) for k in range(16))
_ADDRESS = attrgetter("address")
_TAGS = attrgetter("tags")


def config_from_settings(
    settings: Mapping | None, torch_version: str | None = None
) -> tuple[AllocatorConfig, tuple[str, ...]]:
    """The setting the recording ran under, from the snapshot's ``allocator_settings``.

    The ``PYTORCH_CUDA_ALLOC_CONF`` string gives the options that have no field of their own
    (``max_non_split_rounding_mb``, ``large_segment_size_mb``, ``per_process_memory_fraction``);
    the structured fields override it, since they also reflect runtime
    ``_set_allocator_settings`` calls (§11.2). Absent settings (older files) mean PyTorch's
    defaults.

    Returns:
        The config, and warnings about settings that could not be read.
    """
    if not settings:
        return AllocatorConfig(), ()
    warnings: list[str] = []
    config = AllocatorConfig()
    text = settings.get("PYTORCH_CUDA_ALLOC_CONF")
    if isinstance(text, str) and text.strip():
        try:
            config = AllocatorConfig.parse(text, torch_version)
        except ConfigError as exc:
            warnings.append(f"the recorded PYTORCH_CUDA_ALLOC_CONF {text!r} was not read: {exc}")
    changes: dict = {}
    max_split = settings.get("max_split_size")
    if isinstance(max_split, int):
        # memory_stats / allocator_settings show "unlimited" (SIZE_MAX) as -1.
        changes["max_split_size_bytes"] = max_split if 0 < max_split < SIZE_MAX else None
    gc = settings.get("garbage_collection_threshold")
    if isinstance(gc, (int, float)) and not isinstance(gc, bool):
        changes["garbage_collection_threshold"] = float(gc)
    for key in ("expandable_segments", "release_lock_on_cudamalloc"):
        if isinstance(settings.get(key), bool):
            changes[key] = settings[key]
    divisions = settings.get("roundup_power2_divisions")
    if isinstance(divisions, Mapping):
        values = [divisions.get(k, 0) or 0 for k in _ROUNDUP_KEYS]
        if all(type(v) is int for v in values):
            changes["roundup_power2_divisions"] = tuple(values)
        else:
            warnings.append(
                "the recorded roundup_power2_divisions hold values that are not whole numbers; "
                "they were not read (PyTorch's defaults are used)"
            )
    try:
        config = replace(config, **changes)
    except ConfigError as exc:
        warnings.append(f"the recorded allocator_settings were not all read: {exc}")
    return config, tuple(warnings)


def recorded_torch_version(snapshot: Snapshot) -> str | None:
    """The PyTorch version the file's keys point to (§15.6), or None for the newest."""
    return infer_torch_version(snapshot)


def final_segments_for(snapshot: Snapshot, device: int) -> tuple[list[SeedSegment], int]:
    """The snapshot's final default-pool segments of one device, blocks in address order.

    Returns:
        The segments, and how many private-pool segments (CUDA graphs, MemPool) were left out:
        the simulator models the default pools only.
    """
    out = []
    private = 0
    for seg in snapshot.segments_for(device):
        if tuple(seg.pool_id) != (0, 0):
            private += 1
            continue
        blocks = [
            new_seed_block(b.address, b.size, b.requested_size, b.state)  # type: ignore[arg-type]
            for b in seg.blocks
        ]
        blocks.sort(key=_ADDRESS)
        out.append(
            new_seed_segment(
                seg.address,
                seg.total_size,
                seg.stream,
                seg.segment_type == "small",
                bool(seg.is_expandable),
                tuple(blocks),
            )
        )
    return out, private


def default_pool_events(events: Sequence[TraceEvent]) -> tuple[tuple[TraceEvent, ...], int]:
    """The trace without entries of private pools (tagged ``pool_id`` by the snapshot reader)."""
    # Most traces carry no tags at all: that is checked in C (map, any) before any Python loop
    # over the events (this runs for every replay, issue 19).
    if not any(map(_TAGS, events)):
        return tuple(events), 0
    kept = tuple(ev for ev in events if not ev.tags or not any(k == "pool_id" for k, _ in ev.tags))
    return kept, len(events) - len(kept)

"""Which PyTorch version wrote a snapshot, guessed from the keys it has (a heuristic).

PyTorch does not record its version in a snapshot. Keys and actions appeared over time
(ref Appendix A and §11.2), so the newest feature present gives the *oldest* release that could
have written the file; that is what ``infer_torch_version`` returns. Release numbers marked "≈"
in the ref are inferred from PR dates, and a newer PyTorch that wrote no newer key is reported
as the older release: pass the real version (``--torch-version``) when you know it.
"""

from __future__ import annotations

from collections.abc import Set
from operator import attrgetter

from oomkit.core.snapshot.model import Snapshot

__all__ = ["infer_torch_version"]

# Versions returned are "major.minor" strings, as oomkit.core.allocator.versions.behaviour_for takes.
_NEWEST_FEATURE_ACTIONS = ("annotate",)  # MAIN26 (2026): `annotate` trace action
_ACTION = attrgetter("action")


def infer_torch_version(snapshot: Snapshot) -> str | None:
    """The oldest PyTorch release consistent with the snapshot's keys, or None for "newest".

    Heuristic, newest feature first:

    - an ``annotate`` trace action (MAIN26, 2026) -> None (model the newest release);
    - ``graph_capture_record_stream_reuse`` in ``allocator_settings`` (≈2.8-2.9) -> "2.9";
    - ``compile_context`` / ``user_metadata`` on trace entries -> "2.6";
    - ``external_annotations`` (≈ late 2024) -> "2.5";
    - ``allocator_settings`` -> "2.3";
    - ``is_expandable`` segments, ``segment_map``/``segment_unmap`` actions or ``time_us`` on
      trace entries (expandable segments, 2.1) -> "2.1";
    - blocks with ``history``, or a dict without any of the above (≈2.0) -> "2.0";
    - a bare list of segments without any of the above (<= 1.13) -> "1.13".

    Args:
        snapshot: a snapshot from ``load_snapshot``.

    Returns:
        A ``"major.minor"`` string, or None when the file points at the newest release.
    """
    keys = snapshot.keys_seen
    # The actions looked for below are none of alloc, free_requested, free_completed: the
    # reader noted the others as it checked the traces (Snapshot.other_actions), so a replay
    # reads no event here (issue 41: this scan was 1% of a fresh-copy verify).
    actions: Set[str] | None = snapshot.other_actions
    if actions is None:
        # A snapshot built otherwise: every event's action, gathered in C (map).
        gathered: set[str] = set()
        for events in snapshot.device_traces.values():
            gathered.update(map(_ACTION, events))
        actions = gathered
    if not actions.isdisjoint(_NEWEST_FEATURE_ACTIONS):
        return None
    if "settings:graph_capture_record_stream_reuse" in keys:
        return "2.9"
    if "trace:compile_context" in keys or "trace:user_metadata" in keys:
        return "2.6"
    if "top:external_annotations" in keys:
        return "2.5"
    if "top:allocator_settings" in keys:
        return "2.3"
    if (
        "trace:time_us" in keys
        or "segment:is_expandable" in keys
        or not actions.isdisjoint(("segment_map", "segment_unmap"))
    ):
        return "2.1"
    if "block:history" in keys or "top:device_traces" in keys or "top:segments" in keys:
        return "2.0"
    return "1.13"

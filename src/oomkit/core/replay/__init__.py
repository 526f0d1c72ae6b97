"""Replaying traces through the simulated allocator.

Every replay runs one loop, :class:`ReplayEngine`, with :class:`ReplayHooks` for what differs.
``simulate_events`` replays a synthetic trace (requests only). ``replay_snapshot`` replays the
trace of a recorded PyTorch memory snapshot from the state reconstructed at its first event,
either to verify the simulator against the recording or to ask "what if" under another setting
or capacity (../shared/ref/cuda-caching-allocator.md §15). Running several replays across
processes is not core's: ``oomkit.executors.replay_settings``.
"""

from __future__ import annotations

from oomkit.core.replay._recorded import config_from_settings, recorded_torch_version
from oomkit.core.replay.engine import ReplayEngine, ReplayHooks
from oomkit.core.replay.reconstruct import (
    SeedBlock,
    SeedSegment,
    StartState,
    reconstruct_start_state,
)
from oomkit.core.replay.result import Divergence, ReplayResult, SegmentEvent
from oomkit.core.replay.simulate import simulate_events
from oomkit.core.replay.snapshot_replay import UnknownDeviceError, replay_snapshot

__all__ = [
    "Divergence",
    "ReplayEngine",
    "ReplayHooks",
    "ReplayResult",
    "SeedBlock",
    "SeedSegment",
    "SegmentEvent",
    "StartState",
    "UnknownDeviceError",
    "config_from_settings",
    "reconstruct_start_state",
    "recorded_torch_version",
    "replay_snapshot",
    "simulate_events",
]

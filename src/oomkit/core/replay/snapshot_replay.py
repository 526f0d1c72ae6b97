"""Replay a recorded PyTorch memory snapshot: verify the simulator, or ask "what if".

The trace of one device is replayed from the state reconstructed at its first event
(``reconstruct.py``), following ../shared/ref/cuda-caching-allocator.md §15:

- **verify**: the recorded setting, the recorded outcomes of every cudaMalloc and the recorded
  segment addresses (§15.4, §15.5). Every segment decision is compared with the recording, and
  the final state with the snapshot's ``segments``.
- **what-if**: another setting or capacity (§15.11). New segments get synthetic addresses above
  every recorded one and cudaMalloc succeeds while the capacity allows.

Where the trace has two readings (a release run: ``empty_cache`` or an OOM path; frees completed
before a request or by its Step 9), verify mode re-runs with the other reading when that agrees
better with the recording (``_verify_run``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from oomkit.core.allocator import DEFAULT_CAPACITY_BYTES, AllocatorConfig
from oomkit.core.replay._compare import SegmentKey
from oomkit.core.replay._prepared import SeedPlan, completion_groups, prepared
from oomkit.core.replay._run import Run
from oomkit.core.replay.columns import TraceColumns
from oomkit.core.replay.engine import RELEASE, gc_paused
from oomkit.core.replay.reconstruct import SeedSegment, StartState
from oomkit.core.replay.result import ReplayResult, SegmentEvent
from oomkit.core.trace import TraceEvent
from oomkit.errors import ConfigError, UnknownDeviceError

if TYPE_CHECKING:
    from oomkit.core.snapshot import Snapshot

__all__ = ["replay_snapshot", "UnknownDeviceError"]

# DEFAULT_CAPACITY_BYTES (80 GiB) is the what-if capacity when none is given; in verify mode
# expandable reservations are sized from _prepared.verify_capacity.


def replay_snapshot(
    snapshot: Snapshot,
    device: int = 0,
    *,
    verify: bool = False,
    config: AllocatorConfig | None = None,
    capacity_bytes: int | None = None,
    torch_version: str | None = None,
    reserved_outside_bytes: int = 0,
) -> ReplayResult:
    """Replay one device's recorded trace through the simulator.

    Args:
        snapshot: a :class:`oomkit.core.snapshot.Snapshot` (from ``load_snapshot``); never mutated.
        device: the device index whose trace and segments to replay.
        verify: replay under the recorded setting with the recorded outcomes and addresses, and
            compare every segment decision and the final state with the recording.
        config: a what-if setting; it replaces the recorded one from the first replayed request
            (the starting state is still reconstructed under the recorded setting). ``None``
            replays under the recorded setting.
        capacity_bytes: device memory for a what-if (default 80 GiB); in verify mode it only
            sizes expandable reservations.
        torch_version: the PyTorch version whose behaviour to model; default inferred from the
            file's keys.
        reserved_outside_bytes: device memory held outside this allocator (the CUDA context):
            a what-if's cudaMalloc succeeds while it plus everything reserved fits
            ``capacity_bytes``, as ``cudaMemGetInfo``'s free memory on the real device.

    Returns:
        The replay's record. In verify mode ``segment_events_recorded``, ``_matched``,
        ``final_state_matches`` and ``first_divergence`` are set; in a what-if, ``oom`` is set
        when a recorded request no longer fits, and ``recorded_peak_reserved_bytes`` is the
        recording's own peak.

    Raises:
        UnknownDeviceError: the snapshot has no such device.
        ValueError: ``verify`` together with ``config`` (verify uses the recorded setting).
    """
    with gc_paused():
        return _replay_snapshot(
            snapshot, device, verify, config, capacity_bytes, torch_version, reserved_outside_bytes
        )


def _replay_snapshot(
    snapshot: Snapshot,
    device: int,
    verify: bool,
    config: AllocatorConfig | None,
    capacity_bytes: int | None,
    torch_version: str | None,
    reserved_outside_bytes: int,
) -> ReplayResult:
    """:func:`replay_snapshot`, with the garbage collector paused (``gc_paused``)."""
    if verify and config is not None:
        raise ConfigError(
            "verify=True replays under the recorded setting, so config must be None; "
            "pass config without verify for a what-if replay."
        )
    devices = list(snapshot.devices())
    # A snapshot of an allocator that never held memory lists no device; device 0 is then empty.
    if device not in devices and not (not devices and device == 0):
        listed = ", ".join(str(d) for d in devices) or "none"
        raise UnknownDeviceError(
            f"the snapshot has no device {device}; it holds device(s) {listed}. "
            f"Pass one of those (--device {devices[0] if devices else 0})."
        )
    # Computed at the first replay of this snapshot's device, reused by the next (tune and
    # --what-if replay one snapshot under many settings).
    inputs = prepared(snapshot, device, torch_version)
    events, version, recorded_config = inputs.events, inputs.version, inputs.recorded_config
    final, start, marks, recorded = inputs.final, inputs.start, inputs.marks, inputs.recorded

    warnings = [*inputs.settings_warnings, *start.warnings]
    if inputs.private_segments or inputs.private_events:
        warnings.append(
            f"private pools (CUDA graphs, MemPool) are not modelled: {inputs.private_segments} "
            f"segment(s) and {inputs.private_events} trace event(s) of them were left out"
        )
    if not events:
        warnings.append("trace is empty: only the final state was read")
    if start.hidden_blocks:
        warnings.append(
            f"reconstructed {start.hidden_blocks} block(s) whose size was hidden "
            "(live before recording began; sized from their requests, rounded as CUDACachingAllocator.cpp round_size rounds them)"
        )
    recorded_peak = inputs.recorded_peak
    if verify or (config is None and capacity_bytes is None):
        # No what-if asked for: replay the recording as it happened, compared when verifying.
        run = _verify_run(
            events,
            start,
            recorded_config,
            capacity_bytes=(
                capacity_bytes if capacity_bytes is not None else inputs.verify_capacity
            ),
            reserved_outside_bytes=reserved_outside_bytes,
            torch_version=version,
            recorded=recorded,
            final=final,
            marks=marks,
            allocs=inputs.allocs,
            columns=inputs.columns,
            final_keys=inputs.final_keys,
            seed=inputs.seed,
            groups=inputs.groups,
        )
    else:
        run = Run(
            events,
            start,
            config if config is not None else recorded_config,
            capacity_bytes=capacity_bytes if capacity_bytes is not None else DEFAULT_CAPACITY_BYTES,
            reserved_outside_bytes=reserved_outside_bytes,
            torch_version=version,
            recorded=recorded,
            verify=False,
            allocs=inputs.allocs,
            columns=inputs.columns,
            seed=inputs.seed,
        )
        run.replay()
    warnings.extend(run.warnings)
    result = run.result(final, recorded_peak, tuple(warnings), compare=verify)
    run.close()
    return result


def _verify_run(
    events: Sequence[TraceEvent],
    start: StartState,
    config: AllocatorConfig,
    *,
    capacity_bytes: int,
    torch_version: str | None,
    recorded: Sequence[tuple[int, SegmentEvent]],
    final: Sequence[SeedSegment],
    reserved_outside_bytes: int = 0,
    marks: Sequence[int] | None = None,
    allocs: int | None = None,
    columns: TraceColumns | None = None,
    final_keys: list[SegmentKey] | None = None,
    seed: SeedPlan | None = None,
    groups: dict[int, int] | None = None,
) -> Run:
    """Replay with the recorded outcomes; re-run while reading an ambiguous point otherwise helps.

    Two kinds of trace entries have two readings that the trace alone does not tell apart:

    - a run of releases is an ``empty_cache()`` or the OOM path of the next request (§15.3);
      with ``max_split_size`` set they differ (Step 8 frees oversize blocks only);
    - ``free_completed`` entries right before a release, a creation or an ``oom`` completed
      either before the request looked for a free block (process_events, Step 1) or in its
      Step 9 synchronize, after the lookup failed (§4.2).

    When the replay first goes wrong after such a point, it is re-run with the other reading
    of the nearest ones, and the re-run is kept if it agrees better with the recording. A
    re-run that goes wrong only later, yet agrees less so far, is re-run once more with the
    other reading of the points nearest its own first problem as well: two readings may have to
    change together (two ``empty_cache()`` calls, each right before a new segment, under
    ``max_split_size``: the first alone moves the divergence from the first to the second).
    """
    if groups is None:
        groups = completion_groups(events, marks)

    def replay(flipped: frozenset[int]) -> Run:
        run = Run(
            events,
            start,
            config,
            capacity_bytes=capacity_bytes,
            reserved_outside_bytes=reserved_outside_bytes,
            torch_version=torch_version,
            recorded=recorded,
            verify=True,
            flipped=flipped,
            groups=groups,
            allocs=allocs,
            columns=columns,
            final_keys=(final, final_keys) if final_keys is not None else None,
            seed=seed,
        )
        run.replay()
        return run

    run = replay(frozenset())
    score = run.score(final)
    tried: set[int] = set()
    replays = 1
    while (where := run.first_problem(final)) is not None:
        candidates = [
            c for c in _decision_points_before(events, groups, where) if c not in tried
        ]
        improved = False
        for candidate in candidates:
            tried.add(candidate)
            replays += 1
            retry = replay(run.flipped ^ {candidate})
            retry_score = retry.score(final)
            later = None if retry_score > score else retry.first_problem(final)
            if later is not None and later > where:
                # One step further: the points nearest the re-run's own first problem too.
                for second in _decision_points_before(events, groups, later):
                    if second in retry.flipped or second in tried:
                        continue
                    replays += 1
                    deeper = replay(retry.flipped ^ {second})
                    deeper_score = deeper.score(final)
                    if deeper_score > score:
                        retry.close()
                        retry, retry_score = deeper, deeper_score
                        break
                    deeper.close()
            if retry_score > score:
                run.close()
                run, score, improved = retry, retry_score, True
                break
            retry.close()
        if not improved:
            break
    run.readings_tried = replays
    return run


def _decision_points_before(
    events: Sequence[TraceEvent], groups: dict[int, int], index: int
) -> list[int]:
    """The nearest ambiguous points at or before ``index``, nearest first (see _verify_run)."""
    points: list[int] = []
    release = _release_run_before(events, index)
    if release is not None:
        points.append(release)
    group_starts = sorted({g for k, g in groups.items() if k <= index}, reverse=True)
    points.extend(group_starts[:2])
    return sorted(set(points), reverse=True)


def _release_run_before(events: Sequence[TraceEvent], index: int) -> int | None:
    """The start of the last run of segment releases at or before trace event ``index``."""
    i = min(index, len(events) - 1)
    while i >= 0 and events[i].action not in RELEASE:
        i -= 1
    if i < 0:
        return None
    while i > 0 and events[i - 1].action in RELEASE:
        i -= 1
    return i

"""Remedies that need more than an OOM message: priced by replay, by the trace or by a prediction.

- Allocator settings are priced by replaying the recorded trace under each alternative
  (``oomkit.plan.tuning.tune``): the saving is the drop in peak reserved memory on a device
  with no limit, and, at an OOM, the setting is offered only if the replay at the capacity the
  allocator saw (reserved + free at the OOM) serves the failed request. ``max_split_size_mb`` is
  offered only when it saves something and never together with ``expandable_segments`` (PyTorch
  issue #123548; ``tuning.FLAG_REASONS``).
- Batch size and gradient accumulation: activation-like memory (what comes and goes within an
  iteration) is taken to scale with the batch; an estimate.
- ``del`` + ``gc.collect()`` + ``torch.cuda.empty_cache()`` only where wholly free cached
  segments exist: at an OOM PyTorch has already released them itself (CUDACachingAllocator.cpp
  malloc, ``release_cached_blocks`` before raising; ref §4 step 9).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from oomkit.core.allocator.constants import LARGE_BUFFER, SMALL_BUFFER
from oomkit.core.snapshot import Snapshot, SnapshotSegment
from oomkit.core.trace import Frame
from oomkit.diagnose._remedy_code import ACCUMULATION_LOOP_CODE, setting_code
from oomkit.diagnose.diagnosis import Remedy
from oomkit.plan.tuning import FLAG_REASONS, tune
from oomkit.units import format_bytes

__all__ = [
    "ALLOCATOR_CANDIDATES",
    "allocator_remedies",
    "batch_remedy",
    "empty_cache_remedy",
    "leak_remedy",
    "set_max_split_size_note",
    "spike_remedy",
]

# The settings priced for a diagnosis: one of each kind (tuning.DEFAULT_GRID sweeps more).
ALLOCATOR_CANDIDATES: tuple[str, ...] = (
    "expandable_segments:True",
    "max_split_size_mb:128",
    "max_split_size_mb:256",
    "max_split_size_mb:512",
    "roundup_power2_divisions:4",
)

# A device with no practical limit: the replay's peak is what the workload needs (64 TiB).
_UNLIMITED_BYTES = 2**46

# The most micro-batches a gradient-accumulation remedy proposes.
_MAX_ACCUMULATION = 64


def allocator_remedies(
    snapshot: Snapshot,
    device: int,
    *,
    capacity_bytes: int | None,
    torch_version: str | None = None,
    script: str | None = None,
) -> tuple[list[Remedy], list[str]]:
    """Allocator settings that lower the recorded workload's peak, priced by replay.

    Args:
        snapshot: the recording.
        device: its device to replay.
        capacity_bytes: at an OOM, the memory the allocator could have had (reserved + free at
            the OOM); a setting is offered only if the replay at this capacity does not run out.
            None when no OOM was recorded.
        torch_version: the PyTorch version to model (None: inferred from the file).
        script: the script the recorded stacks show Python running, which the settings'
            commands run (None: ``train.py``).

    Returns:
        The remedies (at most one ``max_split_size_mb`` value: the best) and warnings.
    """
    warnings: list[str] = []
    if not any(ev.action == "alloc" for ev in snapshot.trace_for(device)):
        return [], ["the snapshot's trace has no allocations: allocator settings were not priced"]
    unlimited = tune(
        snapshot,
        _UNLIMITED_BYTES,
        device=device,
        torch_version=torch_version,
        candidates=ALLOCATOR_CANDIDATES,
    )
    fits: dict[str, bool] = {}
    if capacity_bytes is not None:
        at_capacity = tune(
            snapshot,
            capacity_bytes,
            device=device,
            torch_version=torch_version,
            candidates=ALLOCATOR_CANDIDATES,
        )
        fits = {c.alloc_conf: not c.ooms for c in at_capacity.candidates}
        if fits.get("", False):
            warnings.append(
                f"replayed under the default setting at {format_bytes(capacity_bytes)} the trace "
                "did not run out of memory (the simulator placed blocks differently); savings "
                "are from the replay without a limit"
            )
    base = unlimited.baseline.peak_reserved_bytes
    offered: list[tuple[int, str]] = []
    best_split: tuple[int, str] | None = None
    for cand in unlimited.candidates:
        if cand.alloc_conf == "" or cand.ooms or not cand.recommendable:
            continue
        saving = base - cand.peak_reserved_bytes
        if saving <= 0:  # never suggest a setting that would not help
            continue
        if capacity_bytes is not None and not fits.get(cand.alloc_conf, False):
            continue
        if cand.alloc_conf.startswith("max_split_size_mb"):
            if best_split is None or saving > best_split[0]:
                best_split = (saving, cand.alloc_conf)
            continue
        offered.append((saving, cand.alloc_conf))
    if best_split is not None:
        offered.append(best_split)
    remedies = []
    for saving, setting in offered:
        served = capacity_bytes is not None
        remedies.append(
            Remedy(
                "expandable segments"
                if setting == "expandable_segments:True"
                else f"allocator setting {setting}",
                saving,
                "high" if served else "medium",
                setting_code(setting, script),
                f"Replaying the recorded trace with {setting} needs {format_bytes(saving)} less "
                "reserved memory than the default"
                + (" and serves the request that failed" if served else "")
                + (
                    ". Use it without expandable_segments: "
                    + FLAG_REASONS["max-split-with-expandable"]
                    if setting.startswith("max_split_size_mb")
                    else "."
                ),
                estimate=False,
            )
        )
    return remedies, warnings


def batch_remedy(
    *,
    need_bytes: int,
    steady_bytes: int,
    available_bytes: int,
    batch_size: int | None = None,
    measured_from: str = "the trace",
) -> Remedy | None:
    """The largest batch that fits and the gradient-accumulation steps that keep the batch.

    Activation-like memory, ``need_bytes - steady_bytes`` (what comes and goes within a step),
    is taken to scale linearly with the batch; parameters, gradients and optimizer state (the
    steady part) do not.

    Args:
        need_bytes: what the step needed at its peak (allocated plus the failed request).
        steady_bytes: what stays allocated across steps.
        available_bytes: what PyTorch could use.
        batch_size: the batch size, when known.
        measured_from: where the figures come from, for the explanation.

    Returns:
        The remedy, or None when the step fits already or no batch size can help.
    """
    activation = need_bytes - steady_bytes
    room = available_bytes - steady_bytes
    if need_bytes <= available_bytes or activation <= 0 or room <= 0:
        return None
    if batch_size is not None:
        new_batch = room * batch_size // activation
        if new_batch < 1:
            return None
        steps = math.ceil(batch_size / new_batch)
        saving = activation - activation * new_batch // batch_size
        head = (
            f"accumulation_steps = {steps}  # {steps} micro-batches of {new_batch} "
            f"(was one batch of {batch_size})\n"
            f"loader = DataLoader(dataset, batch_size={new_batch}, shuffle=True)\n"
        )
        title = f"batch size {new_batch} with {steps} gradient-accumulation steps"
    else:
        steps = math.ceil(activation / room)
        if steps > _MAX_ACCUMULATION:
            return None
        saving = activation - math.ceil(activation / steps)
        head = (
            f"accumulation_steps = {steps}  # micro-batch = your batch size // {steps}\n"
            f"loader = DataLoader(dataset, batch_size=batch_size // {steps}, shuffle=True)\n"
        )
        title = f"a {steps}x smaller batch with {steps} gradient-accumulation steps"
    code = head + ACCUMULATION_LOOP_CODE
    return Remedy(
        title,
        saving,
        "medium" if batch_size is not None else "low",
        code,
        f"About {format_bytes(activation)} of the peak comes and goes within a step "
        f"(measured from {measured_from}) and is taken to scale with the batch; "
        f"{format_bytes(steady_bytes)} stays. The effective batch is unchanged.",
    )


def empty_cache_remedy(segments: Sequence[SnapshotSegment]) -> Remedy | None:
    """``del`` + ``gc.collect()`` + ``empty_cache()``, only when wholly free segments exist.

    ``empty_cache`` returns only segments with no live block (CUDACachingAllocator.cpp
    release_cached_blocks frees unsplit free blocks; ref §4.1); expandable segments unmap the
    whole pages inside their free blocks (ExpandableSegment::unmap: the range rounded inward
    to the segment's page, kLargeBuffer or kSmallBuffer).
    """
    free_bytes = 0
    for seg in segments:
        if seg.pool_id != (0, 0):
            continue
        page = LARGE_BUFFER if seg.segment_type == "large" else SMALL_BUFFER
        for b in seg.blocks:
            if b.state != "inactive":
                continue
            if not seg.is_expandable:
                free_bytes += b.size if len(seg.blocks) == 1 else 0
                continue
            first = -(-(b.address - seg.address) // page) * page
            end = (b.address - seg.address + b.size) // page * page
            free_bytes += max(0, end - first)
    if free_bytes <= 0:
        return None
    return Remedy(
        "release cached memory for other processes",
        free_bytes,
        "high",
        "del outputs, loss  # drop your own references first\n"
        "import gc; gc.collect()\n"
        "torch.cuda.empty_cache()",
        f"At the end of the snapshot {format_bytes(free_bytes)} sits in cached segments with no "
        "live tensor; empty_cache() "
        "returns it to the device for other processes and libraries. It does not lower what "
        "this process needs: PyTorch frees these segments itself before raising an OOM.",
        estimate=False,
        lowers_peak=False,
    )


def leak_remedy(leaked_bytes: int, site: str | None) -> Remedy:
    """Stop keeping tensors (and their autograd graphs) alive across iterations."""
    return Remedy(
        "stop the leak" + (f" at {site}" if site else ""),
        leaked_bytes,
        "medium",
        "total_loss += loss.item()          # not: total_loss += loss (keeps every graph)\n"
        "history.append(out.detach().cpu())  # not: history.append(out)\n"
        "# after a caught OOM, leave the except block before retrying: its traceback holds "
        "tensors",
        f"Allocated memory that stays at the start of each iteration grew by "
        f"{format_bytes(leaked_bytes)} across the recorded iterations.",
    )


def spike_remedy(spike_bytes: int, site: str | None) -> Remedy:
    """Make the short-lived peak smaller: compute the temporary in pieces."""
    saving = spike_bytes - spike_bytes // 4
    return Remedy(
        "compute the short-lived temporary in chunks" + (f" ({site})" if site else ""),
        saving,
        "low",
        "out = torch.cat([fn(part) for part in x.chunk(4)])  # a quarter of it live at once\n"
        "# attention scores: torch.nn.functional.scaled_dot_product_attention never builds them",
        f"{format_bytes(spike_bytes)} at the peak was allocated just before it and freed soon "
        "after; four chunks keep a quarter of it live.",
    )


def set_max_split_size_note(frames: Sequence[Frame], script: str | None = None) -> Remedy | None:
    """A note for code that calls a ``set_max_split_size`` method, which PyTorch does not have
    (its command runs ``script``, as ``allocator_remedies``' do)."""
    if not any("set_max_split_size" in f.name for f in frames):
        return None
    return Remedy(
        "set max_split_size_mb through the allocator settings",
        None,
        "high",
        setting_code("max_split_size_mb:256", script),
        "There is no public allocator object with a set_max_split_size method; the setting is "
        "read from PYTORCH_CUDA_ALLOC_CONF or torch.cuda.memory._set_allocator_settings. "
        "Check that it helps first (`oomkit tune SNAPSHOT`).",
        estimate=False,
    )

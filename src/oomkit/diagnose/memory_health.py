"""Is memory leaking or fragmenting over a run? Per-step samples in, findings out.

``detect_leak`` looks for steady growth of allocated memory across steps: it skips a warm-up (the
first optimizer step creates its state, caches fill), then asks for a rising Theil–Sen slope that
a Mann–Kendall test calls significant, that has not flattened out in the second half, and that
adds up to a minimum growth (bytes and a share of the peak). ``attribute_leak`` replays the
allocator trace step by step, groups the live allocations by allocation site (the user's frame)
and names the sites whose live bytes grow; ``explain_leak`` guesses the cause of one site in plain
words (always labelled as a likely cause). ``detect_fragmentation`` looks at reserved-but-unused
memory, inactive split blocks, allocation retries and a shrinking largest free block, and prices
allocator settings by replaying the recorded history (``tune``) when there is one.

The inputs are plain records (``MemorySample``); ``samples_from_records`` converts the runtime
monitor's ``StepRecord`` objects (or anything with the same attribute names).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from oomkit.core.trace import TraceEvent
from oomkit.diagnose._fragmentation import FragmentationFinding, detect_fragmentation
from oomkit.diagnose._leak_sites import (
    LeakCause,
    LeakSite,
    SiteUsage,
    attribute_leak,
    diff_live_sites,
    explain_leak,
    live_by_site,
)
from oomkit.diagnose._trend import LEAK_Z, Trend, detect_warmup_steps, trend
from oomkit.diagnose.attribution import MIN_LEAK_BYTES
from oomkit.errors import MemoryHealthError
from oomkit.units import format_bytes

__all__ = [
    "FragmentationFinding",
    "LeakCause",
    "LeakFinding",
    "LeakSite",
    "MemorySample",
    "MIN_LEAK_BYTES",
    "SiteUsage",
    "attribute_leak",
    "detect_fragmentation",
    "detect_leak",
    "detect_warmup_steps",
    "diff_live_sites",
    "explain_leak",
    "live_by_site",
    "memory_findings",
    "samples_from_records",
]

# A leak must add up to at least MIN_LEAK_BYTES (attribution.py, shared with the snapshot
# diagnosis) and MIN_LEAK_PCT of the peak over the analysed steps.
MIN_LEAK_PCT = 1.0
# Steps needed after the warm-up before a trend is judged.
MIN_TREND_STEPS = 6
# The second half of the window must still grow at this fraction of the whole window's slope;
# a cache that fills and then stops (saturating growth) fails it.
LATE_SLOPE_FRACTION = 0.3


@dataclass(frozen=True)
class MemorySample:
    """Memory counters at the end of one step (what the runtime monitor records).

    Attributes:
        step: the step number (0-based, increasing).
        allocated_bytes: ``memory_allocated`` at the sample.
        reserved_bytes: ``memory_reserved`` at the sample.
        peak_allocated_bytes: the peak of allocated memory since the previous sample, if known.
        peak_reserved_bytes: the peak of reserved memory since the previous sample, if known.
        inactive_split_bytes: ``inactive_split_bytes.all.current`` (free parts of split
            blocks), if known.
        num_alloc_retries: cumulative ``num_alloc_retries`` (mallocs that freed the cache and
            tried again), if known.
        largest_free_block_bytes: the largest free cached block, if the device can tell.
    """

    step: int
    allocated_bytes: int
    reserved_bytes: int
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    inactive_split_bytes: int | None = None
    num_alloc_retries: int | None = None
    largest_free_block_bytes: int | None = None


def samples_from_records(records: Iterable[Any]) -> list[MemorySample]:
    """Convert monitor records (``StepRecord``) to samples, by attribute name.

    Args:
        records: objects with ``step``, ``allocated_bytes`` and ``reserved_bytes``, and
            optionally the other ``MemorySample`` attributes (missing ones become None).

    Returns:
        One sample per record, in the records' order.

    Raises:
        MemoryHealthError: a record lacks ``step``, ``allocated_bytes`` or ``reserved_bytes``.
    """
    out: list[MemorySample] = []
    for record in records:
        try:
            step, allocated, reserved = (
                record.step,
                record.allocated_bytes,
                record.reserved_bytes,
            )
        except AttributeError as exc:
            raise MemoryHealthError(
                f"a memory record needs step, allocated_bytes and reserved_bytes; {exc}. Pass "
                "oomkit.runtime StepRecord objects or MemorySample"
            ) from exc
        out.append(
            MemorySample(
                step=step,
                allocated_bytes=allocated,
                reserved_bytes=reserved,
                peak_allocated_bytes=getattr(record, "peak_allocated_bytes", None),
                peak_reserved_bytes=getattr(record, "peak_reserved_bytes", None),
                inactive_split_bytes=getattr(record, "inactive_split_bytes", None),
                num_alloc_retries=getattr(record, "num_alloc_retries", None),
                largest_free_block_bytes=getattr(record, "largest_free_block_bytes", None),
            )
        )
    return out


@dataclass(frozen=True)
class LeakFinding:
    """Allocated memory grows steadily from step to step.

    Attributes:
        growth_bytes_per_step: the Theil–Sen slope of allocated memory after the warm-up.
        total_growth_bytes: ``growth_bytes_per_step`` times the steps spanned.
        first_step: the first step analysed (after the warm-up).
        last_step: the last step analysed.
        warmup_steps: samples skipped at the start.
        start_allocated_bytes: allocated memory at ``first_step``.
        end_allocated_bytes: allocated memory at ``last_step``.
        peak_bytes: the highest allocated memory (or its recorded peak) over the run.
        mann_kendall_z: the trend test's score (above ``LEAK_Z`` for every finding).
        kendall_tau: rising minus falling pairs over all pairs (1.0: every step higher).
        late_growth_bytes_per_step: the slope over the second half of the window.
        sites: the allocation sites that grow, largest first, when a trace was given.
    """

    growth_bytes_per_step: int
    total_growth_bytes: int
    first_step: int
    last_step: int
    warmup_steps: int
    start_allocated_bytes: int
    end_allocated_bytes: int
    peak_bytes: int
    mann_kendall_z: float
    kendall_tau: float
    late_growth_bytes_per_step: int
    sites: tuple[LeakSite, ...] = ()

    def __str__(self) -> str:
        """One line: what (a leak) and how much (``summary``), for ``print(mon.findings)``."""
        return "leak: " + " ".join(self.summary.split())

    @property
    def summary(self) -> str:
        """One sentence with the numbers and, when known, the growing site and its likely cause."""
        text = (
            f"allocated memory grows by {format_bytes(self.growth_bytes_per_step)} per step "
            f"(steps {self.first_step}-{self.last_step}, "
            f"{format_bytes(self.total_growth_bytes)} in all, Mann-Kendall z = "
            f"{self.mann_kendall_z:.1f})"
        )
        if self.sites:
            site = self.sites[0]
            text += f"; growing allocations come from {site.label}"
            cause = explain_leak(site)
            if cause.kind != "unknown":
                text += f". {cause.description}"
        return text


def _check_samples(samples: Sequence[MemorySample]) -> None:
    for a, b in zip(samples, samples[1:], strict=False):
        if b.step <= a.step:
            raise MemoryHealthError(
                f"memory samples must have increasing steps; step {b.step} follows step "
                f"{a.step}. Pass the monitor's records in the order they were taken"
            )


def detect_leak(
    samples: Sequence[MemorySample],
    *,
    warmup_steps: int | None = None,
    min_growth_bytes: int = MIN_LEAK_BYTES,
    min_growth_pct: float = MIN_LEAK_PCT,
    sites: Sequence[LeakSite] = (),
) -> LeakFinding | None:
    """Flag steady growth of allocated memory across steps.

    Args:
        samples: one per step, in step order (``samples_from_records`` converts monitor
            records).
        warmup_steps: samples to skip at the start; None detects it (``detect_warmup_steps``).
        min_growth_bytes: the least total growth over the analysed steps to report, in bytes.
        min_growth_pct: the least total growth as a percentage of the peak.
        sites: growing allocation sites (``attribute_leak``) to attach to a finding.

    Returns:
        The finding, or None when memory does not grow steadily, grows too little, has
        levelled off, or fewer than ``MIN_TREND_STEPS`` steps follow the warm-up.

    Raises:
        MemoryHealthError: steps are not increasing, or ``warmup_steps`` is negative.
    """
    _check_samples(samples)
    if warmup_steps is not None and warmup_steps < 0:
        raise MemoryHealthError(
            f"warmup_steps must be 0 or more; got {warmup_steps}. Example: warmup_steps=2"
        )
    values = [s.allocated_bytes for s in samples]
    skip = detect_warmup_steps(values) if warmup_steps is None else warmup_steps
    window = samples[skip:]
    if len(window) < MIN_TREND_STEPS:
        return None
    xs = [s.step for s in window]
    ys = [s.allocated_bytes for s in window]
    whole: Trend = trend(xs, ys)
    if whole.slope_per_x <= 0 or whole.mann_kendall_z < LEAK_Z:
        return None
    half = len(window) // 2
    late = trend(xs[half:], ys[half:])
    if late.slope_per_x < LATE_SLOPE_FRACTION * whole.slope_per_x:
        return None  # growth that levels off: a cache filling, not a leak
    span = xs[-1] - xs[0]
    total = round(whole.slope_per_x * span)
    peak = max(max(s.allocated_bytes, s.peak_allocated_bytes or 0) for s in samples)
    if total < max(min_growth_bytes, peak * min_growth_pct / 100):
        return None
    return LeakFinding(
        growth_bytes_per_step=round(whole.slope_per_x),
        total_growth_bytes=total,
        first_step=xs[0],
        last_step=xs[-1],
        warmup_steps=skip,
        start_allocated_bytes=ys[0],
        end_allocated_bytes=ys[-1],
        peak_bytes=peak,
        mann_kendall_z=whole.mann_kendall_z,
        kendall_tau=whole.kendall_tau,
        late_growth_bytes_per_step=round(late.slope_per_x),
        sites=tuple(sites),
    )


def memory_findings(
    records: Iterable[Any],
    *,
    events_by_step: Sequence[Sequence[TraceEvent]] | None = None,
    capacity_bytes: int | None = None,
    warmup_steps: int | None = None,
) -> list[LeakFinding | FragmentationFinding]:
    """Leak and fragmentation findings for a run, in one call (what ``Monitor.findings`` uses).

    Args:
        records: the monitor's ``StepRecord`` objects (or ``MemorySample``), in step order.
        events_by_step: the allocator trace cut at the same step boundaries, when recorded
            (one element per record): a leak is then attributed to its sites, and allocator
            settings are priced on the whole trace.
        capacity_bytes: the device's memory, for pricing settings.
        warmup_steps: leading steps to skip; None detects the warm-up.

    Returns:
        A ``LeakFinding`` first when memory leaks, then a ``FragmentationFinding`` when the
        cache fragments; empty when neither.

    Raises:
        MemoryHealthError: records lack the memory fields or their steps do not increase.
    """
    samples = samples_from_records(records)
    findings: list[LeakFinding | FragmentationFinding] = []
    leak = detect_leak(samples, warmup_steps=warmup_steps)
    if leak is not None:
        if events_by_step is not None:
            sites = attribute_leak(events_by_step, warmup_steps=leak.warmup_steps)
            leak = replace(leak, sites=tuple(sites))
        findings.append(leak)
    events = None
    if events_by_step is not None:
        events = [ev for step in events_by_step for ev in step]
    fragmentation = detect_fragmentation(samples, events=events, capacity_bytes=capacity_bytes)
    if fragmentation is not None:
        findings.append(fragmentation)
    return findings

"""Is the cache fragmenting? Reserved-but-unused memory, split blocks, retries, largest free block.

Signals (each named in ``FragmentationFinding.signals``):

- ``reserved_unused``: at the steps' peaks, reserved memory exceeds allocated memory by at least
  ``UNUSED_PCT`` of reserved (and ``min_waste_bytes``): cached blocks that the requests could
  not reuse. The per-step peaks are compared, not the end-of-step values: at a step's end the
  cache rightly holds the activations' blocks for the next step.
- ``inactive_split_growth``: the free parts of split blocks (``inactive_split_bytes``, the
  fragmentation counter of CUDACachingAllocator.cpp's stats) rise steadily, or end above
  ``UNUSED_PCT`` of reserved.
- ``alloc_retries``: ``num_alloc_retries`` rose: mallocs found no block, freed the whole cache
  (a synchronizing cudaFree per segment) and tried again (ref §4 step 7).
- ``largest_free_shrinking``: the largest free block falls steadily by at least a quarter.

Remedies are priced by replaying the recorded history under the candidate settings (``tune``)
when events are given; otherwise the usual settings are suggested without numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from statistics import median
from typing import TYPE_CHECKING, Literal

from oomkit.core.trace import TraceEvent
from oomkit.diagnose._trend import LEAK_Z, trend
from oomkit.units import format_bytes

if TYPE_CHECKING:
    # Annotations only; the settings sweep is imported when a trace is there to replay (a
    # monitor log has none: `oomkit report` stays light, issue 41 item 4).
    from oomkit.diagnose.memory_health import MemorySample
    from oomkit.plan.tuning import TuningResult

__all__ = [
    "FragmentationFinding",
    "FragmentationSignal",
    "MIN_WASTE_BYTES",
    "UNUSED_PCT",
    "detect_fragmentation",
]

FragmentationSignal = Literal[
    "reserved_unused", "inactive_split_growth", "alloc_retries", "largest_free_shrinking"
]

# Waste smaller than this is not worth a setting change (a GPU has tens of GiB).
MIN_WASTE_BYTES = 64 * 2**20
# Reserved-but-unused (or inactive split) memory at least this share of reserved is flagged.
UNUSED_PCT = 30.0
# The largest free block must fall by at least this share of its first value.
SHRINK_PCT = 25.0

# Suggested when there is no history to price settings on (ref §9.3: expandable segments map
# pages into one growing segment, so there are no fixed-size segments to split; max_split_size_mb
# keeps large cached blocks whole for large requests).
_UNPRICED = (
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (no fixed-size segments to fragment)",
    "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:512 (large cached blocks are not split)",
)


@dataclass(frozen=True)
class FragmentationFinding:
    """The cache holds memory that the requests cannot use.

    Attributes:
        signals: which signals fired (see the module docstring).
        unused_bytes: median over the analysed steps of peak reserved minus peak allocated.
        unused_pct: the same as a percentage of peak reserved.
        inactive_split_bytes: at the last sample (None when not recorded).
        inactive_split_growth_bytes_per_step: its Theil–Sen slope (None when not recorded).
        alloc_retries: retries over the samples (None when not recorded).
        largest_free_first_bytes: the largest free block at the first sample that recorded one.
        largest_free_last_bytes: the same at the last sample.
        recommendations: what to try, best first.
        tuning: the replay of the recorded history under each setting, when events were given.
    """

    signals: tuple[FragmentationSignal, ...]
    unused_bytes: int
    unused_pct: float
    inactive_split_bytes: int | None
    inactive_split_growth_bytes_per_step: int | None
    alloc_retries: int | None
    largest_free_first_bytes: int | None
    largest_free_last_bytes: int | None
    recommendations: tuple[str, ...]
    tuning: TuningResult | None = None

    def __str__(self) -> str:
        """One line: what (fragmentation) and how much (``summary``), for printing."""
        return "fragmentation: " + " ".join(self.summary.split())

    @property
    def summary(self) -> str:
        """One sentence with the numbers behind each signal."""
        parts = []
        if "reserved_unused" in self.signals:
            parts.append(
                f"{format_bytes(self.unused_bytes)} ({self.unused_pct:.0f}%) of reserved memory "
                "is unused at the step peaks"
            )
        if "inactive_split_growth" in self.signals and self.inactive_split_bytes is not None:
            parts.append(f"{format_bytes(self.inactive_split_bytes)} sits in split free blocks")
        if "alloc_retries" in self.signals:
            parts.append(f"{self.alloc_retries} allocation retries (each flushes the cache)")
        if "largest_free_shrinking" in self.signals:
            parts.append(
                f"the largest free block shrank from {format_bytes(self.largest_free_first_bytes or 0)}"
                f" to {format_bytes(self.largest_free_last_bytes or 0)}"
            )
        text = "the cache is fragmenting: " + "; ".join(parts)
        if self.recommendations:
            text += f". Try {self.recommendations[0]}"
        return text


def _known(values: Sequence[int | None]) -> list[int] | None:
    return None if any(v is None for v in values) or not values else [int(v) for v in values]  # type: ignore[arg-type]


def detect_fragmentation(
    samples: Sequence[MemorySample],
    *,
    events: Sequence[TraceEvent] | None = None,
    capacity_bytes: int | None = None,
    min_waste_bytes: int = MIN_WASTE_BYTES,
    warmup_steps: int = 1,
    torch_version: str | None = None,
) -> FragmentationFinding | None:
    """Flag a fragmenting cache from per-step samples, and say what allocator setting to try.

    Args:
        samples: one per step, in step order.
        events: the recorded allocator history (a simulated device's ``events()``, a
            snapshot's trace); when given with ``capacity_bytes``, candidate settings are
            replayed on it (``tune``) and ranked by peak reserved memory.
        capacity_bytes: the device's memory, for the replay.
        min_waste_bytes: the least unused (or inactive split) memory to flag, in bytes.
        warmup_steps: samples skipped for the unused-memory median (the first step fills
            the cache).
        torch_version: the PyTorch version whose allocator to replay; None is the newest.

    Returns:
        The finding, or None when no signal fires.
    """
    if not samples:
        return None
    window = samples[warmup_steps:] if len(samples) > warmup_steps else samples
    signals: list[FragmentationSignal] = []

    peaks_r = [
        s.peak_reserved_bytes if s.peak_reserved_bytes is not None else s.reserved_bytes
        for s in window
    ]
    peaks_a = [
        s.peak_allocated_bytes if s.peak_allocated_bytes is not None else s.allocated_bytes
        for s in window
    ]
    unused = int(median(r - a for r, a in zip(peaks_r, peaks_a, strict=True)))
    reserved = int(median(peaks_r))
    unused_pct = 100.0 * unused / reserved if reserved > 0 else 0.0
    if unused >= min_waste_bytes and unused_pct >= UNUSED_PCT:
        signals.append("reserved_unused")

    inactive = _known([s.inactive_split_bytes for s in samples])
    inactive_slope: int | None = None
    if inactive is not None:
        last_reserved = samples[-1].reserved_bytes
        if len(inactive) >= 3:
            t = trend([s.step for s in samples], inactive)
            inactive_slope = round(t.slope_per_x)
            growing = t.mann_kendall_z >= LEAK_Z and inactive[-1] - inactive[0] >= min_waste_bytes
        else:
            growing = False
        large = (
            inactive[-1] >= min_waste_bytes
            and last_reserved > 0
            and 100.0 * inactive[-1] / last_reserved >= UNUSED_PCT
        )
        if growing or large:
            signals.append("inactive_split_growth")

    retries_series = _known([s.num_alloc_retries for s in samples])
    retries = None
    if retries_series is not None:
        # A cumulative counter: retries during the samples, plus any before the first one.
        retries = retries_series[-1]
        if retries > 0:
            signals.append("alloc_retries")

    largest = [
        s.largest_free_block_bytes for s in samples if s.largest_free_block_bytes is not None
    ]
    first_free = largest[0] if largest else None
    last_free = largest[-1] if largest else None
    if len(largest) >= 3 and largest[0] > 0:
        t = trend(list(range(len(largest))), largest)
        shrank = 100.0 * (largest[0] - largest[-1]) / largest[0]
        if t.mann_kendall_z <= -LEAK_Z and shrank >= SHRINK_PCT:
            signals.append("largest_free_shrinking")

    if not signals:
        return None
    tuning = None
    recommendations: list[str] = []
    if events is not None and capacity_bytes is not None and events:
        from oomkit.plan.tuning import tune

        tuning = tune(events, capacity_bytes, torch_version=torch_version)
        best = tuning.best
        if best is not None and not tuning.default_is_best and tuning.saving_bytes > 0:
            recommendations.append(
                f"PYTORCH_CUDA_ALLOC_CONF={best.alloc_conf}: peak reserved "
                f"{format_bytes(best.peak_reserved_bytes)} instead of "
                f"{format_bytes(tuning.baseline.peak_reserved_bytes)} in a replay of the "
                "recorded history"
            )
        else:
            recommendations.append(
                "no allocator setting reserves less than the default in a replay of the recorded"
                " history; reduce the variety of tensor sizes (pad batches to a few fixed "
                "shapes) or the batch size"
            )
    else:
        recommendations.extend(_UNPRICED)
    if "alloc_retries" in signals:
        recommendations.append(
            "allocation retries flush the cache: lower the peak (smaller batch, activation "
            "checkpointing) so that the cache need not be emptied"
        )
    return FragmentationFinding(
        signals=tuple(signals),
        unused_bytes=unused,
        unused_pct=unused_pct,
        inactive_split_bytes=inactive[-1] if inactive is not None else None,
        inactive_split_growth_bytes_per_step=inactive_slope,
        alloc_retries=retries,
        largest_free_first_bytes=first_free,
        largest_free_last_bytes=last_free,
        recommendations=tuple(recommendations),
        tuning=tuning,
    )

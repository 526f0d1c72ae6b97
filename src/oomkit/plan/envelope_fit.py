"""The largest batch whose whole run of variable-length steps fits (``fit --lengths``).

Each probe is an epoch envelope (:func:`oomkit.prediction.envelope.predict_envelope`): every
distinct length recorded at that batch size and the run replayed in order, so the cache's creep
across steps counts, not just the longest step. The search doubles from the first batch until a
run does not fit, then bisects, as ``max_batch_size`` does for one step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from oomkit.core.target import Target
from oomkit.errors import NoFeasibleBatchSizeError
from oomkit.plan.batch_probe import resolve_margin
from oomkit.plan.frozen_heap import frozen_heap
from oomkit.prediction.envelope import Envelope, predict_envelope
from oomkit.prediction.tracing.recording import TraceRecording

__all__ = ["EnvelopeFit", "EnvelopeProbe", "max_batch_for_run"]


@dataclass(frozen=True)
class EnvelopeProbe:
    """One batch size tried: the run's worst step and whether the whole run fits."""

    batch_size: int
    fits: bool
    worst_peak_reserved_bytes: int
    first_oom_step: int | None


@dataclass(frozen=True)
class EnvelopeFit:
    """The largest batch whose run fits, its envelope, and every probe in the order tried."""

    batch_size: int
    envelope: Envelope
    probes: tuple[EnvelopeProbe, ...]
    margin_bytes: int


def max_batch_for_run(
    record: Callable[[int, int], TraceRecording],
    lengths: Sequence[int],
    target: Target,
    *,
    steps: int | None = None,
    pad_to: int = 1,
    seed: int | None = None,
    max_length: int | None = None,
    margin_bytes: int | None = None,
    start_batch: int = 1,
    max_batch: int = 65536,
    progress: Callable[[str], None] | None = None,
) -> EnvelopeFit:
    """The largest batch size (<= ``max_batch``) whose whole run fits with ``margin_bytes`` spare.

    Args:
        record: ``record(batch_size, length)`` records two steps at that batch and length.
        lengths: the dataset's per-step lengths.
        steps: steps of the run (None: one pass over ``lengths``).
        target: the GPU and allocator setting.
        pad_to: pad each length up to a multiple of this.
        seed: shuffle the steps with this seed (None: the file's order).
        max_length: the model's longest sequence; a longer (padded) length is an error.
        margin_bytes: reserved memory to leave unused at the worst step; None: ``fit``'s
            default (``default_margin_bytes``: 2% of usable, at least 256 MiB).
        start_batch: the first batch size tried.
        max_batch: the largest batch size tried.
        progress: called with a short line before each probe.

    Raises:
        NoFeasibleBatchSizeError: not even ``start_batch`` (nor batch 1 below it) fits.
    """
    say = progress or (lambda _line: None)
    margin = resolve_margin(margin_bytes, target.usable_bytes)
    probes: list[EnvelopeProbe] = []
    envelopes: dict[int, Envelope] = {}

    def fits(batch: int) -> bool:
        say(f"batch {batch}: replaying the whole run")
        freeze()  # the collector skips what earlier probes made (frozen_heap.py)
        env = predict_envelope(
            lambda n: record(batch, n),
            lengths,
            target,
            steps=steps,
            pad_to=pad_to,
            seed=seed,
            max_length=max_length,
            remedies=False,
        )
        ok = (
            env.first_oom_step is None
            and env.worst_peak_reserved_bytes + margin <= target.usable_bytes
        )
        probes.append(
            EnvelopeProbe(batch, ok, env.worst_peak_reserved_bytes, env.first_oom_step)
        )
        envelopes[batch] = env
        return ok

    with frozen_heap() as freeze:
        low, high = _search(fits, start_batch, max_batch)
    if low == 0:
        raise NoFeasibleBatchSizeError(
            f"not even batch 1 runs the whole run on {target.gpu.name}: its worst step needs "
            f"{probes[-1].worst_peak_reserved_bytes} B reserved of {target.usable_bytes} B usable"
        )
    return EnvelopeFit(low, envelopes[low], tuple(probes), margin)


def _search(fits: Callable[[int], bool], start_batch: int, max_batch: int) -> tuple[int, int | None]:
    """(the largest batch found to fit, 0 for none; the smallest found not to, None for none):
    from ``start_batch`` halving until one fits, then doubling until one does not, then
    bisecting."""
    low, high = 0, None
    batch = min(start_batch, max_batch)
    while batch >= 1 and low == 0:
        if fits(batch):
            low = batch
        else:
            high = batch
            batch //= 2
    if low == 0:
        return low, high
    while high is None and low < max_batch:
        batch = min(low * 2, max_batch)
        if fits(batch):
            low = batch
        else:
            high = batch
    while high is not None and high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low, high

"""The largest batch whose whole run of variable-length steps fits (``fit --lengths``).

Each probe is an epoch envelope (:func:`oomkit.prediction.envelope.predict_envelope`): every
distinct length recorded at that batch size and the run replayed in order, so the cache's creep
across steps counts, not just the longest step. The search halves from the first batch until a
run fits, doubles until one does not, then bisects, as ``max_batch_size`` does for one step.

Most recordings are not traced: at one length a step records the same events at every batch,
with sizes affine in it, so once two batches were traced at a length its recordings at other
batches are synthesized (``trace_interpolation.TraceInterpolator``, one per length) and the
probe replays those, as ``max_batch_size`` does. The answer rests on traces: the last size
bisection tries is traced at every length straight away, and the answer and the size above it,
where synthesized, are traced again at every length; each traced recording must equal its
synthesis, else the search runs again, learning from them (the third traces everything).
With ``jobs`` above 1, the lengths a probe traces are traced in forked processes at once
(``executors/forked.py run_forked``) before its run is replayed, and learned from in the
run's order, so the search is the one-at-a-time one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from oomkit.core.target import Target
from oomkit.errors import NoFeasibleBatchSizeError
from oomkit.executors.forked import process_count, run_forked_or_here
from oomkit.plan.batch_advice import infeasible_advice
from oomkit.plan.batch_probe import resolve_margin
from oomkit.plan.frozen_heap import frozen_heap
from oomkit.plan.trace_interpolation import INTERPOLATED_SEARCHES, TraceInterpolator
from oomkit.prediction.envelope import Envelope, predict_envelope
from oomkit.prediction.lengths import run_order
from oomkit.prediction.tracing.recording import TraceRecording
from oomkit.units import format_bytes

__all__ = ["EnvelopeFit", "EnvelopeProbe", "max_batch_for_run"]


@dataclass(frozen=True)
class EnvelopeProbe:
    """One batch size tried: the run's worst step and whether the whole run fits.

    ``synthesized``: a recording it replayed was synthesized from other batches' (not traced).
    """

    batch_size: int
    fits: bool
    worst_peak_reserved_bytes: int
    first_oom_step: int | None
    synthesized: bool = False


@dataclass(frozen=True)
class EnvelopeFit:
    """The largest batch whose run fits, its envelope, and every probe in the order tried.

    ``traces`` and ``synthesized`` count the recordings (one batch at one length) traced and
    synthesized over the whole search; ``probes`` are those of its last search.
    """

    batch_size: int
    envelope: Envelope
    probes: tuple[EnvelopeProbe, ...]
    margin_bytes: int
    traces: int = 0
    synthesized: int = 0


def _infeasible(
    probe: EnvelopeProbe, target: Target, margin: int, description: str = ""
) -> NoFeasibleBatchSizeError:
    """Not even ``probe``'s batch (1) runs the whole run: what it needs, or where it runs out,
    and what to try, from the step's ``description`` (``batch_advice.infeasible_advice``)."""
    worst = format_bytes(probe.worst_peak_reserved_bytes)
    advice = infeasible_advice(description, target.gpu.compute_capability)
    if probe.first_oom_step is not None:
        # The replay stops at the OOM: what it reserved by then is not what the step needs.
        what = f"its step {probe.first_oom_step} runs out of memory ({worst} reserved before it did)"
    else:
        what = f"its worst step needs {worst} reserved"
    # A run's lengths are the data's: its last item (a shorter sequence) says how to shorten it.
    advice[-1] += " (truncate the longest the run will see)"
    reason = (
        f"not even batch 1 runs the whole run on {target.gpu.name}: {what}, and of the "
        f"{format_bytes(target.usable_bytes)} usable a margin of {format_bytes(margin)} must stay "
        "free."
    )
    return NoFeasibleBatchSizeError(
        f"{reason} Try {', '.join(advice)}, a smaller margin (--margin), or a GPU with more "
        "memory.",
        needed_reserved_bytes=None if probe.first_oom_step is not None else probe.worst_peak_reserved_bytes,
        usable_bytes=target.usable_bytes,
        margin_bytes=margin,
        reason=reason,
        advice=tuple(advice),
    )


class _Recordings:
    """The recording of a batch at a length: synthesized where the length's interpolator can,
    else traced (and learned from); counts both, and whether a trace differed from its
    synthesis."""

    def __init__(
        self, record: Callable[[int, int], TraceRecording], interpolate: bool, jobs: int = 1
    ) -> None:
        self._record = record
        self.interpolating = interpolate
        self._learned: dict[int, TraceInterpolator] = {}
        self.traces = self.synthesized = 0
        self.differed = False
        self._jobs = jobs
        self._ready: dict[tuple[int, int], TraceRecording] = {}  # (batch, length): traced ahead

    def _learner(self, length: int) -> TraceInterpolator:
        return self._learned.setdefault(length, TraceInterpolator(points=2))

    def prepare(
        self, batch: int, lengths: Sequence[int], synthesize: bool, say: Callable[[str], None]
    ) -> None:
        """Trace the recordings ``at`` would trace at ``batch`` for ``lengths``, ``jobs`` at once
        in forked processes (where one fails, all here, in order: an error is raised as one at
        a time); ``at`` takes them up."""
        if self._jobs <= 1:
            return
        needed = [
            length
            for length in dict.fromkeys(lengths)
            if not (self.interpolating and synthesize and self._learner(length).can_synthesize(batch))
        ]
        if len(needed) < 2:
            return
        say(f"batch {batch}: tracing {len(needed)} lengths, {self._jobs} at once")
        made = run_forked_or_here([partial(self._record, batch, n) for n in needed], jobs=self._jobs)
        self._ready.update(((batch, n), recording) for n, recording in zip(needed, made, strict=True))

    def at(self, batch: int, length: int, synthesize: bool) -> tuple[TraceRecording, bool]:
        """(the recording, whether it was synthesized)."""
        learned = self._learner(length)
        if self.interpolating and synthesize:
            made = learned.synthesize(batch)
            if made is not None:
                self.synthesized += 1
                return made, True
        recording = self._ready.pop((batch, length), None)
        if recording is None:
            recording = self._record(batch, length)
        self.traces += 1
        if self.interpolating:
            self.differed = learned.add(batch, recording) or self.differed
        return recording, False

    def start_over(self, interpolate: bool) -> None:
        """A new search: nothing synthesized so far is compared with later traces."""
        self.interpolating = interpolate
        self.differed = False
        for learned in self._learned.values():
            learned.forget_synthesized()


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
    interpolate: bool = True,
    jobs: int | None = 1,
    description: Callable[[], str] | None = None,
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
        interpolate: synthesize the recordings of a length at batches beside two traced ones
            (see the module); ``False`` traces every batch at every length.
        jobs: processes that trace a probe's lengths at once (None: one per CPU core; 1, the
            default: one at a time here; the result is the same).
        description: gives the step's description, whose options the advice of a run that
            does not fit leaves out (``batch_advice.infeasible_advice``), where the replayed
            recordings carry none.

    Raises:
        NoFeasibleBatchSizeError: not even ``start_batch`` (nor batch 1 below it) fits.
    """
    say = progress or (lambda _line: None)
    margin = resolve_margin(margin_bytes, target.usable_bytes, target.gpu.name)
    recordings = _Recordings(record, interpolate, process_count(jobs))
    # The lengths every probe records, in the order the run first needs them.
    distinct = [
        n
        for n in dict.fromkeys(run_order(lengths, steps=steps, pad_to=pad_to, seed=seed))
        if max_length is None or n <= max_length
    ]
    probes: dict[int, EnvelopeProbe] = {}
    order: list[int] = []
    envelopes: dict[int, Envelope] = {}

    def probe(batch: int, synthesize: bool = True) -> EnvelopeProbe:
        say(f"batch {batch}: replaying the whole run")
        freeze()  # the collector skips what earlier probes made (frozen_heap.py)
        recordings.prepare(batch, distinct, synthesize, say)
        made_up = []

        def at_length(length: int) -> TraceRecording:
            recording, synthesized = recordings.at(batch, length, synthesize)
            made_up.append(synthesized)
            return recording

        env = predict_envelope(
            at_length,
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
        envelopes[batch] = env
        return EnvelopeProbe(
            batch, ok, env.worst_peak_reserved_bytes, env.first_oom_step, any(made_up)
        )

    def fits(batch: int, synthesize: bool) -> bool:
        if batch not in order:
            order.append(batch)
        if batch not in probes:
            probes[batch] = probe(batch, synthesize)
        return probes[batch].fits

    def confirmed(batches: Sequence[int]) -> bool:
        """Trace the synthesized probes among ``batches`` at every length; whether each
        recording and verdict is the synthesized one."""
        same = True
        for batch in batches:
            synthesized = probes.get(batch)
            if synthesized is None or not synthesized.synthesized:
                continue
            traced = probes[batch] = probe(batch, synthesize=False)
            same = same and (traced.fits, traced.worst_peak_reserved_bytes) == (
                synthesized.fits,
                synthesized.worst_peak_reserved_bytes,
            )
        return same and not recordings.differed

    with frozen_heap() as freeze:
        low, high = _search(fits, start_batch, max_batch)
        searches = 1
        while recordings.interpolating and not confirmed([b for b in (low, high) if b]):
            searches += 1
            recordings.start_over(interpolate=searches < INTERPOLATED_SEARCHES)
            for batch in [b for b, p in probes.items() if p.synthesized]:
                del probes[batch]
            order.clear()
            low, high = _search(fits, start_batch, max_batch)
    if low == 0:
        failed = order[-1]
        described = envelopes[failed].prediction.description
        if not described and description is not None:
            described = description()
        raise _infeasible(probes[failed], target, margin, described)
    return EnvelopeFit(
        low,
        envelopes[low],
        tuple(probes[b] for b in order),
        margin,
        traces=recordings.traces,
        synthesized=recordings.synthesized,
    )


def _search(
    fits: Callable[[int, bool], bool], start_batch: int, max_batch: int
) -> tuple[int, int | None]:
    """(the largest batch found to fit, 0 for none; the smallest found not to, None for none):
    from ``start_batch`` halving until one fits, then doubling until one does not, then
    bisecting."""
    low, high = 0, None
    batch = min(start_batch, max_batch)
    while batch >= 1 and low == 0:
        if fits(batch, True):
            low = batch
        else:
            high = batch
            batch //= 2
    if low == 0:
        return low, high
    while high is None and low < max_batch:
        batch = min(low * 2, max_batch)
        if fits(batch, True):
            low = batch
        else:
            high = batch
    while high is not None and high - low > 1:
        middle = (low + high) // 2
        # The last size bisection tries becomes the answer or the size above it: traced
        # straight away, as confirming a synthesized one would trace it anyway.
        if fits(middle, high - low > 2):
            low = middle
        else:
            high = middle
    return low, high

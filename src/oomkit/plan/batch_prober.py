"""The probes of one batch search: each batch size predicted once, traced or synthesized.

``BatchProber`` is what ``max_batch_size`` (batch_search.py) asks "does this batch fit?": it
predicts each size once (``batch_probe.py``), counts traces, reports progress, synthesizes the
recordings of sizes beside two traced ones of one structure (``trace_interpolation.py``), traces
the sizes an answer rests on to confirm them, and, with ``jobs`` above 1, traces the sizes the
search asks for next ahead of it in forked processes (``executors/forked.py ForkedCall``).

This module never imports torch at import time; a probe imports ``oomkit.prediction.tracing``
when it runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

from oomkit.core.target import Target
from oomkit.executors.forked import ForkedCall
from oomkit.plan.batch_probe import (
    BatchProbe,
    Progress,
    StepBuilder,
    new_model_cache,
    predict_searched,
    probe_record,
    record_step,
)
from oomkit.plan.trace_interpolation import TraceInterpolator
from oomkit.prediction.predictor import Prediction

__all__ = ["BatchProber"]

# The least time a search waits for a size traced in the background before tracing it here:
# its process runs at the lowest priority, so a machine whose cores are all busy may hardly
# run it. The wait is as long as the longest trace made here, and at least this: waiting costs
# at most about one trace more than tracing here at once (a name of its own: tests raise it).
_BACKGROUND_WAIT_MIN_S = 1.0
# The wait looks this often at the CPU the process gets (where Linux says): one that got less
# than this share of a core while this process waited is starved by other work, and its size
# is traced here at once.
_BACKGROUND_LOOK_S = 0.1
_STARVED_CPU_SHARE = 0.5
# A size traced ahead at normal priority is waited for up to 60 s and 10 traces' time, and given
# up on at once when its process is stuck: over this long it used less than this share of a core
# (a deadlocked process uses none; one of normal priority gets a fair share however busy the
# machine is). A size forked after torch's OpenMP threads had started once waited out the whole
# time limit (executors/forked.py _one_kernel_thread); a stuck process now costs this long.
_STUCK_LOOK_S = 2.0
_STUCK_CPU_SHARE = 0.02


class BatchProber:
    """Predicts batch sizes once each, counting traces and reporting progress.

    With ``interpolate``, a part (training or evaluation step) at a batch beside two traced
    ones of one structure with sizes affine in the batch is not traced: its recording is
    synthesized (``trace_interpolation.TraceInterpolator``) and replayed. ``confirm`` then traces
    the batches an answer rests on; ``forget_synthesized`` and ``fall_back`` (which also stops
    the interpolation) drop every synthesized probe for a search again.

    With ``jobs`` above 1, ``trace_ahead`` starts the training step of sizes the search will
    trace next in forked processes (``executors/forked.py ForkedCall``), up to ``jobs - 1``
    at once, while this process traces its own; a probe takes up the recording made ahead for
    its size, learned from and replayed here in the search's order, so every decision is the
    one-at-a-time one. A process that fails (the step raised, it died, it is stuck: no CPU used
    over ``_STUCK_LOOK_S``, or it gave no answer in time) is not believed: the size is traced
    here, so an error is raised as one at a time.
    The first size synthesized is traced ahead too, in the background (``_speculate``): a
    search after a difference traces it first.
    """

    def __init__(
        self,
        build_step: StepBuilder,
        eval_step: StepBuilder | None,
        *,
        target: Target,
        steps: int,
        usable_bytes: int,
        progress: Progress | None,
        interpolate: bool,
        jobs: int = 1,
    ) -> None:
        self._build_step = build_step
        self._eval_step = eval_step
        self._target = target  # the GPU less the margin
        self._steps = steps
        self._usable_bytes = usable_bytes
        self._margin_bytes = usable_bytes - target.usable_bytes  # less_margin's
        self._progress = progress
        self.probes: dict[int, BatchProbe] = {}
        self.order: list[int] = []
        self.traces = 0  # recordings traced for real
        self.synthesized = 0  # recordings synthesized instead (trace_interpolation.py)
        self._made = 0  # predictions of a batch made (probes and confirmations), for progress
        self._closed = True  # the last progress call said (made, made)
        self._interpolators: dict[str, TraceInterpolator] | None = (
            # Two traced sizes of one structure are enough to synthesize from: the search traces
            # the sizes its answer rests on and compares them with their synthesis, which is the
            # check a third learned size would have made (trace_interpolation.py).
            {"train step": TraceInterpolator(points=2), "eval step": TraceInterpolator(points=2)}
            if interpolate
            else None
        )
        # The model is built once for the whole search (model_cache.py); made at the first probe.
        self.models: Any = None
        # Called before each probe: keeps the collector off what earlier ones made (frozen_heap.py).
        self.freeze: Callable[[], None] = lambda: None
        self._differed = False  # a size traced in this search differed from its synthesis
        self._jobs = jobs  # processes tracing at once, this one included
        self._ahead: dict[int, ForkedCall[tuple[Any, str]]] = {}  # training steps, by batch
        self.unused_ahead = 0  # started ahead and not needed
        self._trace_wall_s = 0.0  # the longest trace made here, to bound a wait for one ahead
        self._speculated = False  # the first synthesized size was offered to _speculate

    @property
    def interpolating(self) -> bool:
        """Whether probes may still be synthesized."""
        return self._interpolators is not None

    @property
    def traced_any(self) -> bool:
        """Whether a training step was traced (here or ahead) or is being traced ahead."""
        return self.traces > 0 or bool(self._ahead)

    def traced(self, batch_size: int) -> bool:
        """Whether ``batch_size`` was predicted from a trace (not synthesized)."""
        probe = self.probes.get(batch_size)
        return probe is not None and not probe.synthesized

    @property
    def traces_ahead(self) -> bool:
        """Whether sizes may be traced ahead (``jobs`` above 1 and processes to be had)."""
        return self._jobs > 1

    def likely_fits(self, batch_size: int) -> bool:
        """Whether the training step at ``batch_size`` fits by its synthesis (True when it
        cannot be synthesized): a guess of which size the search asks for next, never a probe."""
        interpolator = None if self._interpolators is None else self._interpolators["train step"]
        recording = None if interpolator is None else interpolator.synthesize(batch_size, keep=False)
        if recording is None:
            return True
        return predict_searched(recording, self._target, self._margin_bytes).fits

    def trace_ahead(self, batch_sizes: Iterable[int]) -> None:
        """Start tracing the training step at those of ``batch_sizes`` not traced yet, each in
        a forked process, while at most ``jobs - 1`` are: sizes the search will trace next.

        A size being traced in the background is traced again at this process's priority (the
        background one is stopped, ``unused_ahead``): at nice 19 it would give way to the very
        traces it is needed beside (it had started when the search first synthesized, a few
        replays ago).
        """
        for batch_size in batch_sizes:
            busy = sum(1 for call in self._ahead.values() if not call.background)
            if busy >= self._jobs - 1:
                return
            running = self._ahead.get(batch_size)
            if running is not None and running.background:
                del self._ahead[batch_size]
                running.cancel(wait=False)
                self.unused_ahead += 1
            if not self._start_ahead(batch_size):
                return

    def _speculate(self, batch_size: int) -> None:
        """Trace ahead, in the background, a size a later search would trace first.

        The first size a search synthesizes is the first a search after a difference traces
        (between the sizes learned first and the ones confirmed, of two structures, nothing is
        synthesized). Its process runs at the lowest CPU priority and takes no process of
        ``jobs``: it uses the core this search leaves idle while it synthesizes (with 2 cores,
        one), and gives way to the sizes traced ahead to confirm an answer, which it never
        slows. A search with no difference never asks for it (``unused_ahead``).
        """
        if self._jobs > 1:
            self._start_ahead(batch_size, background=True)

    def _start_ahead(self, batch_size: int, *, background: bool = False) -> bool:
        """Start tracing ``batch_size`` in a forked process unless it is traced or being
        traced; False when no process could be started (all is traced here from then on).
        ``background``: at the lowest CPU priority (``ForkedCall``), outside the ``jobs``."""
        if batch_size in self._ahead or self.traced(batch_size):
            return True
        if self.models is None:
            self.models = new_model_cache()
        self.freeze()  # what exists now is shared with the process, never copied
        record = partial(
            record_step,
            self._build_step,
            "train step",
            batch_size,
            target=self._target,
            steps=self._steps,
            models=self.models,
        )
        try:
            self._ahead[batch_size] = ForkedCall(record, background=background)
        except OSError:  # no process to be had (memory, a process limit): trace here
            self._jobs = 1
            return False
        return True

    def stop_ahead(self) -> None:
        """Stop every process still tracing ahead; their sizes count as ``unused_ahead``."""
        for call in self._ahead.values():
            call.cancel(wait=not call.background)
        self.unused_ahead += len(self._ahead)
        self._ahead.clear()

    def fits(self, batch_size: int, remaining: int, *, synthesize: bool = True) -> bool:
        """Whether ``batch_size`` fits (predicted once; later calls reuse the result).

        ``remaining`` is how many more probes the search may make after this one, for progress.
        ``synthesize=False`` traces it even where it could be synthesized: a size the answer
        will rest on either way, which ``confirm`` would trace anyway.
        """
        if batch_size not in self.order:
            self.order.append(batch_size)
        probe = self.probes.get(batch_size)
        if probe is None:
            probe, differs = self._probe(batch_size, synthesize=synthesize)
            # A size traced where it could have been synthesized, and not as synthesis would
            # have made it: the sizes this search synthesized may be wrong too.
            self._differed = self._differed or differs
            self.probes[batch_size] = probe
            # Confirming an interpolated answer traces up to 2 more batches.
            self._report(remaining + (2 if self.interpolating else 0))
        return probe.fits

    def confirm(self, batch_sizes: Sequence[int]) -> bool:
        """Trace the synthesized probes among ``batch_sizes`` for real; whether each traced
        recording is the synthesized one (so its prediction is too: same fits, same peaks) and
        no size this search traced differed from its synthesis either.

        Each traced probe replaces the synthesized one, and its recordings are learned from
        (so a search after a difference interpolates from them too).
        """
        confirmed = not self._differed
        for batch_size in batch_sizes:
            synthesized = self.probes.get(batch_size)
            if synthesized is None or not synthesized.synthesized:
                continue
            # The other sizes to confirm are traced ahead meanwhile.
            self.trace_ahead(b for b in batch_sizes if b != batch_size)
            traced, differs = self._probe(batch_size, synthesize=False)
            self._report(0)
            self.probes[batch_size] = traced
            confirmed = confirmed and not differs and _same_verdict(traced, synthesized)
        return confirmed

    def forget_synthesized(self) -> None:
        """Forget every synthesized probe; the search starts over (traced probes are kept)."""
        self.probes = {b: p for b, p in self.probes.items() if not p.synthesized}
        self.order = []
        self._differed = False
        for interpolator in (self._interpolators or {}).values():
            interpolator.forget_synthesized()

    def fall_back(self) -> None:
        """Forget every synthesized probe and synthesize no more; the search starts over."""
        self._interpolators = None
        self.forget_synthesized()

    def close(self) -> None:
        """Tell progress the last prediction was made."""
        if self._progress is not None and not self._closed:
            self._progress(self._made, self._made)
            self._closed = True

    def _report(self, remaining: int) -> None:
        self._made += 1
        self._closed = remaining == 0
        if self._progress is not None:
            self._progress(self._made, self._made + remaining)

    def _probe(self, batch_size: int, *, synthesize: bool) -> tuple[BatchProbe, bool]:
        """(the probe at ``batch_size``, whether a part traced for real differs from the
        recording the interpolation would have synthesized there)."""
        if self.models is None:
            self.models = new_model_cache()
        self.freeze()
        train, train_synthesized, train_differs = self._predict(
            self._build_step, "train step", batch_size, self._steps, synthesize
        )
        if train_synthesized and not self._speculated:
            self._speculated = True
            self._speculate(batch_size)
        evaluation, eval_synthesized, eval_differs = None, False, False
        # A batch whose training step does not fit fails whatever its evaluation needs.
        if self._eval_step is not None and train.fits:
            evaluation, eval_synthesized, eval_differs = self._predict(
                self._eval_step, "eval step", batch_size, 1, synthesize
            )
        probe = probe_record(
            batch_size,
            train,
            evaluation,
            self._usable_bytes,
            synthesized=train_synthesized or eval_synthesized,
            margin_bytes=self._margin_bytes,
        )
        return probe, train_differs or eval_differs

    def _predict(
        self, builder: StepBuilder, what: str, batch_size: int, steps: int, synthesize: bool
    ) -> tuple[Prediction, bool, bool]:
        """(the prediction of one part, whether its recording was synthesized, whether the
        recording traced differs from the one that would have been synthesized)."""
        interpolator = None if self._interpolators is None else self._interpolators[what]
        if interpolator is not None and synthesize:
            recording = interpolator.synthesize(batch_size)
            if recording is not None:
                self.synthesized += 1
                basis = ", ".join(str(b) for b in sorted(interpolator.basis(batch_size) or ()))
                description = f"{what} at batch {batch_size}, interpolated from batches {basis}"
                prediction = predict_searched(recording, self._target, self._margin_bytes, description)
                return prediction, True, False
        ahead = self._ahead.pop(batch_size, None) if what == "train step" else None
        recorded = None
        if ahead is not None and ahead.background:
            recorded = _background_result(ahead, self._trace_wall_s)
        elif ahead is not None:
            # Traced ahead: wait for it (a process that hangs is given up on, and the size
            # traced here: a trace there may take a cold start's time, never this long).
            recorded = ahead.result_unless_stalled(
                wait_s=60 + 10 * self._trace_wall_s,
                look_s=_STUCK_LOOK_S,
                min_cpu_share=_STUCK_CPU_SHARE,
            )
        if recorded is None:
            start = time.perf_counter()
            recorded = record_step(
                builder, what, batch_size, target=self._target, steps=steps, models=self.models
            )
            self._trace_wall_s = max(self._trace_wall_s, time.perf_counter() - start)
        recording, description = recorded
        self.traces += 1
        # Learned from; `add` says whether it differs from what would have been synthesized.
        differs = interpolator is not None and interpolator.add(batch_size, recording)
        prediction = predict_searched(recording, self._target, self._margin_bytes, description)
        return prediction, False, differs


def _background_result(call: ForkedCall[tuple[Any, str]], trace_wall_s: float) -> tuple[Any, str] | None:
    """What a size traced in the background gave, or ``None``: trace it here.

    Waited for while it computes, as long as a trace here takes (``trace_wall_s``, at least
    ``_BACKGROUND_WAIT_MIN_S``), and given up on at once when, over a look of
    ``_BACKGROUND_LOOK_S``, it used less than half that time in CPU (``_STARVED_CPU_SHARE``):
    other work holds the cores, and a nice-19 process would take far longer than a trace here.
    """
    return call.result_unless_stalled(
        wait_s=max(_BACKGROUND_WAIT_MIN_S, trace_wall_s),
        look_s=_BACKGROUND_LOOK_S,
        min_cpu_share=_STARVED_CPU_SHARE,
    )


def _same_verdict(traced: BatchProbe, synthesized: BatchProbe) -> bool:
    """Whether two probes of one batch agree on the fit and the peaks."""
    return (traced.fits, traced.peak_reserved_bytes, traced.peak_allocated_bytes) == (
        synthesized.fits,
        synthesized.peak_reserved_bytes,
        synthesized.peak_allocated_bytes,
    )

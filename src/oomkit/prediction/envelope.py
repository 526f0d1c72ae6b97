"""The epoch envelope: a run of steps of different lengths replayed as one trace.

Variable-length batches make the caching allocator split and cache blocks of ever-different
sizes; reserved memory creeps until a step runs out of memory although the longest step alone
fits. A GPU keeps its cache across steps, so the only honest answer replays the whole run. Each
distinct padded length is recorded once (two steps: the first creates the optimizer state, the
second is the steady state); :func:`splice_run` then builds one recording of the run: the first
step's recording up to the end of its first step, then, for every further step, the steady step
of that step's length. Tensors that outlive a step (parameters, gradients, optimizer state,
workspaces) are matched across recordings by category, module and size, so each spliced step
frees and reuses the same tensors the real run would; a step's inputs are the next batch: they
are allocated before the previous batch is freed (``x = next(loader)`` rebinds after the new
tensor exists). The replay is the predictor's own (``predict_recording``), so the cache, splitting
and reuse carry across steps as on a GPU. A constant length gives exactly the events of the
ordinary multi-step recording, so exactly its prediction.

Where it may differ: a step that keeps memory across steps other than those categories (a
growing cache of its own, a logged tensor kept in a list) is refused, not approximated.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from oomkit.core.target import Target
from oomkit.core.trace import TraceEvent
from oomkit.errors import ConfigError
from oomkit.prediction.predictor import Prediction, predict_recording
from oomkit.prediction.tracing.recording import TraceRecording

__all__ = [
    "Envelope",
    "EnvelopeRemedy",
    "REMEDY_SETTINGS",
    "SWAPPED_CATEGORIES",
    "envelope_from_prediction",
    "predict_envelope",
    "splice_run",
]

# Categories whose tensors a new batch replaces at a step boundary (the data loader's output).
SWAPPED_CATEGORIES = frozenset({"input"})

_Key = tuple[str, str, int]  # (category, module, size)


@dataclass(frozen=True)
class EnvelopeRemedy:
    """One change re-simulated over the whole run.

    Attributes:
        name: what changes ("expandable_segments:True", "largest batch first", "--pad-to 64").
        peak_reserved_bytes: the run's peak reserved memory with it.
        saving_bytes: the envelope's peak minus that (negative: it costs memory).
        first_oom_step: the first step (from 1) that runs out of memory with it, or None.
        note: what else it changes (e.g. "truncates 12 samples").
    """

    name: str
    peak_reserved_bytes: int
    saving_bytes: int
    first_oom_step: int | None
    note: str = ""


@dataclass(frozen=True)
class Envelope:
    """A whole run's memory, step by step.

    Attributes:
        lengths: the padded length of every step, in run order.
        per_step_peak_reserved_bytes: each step's peak reserved; with an OOM, the steps up to
            and including the one that ran out of memory (the replay stops there).
        worst_step: the step (from 1) with the highest peak reserved.
        worst_length: its length.
        worst_peak_reserved_bytes: that peak.
        first_oom_step: the first step (from 1) that would run out of memory, or None.
        longest_alone_peak_reserved_bytes: the longest length's own steady step, replayed
            alone (what a single-step prediction at that length says).
        prediction: the spliced run's prediction (its ``step_peaks`` are the per-step figures).
        remedies: changes re-simulated over the run, largest saving first.
    """

    lengths: tuple[int, ...]
    per_step_peak_reserved_bytes: tuple[int, ...]
    worst_step: int
    worst_length: int
    worst_peak_reserved_bytes: int
    first_oom_step: int | None
    longest_alone_peak_reserved_bytes: int
    prediction: Prediction
    remedies: tuple[EnvelopeRemedy, ...] = ()

    @property
    def steps(self) -> int:
        """How many steps the run has."""
        return len(self.lengths)

    @property
    def creep_bytes(self) -> int:
        """How much higher the run peaks than its longest step alone (the cache's creep)."""
        return self.worst_peak_reserved_bytes - self.longest_alone_peak_reserved_bytes


def _key(event: TraceEvent) -> _Key:
    return (event.tag("category", ""), event.tag("module", ""), event.size)


def _renumbered(event: TraceEvent, ident: int) -> TraceEvent:
    """``event`` under the run's id ``ident`` (built directly: ``dataclasses.replace`` per event
    of a hundreds-of-steps run cost more than its replay)."""
    return TraceEvent(
        event.action, ident, event.size, event.stream, event.time_us, event.frames, event.tags
    )


def _live_at(events: Sequence[TraceEvent], stop: int) -> dict[int, TraceEvent]:
    """id -> its alloc event, for every allocation live before ``events[stop]``."""
    live: dict[int, TraceEvent] = {}
    for ev in events[:stop]:
        if ev.action == "alloc":
            live[ev.address] = ev
        elif ev.action == "free_requested":
            live.pop(ev.address, None)
    return live


def _grouped(live: Mapping[int, TraceEvent]) -> dict[_Key, list[int]]:
    groups: dict[_Key, list[int]] = {}
    for ident, ev in live.items():  # insertion order = allocation order
        groups.setdefault(_key(ev), []).append(ident)
    return groups


def splice_run(recordings: Mapping[int, TraceRecording], order: Sequence[int]) -> TraceRecording:
    """One recording of a run whose step ``i`` has length ``order[i]``.

    Args:
        recordings: a two-step recording (at least) per distinct length in ``order``.
        order: the length of every step, in run order.

    Returns:
        A recording with ``len(order)`` steps and fresh, unique allocation ids.

    Raises:
        ConfigError: a length has no recording, a recording has fewer than two steps, or the
            state that outlives a step differs between lengths in anything but its inputs.
    """
    if not order:
        raise ConfigError("an envelope needs at least one step")
    for length in set(order):
        rec = recordings.get(length)
        if rec is None:
            raise ConfigError(f"no recording for length {length}")
        if len(rec.step_starts) < 2:
            raise ConfigError(f"the recording for length {length} has fewer than two steps")
    counter = iter(range(1, 2**62))
    events: list[TraceEvent] = []
    # The run's live state: key -> global ids in allocation order; and each live id's key.
    state: dict[_Key, list[int]] = {}
    key_of: dict[int, _Key] = {}

    def made(ev: TraceEvent) -> int:
        ident = next(counter)
        key = _key(ev)
        state.setdefault(key, []).append(ident)
        key_of[ident] = key
        events.append(_renumbered(ev, ident))
        return ident

    def freed(ev: TraceEvent, ident: int) -> None:
        if ev.action == "free_requested":
            key = key_of.pop(ident)
            state[key].remove(ident)
            if not state[key]:
                del state[key]
        events.append(_renumbered(ev, ident))

    first = recordings[order[0]]
    ids: dict[int, int] = {}
    for ev in first.events[: first.step_starts[1]]:
        if ev.action == "alloc":
            ids[ev.address] = made(ev)
        else:
            freed(ev, ids[ev.address])
    step_starts = [first.step_starts[0]]
    # What is live when each length's steady step starts, found once per length (a run
    # repeats its lengths many times).
    steady: dict[int, tuple[dict[int, TraceEvent], dict[_Key, list[int]]]] = {}
    # Each length's steady step, its allocations' keys found once: (event, key or None).
    steps_of: dict[int, list[tuple[TraceEvent, _Key | None]]] = {}
    for length in dict.fromkeys(order[1:]):
        rec = recordings[length]
        live = _live_at(rec.events, rec.step_starts[1])
        steady[length] = (live, _grouped(live))
        end = rec.step_starts[2] if len(rec.step_starts) > 2 else len(rec.events)
        steps_of[length] = [
            (ev, _key(ev) if ev.action == "alloc" else None)
            for ev in rec.events[rec.step_starts[1] : end]
        ]
    append = events.append
    for length in order[1:]:
        their_live, theirs = steady[length]
        changes = (
            (theirs.keys() - state.keys(), "appears"),
            (state.keys() - theirs.keys(), "disappears"),
        )
        for keys, what in changes:
            for key in sorted(keys):
                if key[0] not in SWAPPED_CATEGORIES:
                    raise ConfigError(_state_error(length, key, what))
        step_starts.append(len(events))
        local: dict[int, int] = {}
        old_batch: list[int] = []
        for key, group in theirs.items():
            mine = state.get(key, [])
            if len(mine) == len(group):
                local.update(zip(group, mine, strict=True))
            elif key[0] in SWAPPED_CATEGORIES:
                old_batch.extend(mine)
                for ident in group:  # the next batch, made before the last one is released
                    local[ident] = made(their_live[ident])
            else:
                raise ConfigError(
                    _state_error(length, key, f"counts {len(group)}, not {len(mine)}")
                )
        old_batch.extend(i for k in state.keys() - theirs.keys() for i in state[k])
        for ident in old_batch:
            size = key_of[ident][2]
            tags = (("category", key_of[ident][0]),)
            freed(TraceEvent("free_requested", ident, size, tags=tags), ident)
            freed(TraceEvent("free_completed", ident, size, tags=tags), ident)
        # made() and freed() written out: this loop runs once per event of every step.
        for ev, made_key in steps_of[length]:
            if made_key is not None:
                ident = next(counter)
                same = state.get(made_key)
                if same is None:
                    state[made_key] = [ident]
                else:
                    same.append(ident)
                key_of[ident] = made_key
                local[ev.address] = ident
            else:
                found = local.get(ev.address)
                if found is None:
                    raise ConfigError(
                        f"the step at length {length} frees a tensor made before the recording "
                        "began; record it with its model and optimizer tracked"
                    )
                ident = found
                if ev.action == "free_requested":
                    freed_key = key_of.pop(ident)
                    members = state[freed_key]
                    members.remove(ident)
                    if not members:
                        del state[freed_key]
            append(_renumbered(ev, ident))
    return TraceRecording(
        events=tuple(events),
        warnings=first.warnings,
        step_starts=tuple(step_starts),
        bytes_by_category=dict(first.bytes_by_category),
        kernel_choices=dict(first.kernel_choices),
        assumptions=dict(first.assumptions),
        memory_fraction=first.memory_fraction,
    )


def _state_error(length: int, key: _Key, what: str) -> str:
    category, module, size = key
    where = f" of module {module!r}" if module else ""
    return (
        f"at length {length} the state that outlives a step differs: a {size}-byte {category} "
        f"tensor{where} {what}. An envelope splices steps whose parameters, gradients and "
        "optimizer state do not depend on the length; build the model without length-sized "
        "buffers (or pass the longest length as its maximum)"
    )


def _oom_step(prediction: Prediction) -> int | None:
    """The step (from 1) whose events hold the failing alloc, or None without an OOM."""
    if prediction.oom is None:
        return None
    return bisect.bisect_right(prediction.step_starts, prediction.oom.event_index)


def envelope_from_prediction(
    lengths: Sequence[int],
    prediction: Prediction,
    *,
    longest_alone_peak_reserved_bytes: int,
    remedies: Sequence[EnvelopeRemedy] = (),
) -> Envelope:
    """The envelope of a spliced run's prediction (step ``i`` ran at ``lengths[i]``)."""
    peaks = tuple(p.peak_reserved_bytes for p in prediction.step_peaks)
    if not peaks:
        raise ConfigError("the run recorded no step")
    worst = max(range(len(peaks)), key=lambda i: (peaks[i], -i))
    return Envelope(
        lengths=tuple(lengths),
        per_step_peak_reserved_bytes=peaks,
        worst_step=worst + 1,
        worst_length=lengths[worst],
        worst_peak_reserved_bytes=peaks[worst],
        first_oom_step=_oom_step(prediction),
        longest_alone_peak_reserved_bytes=longest_alone_peak_reserved_bytes,
        prediction=prediction,
        remedies=tuple(sorted(remedies, key=lambda r: (-r.saving_bytes, r.name))),
    )


# Allocator settings re-simulated over the run (each valid on every modelled release >= 2.9;
# GC needs a fraction below 1.0 to run at all on 2.12+: ref §7).
REMEDY_SETTINGS = (
    "expandable_segments:True",
    "max_split_size_mb:128",
    "max_split_size_mb:512",
    "garbage_collection_threshold:0.8,per_process_memory_fraction:0.99",
)
# Bucket sizes tried as --pad-to remedies, and the most new lengths one may record.
REMEDY_PAD_TO = (64, 256)
MAX_NEW_RECORDINGS = 8
# "A smaller max length" caps the run at this percentile of its lengths.
CAP_PERCENTILE = 0.95


def predict_envelope(
    record: Callable[[int], TraceRecording],
    lengths: Sequence[int],
    target: Target,
    *,
    steps: int | None = None,
    pad_to: int = 1,
    seed: int | None = None,
    max_length: int | None = None,
    remedies: bool = True,
    description: str | Callable[[], str] = "",
    progress: Callable[[str], None] | None = None,
    jobs: int | None = 1,
    record_jobs: int | None = 1,
) -> Envelope:
    """Record each distinct padded length once, replay the whole run, and price remedies.

    Args:
        record: records two steps (at least) at one sequence length, e.g. ``lambda n:
            trace_step(*build(n), steps=2, target=target)``.
        lengths: the dataset's per-step lengths, in dataset order (``read_lengths``).
        target: the GPU, allocator setting and versions.
        steps: steps to run (None: one pass over ``lengths``; more cycles through them).
        pad_to: pad every length up to a multiple of this (``pad_to_multiple_of``).
        seed: shuffle each pass with this seed; None keeps the dataset order.
        max_length: the model's longest sequence; a longer length is an error.
        remedies: re-simulate the run under each remedy (allocator settings, largest first,
            padding buckets, a capped length).
        description: what is predicted, for reports (or a function giving it once the first
            length is recorded).
        progress: called with a short line before each recording and replay.
        jobs: processes that replay the remedies (None: one per CPU core; 1: one at a time,
            here); forked after every length they need is recorded, with the same results.
        record_jobs: processes that record the lengths (None: one per CPU core; 1, the
            default: one at a time, here). The first length is recorded here (so ``record``'s
            effects here, such as a description it notes, happen), the others in forked
            processes at once; where one fails they are all recorded here, so an error is
            raised as one at a time.

    Raises:
        ConfigError: a bad lengths list, steps or pad_to, or a length above ``max_length``.
    """
    from oomkit.prediction.lengths import run_order

    order = run_order(lengths, steps=steps, pad_to=pad_to, seed=seed)
    if max_length is not None and max(order) > max_length:
        raise ConfigError(
            f"a step of length {max(order)} (padded to --pad-to {pad_to}) is longer than the "
            f"model's maximum, {max_length}; drop or truncate those samples"
        )
    say = progress or (lambda _line: None)
    recordings: dict[int, TraceRecording] = {}
    from oomkit.executors.forked import process_count, run_forked, run_forked_or_here

    recorders = process_count(record_jobs)

    def recorded(wanted: Sequence[int]) -> dict[int, TraceRecording]:
        new = [length for length in dict.fromkeys(wanted) if length not in recordings]
        if recorders > 1 and len(new) > 2:
            say(f"recording a step at length {new[0]}")
            recordings[new[0]] = record(new[0])
            say(f"recording a step at {len(new) - 1} more lengths, {recorders} at once")
            made = run_forked_or_here(
                [functools.partial(record, n) for n in new[1:]], jobs=recorders
            )
            recordings.update(zip(new[1:], made, strict=True))
        for length in new:
            if length not in recordings:
                say(f"recording a step at length {length}")
                recordings[length] = record(length)
        return recordings

    # The last run spliced: the allocator-setting remedies replay the run itself again.
    last: list[tuple[tuple[int, ...], TraceRecording]] = []

    def run(run_order_: Sequence[int], tgt: Target, quiet: bool = False) -> Prediction:
        key = tuple(run_order_)
        if last and last[0][0] == key:
            spliced = last[0][1]
        else:
            spliced = splice_run(recorded(run_order_), run_order_)
            last[:] = [(key, spliced)]
        if not quiet:
            say(f"replaying {len(run_order_)} steps ({tgt.alloc_conf or 'default settings'})")
        text = description() if callable(description) else description
        return predict_recording(spliced, target=tgt, description=text)

    prediction = run(order, target)
    longest = max(order)
    alone = predict_recording(splice_run(recorded([longest]), [longest, longest]), target=target)
    baseline = prediction.peak_reserved_bytes
    found: list[EnvelopeRemedy] = []

    def priced(name: str, pred: Prediction, note: str = "") -> None:
        saving = baseline - pred.peak_reserved_bytes
        found.append(EnvelopeRemedy(name, pred.peak_reserved_bytes, saving, _oom_step(pred), note))

    if remedies:
        from oomkit.core.allocator import AllocatorConfig

        # Each remedy: (name, note, run order, target). Found first, their lengths recorded
        # here, then the runs replayed, in forked processes when jobs allows (tracing stays in
        # this one).
        runs: list[tuple[str, str, tuple[int, ...], Target]] = []
        for setting in REMEDY_SETTINGS:
            text = ",".join(x for x in (target.alloc_conf, setting) if x)
            try:
                config = AllocatorConfig.parse(text, torch_version=target.torch_version)
            except ConfigError:
                continue  # not a setting this release accepts (or not with the user's)
            runs.append(
                (setting, "", tuple(order), dataclasses.replace(target, allocator_config=config))
            )
        first = run_order(lengths, steps=steps, pad_to=pad_to, seed=seed, largest_first=True)
        if first != order:
            runs.append(
                ("largest batch first", "moves the longest step to the front", tuple(first), target)
            )
        for bucket in REMEDY_PAD_TO:
            if bucket <= pad_to:
                continue
            bucketed = run_order(lengths, steps=steps, pad_to=bucket, seed=seed)
            if max_length is not None and max(bucketed) > max_length:
                continue
            new = set(bucketed) - set(recordings)
            if len(new) > MAX_NEW_RECORDINGS:
                continue
            recorded(bucketed)
            runs.append(
                (f"--pad-to {bucket}", f"{len(set(bucketed))} shapes", tuple(bucketed), target)
            )
        ranked = sorted(order)
        cap = ranked[min(len(ranked) - 1, int(CAP_PERCENTILE * len(ranked)))]
        if cap < longest:
            capped = tuple(min(n, cap) for n in order)
            cut = sum(1 for n in order if n > cap)
            note = f"truncates {cut} of {len(order)} steps (the longest {100 - int(CAP_PERCENTILE * 100)}%)"
            runs.append((f"max length {cap}", note, capped, target))
        say(f"replaying {len(runs)} remedies over {len(order)} steps")
        predictions = run_forked(
            [functools.partial(run, run_order_, tgt, quiet=True) for _, _, run_order_, tgt in runs],
            jobs=jobs,
        )
        for (name, note, _, _), pred in zip(runs, predictions, strict=True):
            priced(name, pred, note)
    return envelope_from_prediction(
        order,
        prediction,
        longest_alone_peak_reserved_bytes=alone.peak_reserved_bytes,
        remedies=found,
    )

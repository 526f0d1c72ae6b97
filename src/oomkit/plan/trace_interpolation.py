"""A batch-linear step's recording at any batch, synthesized from recordings traced at others.

A training step whose tensors scale with the batch records the same events at every batch size:
the same allocations and frees in the same order, from the same code, with the same tags; only
the sizes differ, and each is an affine function of the batch (``size = a + b * batch``: a weight
or an optimizer state is the ``a``, an activation of shape ``(batch, seq, hidden)`` the ``b``).
The sizes are the requested ones (``TraceEvent.size`` of a recording); the caching allocator's
rounding happens later, in the replay, so it does not break the affinity.

``TraceInterpolator`` learns this from real recordings of one builder: once enough traced batches
next to one another (three by default: fitted on two, checked on the third; ``points``) give
recordings of one structure (``recording_structure``) whose every size is exactly affine in the
batch with a whole-number slope, it synthesizes the recording at other batch sizes beside them,
to be replayed instead of traced. It refuses (``None``) when a size would be negative. What it
cannot see (a kernel choice that changes with the size, a workspace capped at some size) the
caller must catch by tracing the batches its answer rests on and comparing them with their
synthesis (``add`` says whether they differ); ``max_batch_size`` (batch_search.py) does, and so
learns from two.

A kernel the recorder emulates may pick its path by a size, and allocate temporaries on one
path only (GPT-2's embedding backward sorts its indices from batch 4 at seq 1024, from batch 2
at seq 2048). The recording notes each such call as a site (``TraceRecording.sites``,
``oomkit.prediction.tracing.emulation_sites``) with the integers the choice rests on. Before two
recordings are compared, each site's temporaries are taken out, and the site's integers become
values like the sizes (``_Normalized``): recordings made on either side of the size are then of
one structure, and a synthesized recording gets, at each site, the temporaries its plan gives
for the integers at that batch. A recording whose temporaries are not what its plan gives is
taken as it is (its temporaries events like any other), so it is never synthesized from
across the size that picks the path.
"""

from __future__ import annotations

import dataclasses
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from oomkit.core.trace import TraceEvent, new_trace_event

if TYPE_CHECKING:
    from oomkit.prediction.tracing.emulation_sites import EmulationSite

__all__ = [
    "INTERPOLATED_SEARCHES",
    "AffineSizes",
    "TraceInterpolator",
    "affine_sizes",
    "recording_structure",
    "same_recording",
    "synthesize_sizes",
]

# The recording fields that may change with the batch: the events' sizes (compared apart), the
# bytes per category (sums of those sizes), the sites' integers, and (with a site's temporaries)
# where the events and steps fall. Every other field must be equal at every batch.
_SIZED_FIELDS = ("events", "bytes_by_category", "sites", "step_starts")

# Searches a caller runs with synthesized recordings before one with traces only: each difference
# found adds traces on the far side of a change of code path, so a second search rarely differs
# again (max_batch_size, max_batch_for_run).
INTERPOLATED_SEARCHES = 3

# Intercepts and slopes, one pair per value: value(batch) = intercepts[i] + slopes[i] * batch.
AffineSizes = tuple[tuple[int, ...], tuple[int, ...]]


@dataclasses.dataclass(frozen=True)
class _Normalized:
    """A recording with its sites' temporaries taken out (``_normalize``).

    Attributes:
        events: the events but the temporaries.
        step_starts: each step's first event among ``events``.
        sites: (kind, index of the anchor in ``events``, params) of each site.
        by_category: the bytes per category, less the temporaries'.
        stripped: whether temporaries were taken out (False: the recording as it is, its
            temporaries events like any other).
    """

    events: tuple[TraceEvent, ...]
    step_starts: tuple[int, ...]
    sites: tuple[EmulationSite, ...]
    by_category: Mapping[str, int]
    stripped: bool


def _is_temporary(event: TraceEvent, names: frozenset[str]) -> bool:
    """Whether ``event`` allocates one of a site plan's temporaries (``names``)."""
    return event.action == "alloc" and event.tag("emulated") in names


def _normalize(recording: Any) -> _Normalized:
    """``recording`` without its sites' temporaries, if putting them back (``_restore``) with
    its own integers gives it back exactly; else as it is."""
    events = tuple(recording.events)
    by_category = dict(getattr(recording, "bytes_by_category", {}) or {})
    step_starts = tuple(getattr(recording, "step_starts", ()))
    sites = tuple(getattr(recording, "sites", ()) or ())
    plain = _Normalized(events, step_starts, sites, by_category, stripped=False)
    if not sites:
        return plain
    # Imported here: a recording with sites was made by the tracer, so torch is loaded already
    # (this module is imported without it).
    from oomkit.prediction.tracing.emulation_sites import SITE_PLANS, EmulationSite

    if any(site.kind not in SITE_PLANS or not 0 <= site.anchor < len(events) for site in sites):
        return plain
    dropped: set[int] = set()
    for site in sites:
        plan = SITE_PLANS[site.kind]
        # Back from the anchor over the temporaries allocated before it, then on from it over
        # those allocated after it, the frees of any of them and the call's other outputs a
        # program's steps sit beside (``SiteStep.offset``; the other plans' are all 0, and are
        # not computed here).
        index = site.anchor - 1
        while index >= 0 and _is_temporary(events[index], plan.names):
            dropped.add(events[index].address)
            index -= 1
        outputs = (
            max((step.offset for step in plan.program(site.params)), default=0)
            if plan.program is not None else 0
        )
        index = site.anchor + 1
        while index < len(events):
            event = events[index]
            if _is_temporary(event, plan.names):
                dropped.add(event.address)
            elif event.action == "alloc" and outputs:
                outputs -= 1
            elif event.action == "alloc" or event.address not in dropped:
                break
            index += 1
    kept: list[int] = [i for i, e in enumerate(events) if e.address not in dropped]
    position = {old: new for new, old in enumerate(kept)}
    if any(site.anchor not in position for site in sites):
        return plain
    less = dict(by_category)
    for event in events:
        if event.action == "alloc" and event.address in dropped:
            category = event.tag("category", "")
            less[category] = less.get(category, 0) - event.size
    normalized = _Normalized(
        events=tuple(events[i] for i in kept),
        step_starts=tuple(bisect_left(kept, start) for start in step_starts),
        sites=tuple(EmulationSite(s.kind, position[s.anchor], s.params) for s in sites),
        # A category only the temporaries had is left out, as a recording without them has it.
        by_category={k: v for k, v in less.items() if v or not by_category.get(k)},
        stripped=True,
    )
    restored = _restore(
        normalized,
        tuple(e.size for e in normalized.events),
        tuple(site.params for site in normalized.sites),
        normalized.by_category,
        next_id=max((e.address for e in events), default=0) + 1,
    )
    if _raw_key(restored, recording, events_only=True) != _raw_key(recording, recording, events_only=True):
        return plain
    return normalized


def _restore(
    normalized: _Normalized,
    sizes: Sequence[int],
    params: Sequence[tuple[int, ...]],
    by_category: Mapping[str, int],
    *,
    next_id: int,
) -> tuple[tuple[TraceEvent, ...], tuple[int, ...], tuple[EmulationSite, ...], dict[str, int]]:
    """(events, step starts, sites, bytes per category) with ``sizes`` for the normalized
    events and, at each site, the temporaries its plan gives for ``params``, each allocation and
    free where its step places it (``SitePlan.steps``: by default allocated just before the
    anchor, or just after it with ``after_anchor``, and freed just after it and them, last
    first), with the anchor's frames and stream and its tags (the plan's category and op, an
    ``emulated`` tag); new ids from ``next_id``."""
    from oomkit.prediction.tracing.emulation_sites import SITE_PLANS, EmulationSite

    events = normalized.events
    inserts: dict[int, tuple[list[TraceEvent], list[TraceEvent]]] = {}
    totals = dict(by_category)
    for site, values in zip(normalized.sites, params, strict=True):
        plan = SITE_PLANS[site.kind]
        anchor = events[site.anchor]
        base = tuple(
            (name, plan.category if name == "category" else text)
            for name, text in anchor.tags
            # a temporary serves no parameter and no optimizer: the anchor's own tags
            if name not in ("saved_for_backward", "emulated", "parameter", "optimizer")
        )
        addresses: dict[str, list[int]] = {}  # by name, last made last (a free takes it)
        free_tags = (("category", plan.category),)
        for step in plan.steps(values):
            beside = inserts.setdefault(site.anchor + step.offset, ([], []))
            placed = beside[1] if step.after else beside[0]
            if step.action == "alloc":
                address, next_id = next_id, next_id + 1
                addresses.setdefault(step.name, []).append(address)
                tags = (*base, ("emulated", step.name))
                placed.append(
                    new_trace_event("alloc", address, step.nbytes, anchor.stream, None, anchor.frames, tags)
                )
                totals[plan.category] = totals.get(plan.category, 0) + step.nbytes
            else:
                freed = addresses[step.name].pop()
                placed.extend(
                    new_trace_event(
                        action, freed, step.nbytes, anchor.stream, None,
                        anchor.frames, free_tags,
                    )
                    for action in ("free_requested", "free_completed")
                )
    out: list[TraceEvent] = []
    moved: list[int] = []  # new index of each normalized event
    for index, (event, size) in enumerate(zip(events, sizes, strict=True)):
        if event.size != size:
            event = new_trace_event(
                event.action, event.address, size, event.stream, event.time_us, event.frames, event.tags
            )
        around = inserts.get(index)
        if around is not None:
            out.extend(around[0])
        moved.append(len(out))
        out.append(event)
        if around is not None:
            out.extend(around[1])
    count = len(out)
    step_starts = tuple(moved[i] if i < len(moved) else count for i in normalized.step_starts)
    sites = tuple(
        EmulationSite(site.kind, moved[site.anchor], values)
        for site, values in zip(normalized.sites, params, strict=True)
    )
    return tuple(out), step_starts, sites, totals


def _raw_key(restored: Any, recording: Any, *, events_only: bool = False) -> tuple[Any, ...]:
    """What must be equal for two recordings to be one up to their allocation ids: the events
    (ids renumbered by first appearance), step starts, sites and bytes per category, and
    (unless ``events_only``, for a restored tuple against its recording) every other field."""
    if isinstance(restored, tuple):
        events, step_starts, sites, by_category = restored
    else:
        events, step_starts = restored.events, tuple(restored.step_starts)
        sites = tuple(getattr(restored, "sites", ()) or ())
        by_category = dict(getattr(restored, "bytes_by_category", {}) or {})
    ids: dict[int, int] = {}
    key = (
        tuple(
            (e.action, ids.setdefault(e.address, len(ids)), e.size, e.stream, e.time_us, e.frames, e.tags)
            for e in events
        ),
        tuple(step_starts),
        tuple(sites),
        tuple(sorted(by_category.items())),
    )
    if events_only:
        return key
    return (type(recording), key, _other_fields(recording))


def _is_recording(value: Any) -> bool:
    """Whether ``value`` is a dataclass recording with ``events`` (else never interpolated)."""
    return dataclasses.is_dataclass(value) and hasattr(value, "events")


def _other_fields(recording: Any) -> tuple[Any, ...]:
    """Every field but those that may change with the batch (``_SIZED_FIELDS``), comparable."""
    return tuple(
        (f.name, _frozen(getattr(recording, f.name)))
        for f in dataclasses.fields(recording)
        if f.name not in _SIZED_FIELDS
    )


def recording_structure(recording: Any) -> tuple[Any, ...] | None:
    """What must be equal between two recordings for one to be the other at another batch.

    Every event's action, address (renumbered by first appearance: ids are opaque), stream,
    time, frames and tags, the step boundaries and the sites (their kinds and anchors), and
    every other field of the recording but the sizes (warnings, kernel choices, assumptions,
    ...), with the sites' temporaries taken out (``_normalize``). ``None`` for something that
    is not a dataclass recording with ``events`` (it is then never interpolated).
    """
    if not _is_recording(recording):
        return None
    return _structure(recording, _normalize(recording))


def _structure(recording: Any, normalized: _Normalized) -> tuple[Any, ...]:
    ids: dict[int, int] = {}
    events = tuple(
        (e.action, ids.setdefault(e.address, len(ids)), e.stream, e.time_us, e.frames, e.tags)
        for e in normalized.events
    )
    sites = tuple((site.kind, site.anchor, len(site.params)) for site in normalized.sites)
    categories = tuple(sorted(normalized.by_category))
    others = _other_fields(recording)
    return (type(recording), events, normalized.step_starts, sites, others, categories)


def _frozen(value: Any) -> Any:
    """A comparable form of a field (mappings as sorted items)."""
    if isinstance(value, Mapping):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    return value


def _sizes(normalized: _Normalized) -> tuple[int, ...]:
    """The values that may change with the batch: the normalized events' sizes, the sites'
    integers, then the bytes per category (sorted by category)."""
    by_category = normalized.by_category
    params = [value for site in normalized.sites for value in site.params]
    return (
        *(e.size for e in normalized.events),
        *params,
        *(by_category[k] for k in sorted(by_category)),
    )


def same_recording(first: Any, second: Any) -> bool:
    """Whether two recordings are one up to their allocation ids: the same events (ids aside)
    with the same sizes, step starts, sites, bytes per category and every other field."""
    if not _is_recording(first) or not _is_recording(second):
        return False
    return _raw_key(first, first) == _raw_key(second, second)


def affine_sizes(points: Sequence[tuple[int, Sequence[int]]]) -> AffineSizes | None:
    """Per value, the whole-number intercept and slope through every (batch, values) point.

    Fitted on the first two points and checked on the rest; ``None`` when the points are fewer
    than two, share a batch, differ in length, or a value is not exactly affine in the batch
    with a whole-number slope.
    """
    if len(points) < 2 or len({batch for batch, _ in points}) != len(points):
        return None
    (b0, v0), (b1, v1) = points[0], points[1]
    if any(len(values) != len(v0) for _, values in points):
        return None
    span = b1 - b0
    intercepts: list[int] = []
    slopes: list[int] = []
    for x0, x1 in zip(v0, v1, strict=True):
        slope, rest = divmod(x1 - x0, span)
        if rest:
            return None
        slopes.append(slope)
        intercepts.append(x0 - slope * b0)
    for batch, values in points[2:]:
        if any(a + b * batch != x for a, b, x in zip(intercepts, slopes, values, strict=True)):
            return None
    return tuple(intercepts), tuple(slopes)


def synthesize_sizes(affine: AffineSizes, batch_size: int) -> tuple[int, ...] | None:
    """The values at ``batch_size``; ``None`` when one would be negative (not a size)."""
    intercepts, slopes = affine
    values = tuple(a + b * batch_size for a, b in zip(intercepts, slopes, strict=True))
    if any(value < 0 for value in values):
        return None
    return values


class TraceInterpolator:
    """Learns one builder's recordings from traced batches and synthesizes them at others.

    Every traced recording is kept with its structure. The recording at a batch ``B`` that was
    not traced comes from a *run*: traced batches next to one another (in batch order, none of
    another structure between them) that share a structure. Between two traced batches it is
    their run, if they share one; above every traced batch, the run of the largest; below
    every traced batch, the run of the smallest. The run must hold ``points`` batches or more
    and its sizes must be exactly affine in the batch (fitted on the two traced batches nearest
    ``B``, checked on the others). So a step that takes another code path above some size (the
    embedding backward sorting its indices above 3,072 of them, a kernel chosen by size) is
    learned again, from traces, on each side of the change.

    Args:
        points: traced batches one run needs before it synthesizes: 3 (two to fit the sizes,
            one to check them), at least 2 (for a caller that checks what it synthesizes
            against traces of its own).
    """

    def __init__(self, points: int = 3) -> None:
        if points < 2:
            raise ValueError(f"an affine fit needs at least 2 points; got {points}")
        self._needed = points
        self._structures: list[tuple[Any, ...]] = []  # distinct structures; ids index it
        # batch: (structure id, sizes, the recording, its normalized form)
        self._traced: dict[int, tuple[int, tuple[int, ...], Any, _Normalized]] = {}
        self._fits: dict[tuple[int, ...], AffineSizes | None] = {}  # by (nearest two, *run)
        # What synthesize made, by batch: (structure id, the affine sizes it used), shared by
        # every batch synthesized from one fit (not each batch's sizes: a long search makes many).
        self._made: dict[int, tuple[int, AffineSizes]] = {}

    @property
    def traced_batches(self) -> tuple[int, ...]:
        """Every batch traced so far, in order."""
        return tuple(sorted(self._traced))

    def add(self, batch_size: int, recording: Any) -> bool:
        """Learn from ``recording``, traced for real at ``batch_size`` (not a dataclass
        recording with ``events``: it is not learned from).

        Returns:
            Whether it differs (``same_recording``, found from its structure and sizes) from the
            recording synthesized at ``batch_size``: the last one ``synthesize`` made there, or
            else the one it would make now; ``False`` when there is none.
        """
        if not _is_recording(recording):
            return False
        normalized = _normalize(recording)
        structure = _structure(recording, normalized)
        if structure in self._structures:
            index = self._structures.index(structure)
        else:
            index = len(self._structures)
            self._structures.append(structure)
        sizes = _sizes(normalized)
        differs = False
        made = self._made.pop(batch_size, None)
        if made is None:
            fit = self._fit_at(batch_size)
            made = None if fit is None else (fit[0], fit[1])
        if made is not None:
            expected = synthesize_sizes(made[1], batch_size)
            differs = expected is not None and (made[0] != index or expected != sizes)
        self._traced[batch_size] = (index, sizes, recording, normalized)
        self._fits.clear()
        return differs

    def basis(self, batch_size: int) -> tuple[int, ...] | None:
        """The traced batches the recording at ``batch_size`` would be synthesized from (the
        run, nearest two first); ``None`` when there is no run of enough batches there."""
        batches = sorted(self._traced)
        below = [b for b in batches if b < batch_size]
        above = [b for b in batches if b > batch_size]
        if batch_size in self._traced or not batches:
            return None
        if below and above:
            if self._id(below[-1]) != self._id(above[0]):
                return None
            start = below[-1]
        else:
            start = below[-1] if below else above[0]
        structure = self._id(start)
        i = j = batches.index(start)
        while i > 0 and self._id(batches[i - 1]) == structure:
            i -= 1
        while j + 1 < len(batches) and self._id(batches[j + 1]) == structure:
            j += 1
        run = batches[i : j + 1]
        if len(run) < self._needed:
            return None
        nearest = sorted(run, key=lambda b: (abs(b - batch_size), b))
        return tuple(nearest)

    def can_synthesize(self, batch_size: int) -> bool:
        """Whether ``synthesize(batch_size)`` would make a recording (not ``None``)."""
        fit = self._fit_at(batch_size)
        return fit is not None and synthesize_sizes(fit[1], batch_size) is not None

    def forget_synthesized(self) -> None:
        """Forget what ``synthesize`` made: ``add`` compares a trace with what it would make
        now (a search that starts over uses none of its earlier syntheses)."""
        self._made.clear()

    def synthesize(self, batch_size: int, *, keep: bool = True) -> Any:
        """The recording at ``batch_size``, or ``None`` when ``basis`` has none, the run's sizes
        are not affine, or a size would be negative. ``keep=False``: not remembered as made
        (``add`` then compares a trace there with what it would make at that time).

        Its events are those of the run's traced recording nearest ``batch_size``, with sizes
        ``a + b * batch_size``; its bytes per category and its sites' integers likewise, and at
        each site the temporaries its plan gives for those integers (``_restore``); every other
        field is that recording's.
        """
        fit = self._fit_at(batch_size)
        if fit is None:
            return None
        index, affine, nearest = fit
        values = synthesize_sizes(affine, batch_size)
        if values is None:
            return None
        if keep:
            self._made[batch_size] = (index, affine)
        _, _, template, normalized = self._traced[nearest]
        count = len(normalized.events)
        params: list[tuple[int, ...]] = []
        for site in normalized.sites:
            params.append(tuple(values[count : count + len(site.params)]))
            count += len(site.params)
        by_category = dict(zip(sorted(normalized.by_category), values[count:], strict=True))
        sizes = values[: len(normalized.events)]
        if normalized.stripped:
            next_id = max((e.address for e in template.events), default=0) + 1
            events, step_starts, sites, totals = _restore(
                normalized, sizes, params, by_category, next_id=next_id
            )
            return dataclasses.replace(
                template,
                events=events,
                step_starts=step_starts,
                sites=sites,
                bytes_by_category=totals,
            )
        new_events = tuple(
            e
            if e.size == size
            else new_trace_event(e.action, e.address, size, e.stream, e.time_us, e.frames, e.tags)
            for e, size in zip(normalized.events, sizes, strict=True)
        )
        changes: dict[str, Any] = {"events": new_events}
        if getattr(template, "bytes_by_category", None):
            changes["bytes_by_category"] = by_category
        if normalized.sites:  # a recording taken as it is: its temporaries are events like any
            changes["sites"] = tuple(
                dataclasses.replace(site, params=values)
                for site, values in zip(normalized.sites, params, strict=True)
            )
        return dataclasses.replace(template, **changes)

    def _fit_at(self, batch_size: int) -> tuple[int, AffineSizes, int] | None:
        """(structure id, affine sizes, nearest traced batch) ``synthesize`` would use at
        ``batch_size``; ``None`` where there is no run or its sizes are not affine."""
        basis = self.basis(batch_size)
        if basis is None:
            return None
        if basis not in self._fits:
            self._fits[basis] = affine_sizes([(b, self._traced[b][1]) for b in basis])
        affine = self._fits[basis]
        if affine is None:
            return None
        return self._id(basis[0]), affine, basis[0]

    def _id(self, batch_size: int) -> int:
        return self._traced[batch_size][0]

"""Which ``PYTORCH_CUDA_ALLOC_CONF`` reserves least for a workload: a sweep over allocator settings.

Every candidate setting replays the same requests through the simulated allocator at the same
device capacity; the candidates are ranked by peak reserved memory, then by the number of
cudaMalloc + cudaFree calls (each cudaFree synchronizes the device), and those that run out of
memory rank last. Settings known to misbehave are flagged with the reason and never recommended
when the flag says they are harmful or do nothing.

Rules referenced below are from ../shared/ref/cuda-caching-allocator.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

from oomkit.core.allocator import DEFAULT_CAPACITY_BYTES, AllocatorConfig, CachingAllocator
from oomkit.core.replay import ReplayResult, replay_snapshot, simulate_events
from oomkit.core.snapshot import Snapshot
from oomkit.core.trace import TraceEvent
from oomkit.errors import AllocatorUsageError, ConfigError
from oomkit.executors import replay_settings
from oomkit.units import format_bytes

__all__ = [
    "DEFAULT_GRID",
    "FLAG_REASONS",
    "NOT_RECOMMENDED_FLAGS",
    "NOT_SWEPT",
    "TuningCandidate",
    "TuningResult",
    "TuningSource",
    "tune",
]

# A source of requests to replay: a snapshot (replayed from its reconstructed start state), a
# re-iterable sequence of events, or a factory returning a fresh iterable of events per call
# (e.g. ``lambda: read_trace(path)[1]``, so that a large trace never sits in memory whole).
TuningSource: TypeAlias = Snapshot | Sequence[TraceEvent] | Callable[[], Iterable[TraceEvent]]

# The settings swept by default, simplest first: among equally good candidates the earlier one
# ranks first, so the default wins every tie. Values follow §9.3:
# - max_split_size_mb from 32: the minimum PyTorch accepts is 20 (>= 20 since 2.9, > 20 before),
#   and at 20 the 20 MiB segments that serve 1-10 MiB requests (§2.4) are themselves oversize, so
#   no such request could ever reuse one (§6 rule 1). Every value is still checked by the parser
#   of the modelled version, and one it rejects is skipped with a warning.
# - garbage_collection_threshold acts only with a per-process memory fraction below 1.0 (§7; at
#   1.0 MAIN26 sets no limit, §9.5), hence 0.99 with it. The lone 0.8 shows the common mistake.
# - expandable_segments with max_split_size_mb is swept to show PyTorch issue #123548, never
#   recommended.
DEFAULT_GRID: tuple[str, ...] = (
    "",
    "expandable_segments:True",
    "max_split_size_mb:32",
    "max_split_size_mb:64",
    "max_split_size_mb:128",
    "max_split_size_mb:256",
    "max_split_size_mb:512",
    "max_split_size_mb:1024",
    "roundup_power2_divisions:2",
    "roundup_power2_divisions:4",
    "roundup_power2_divisions:8",
    "roundup_power2_divisions:16",
    "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]",
    "expandable_segments:True,roundup_power2_divisions:4",
    "expandable_segments:True,roundup_power2_divisions:8",
    "expandable_segments:True,roundup_power2_divisions:16",
    "max_split_size_mb:128,roundup_power2_divisions:4",
    "max_split_size_mb:512,roundup_power2_divisions:4",
    "garbage_collection_threshold:0.6,per_process_memory_fraction:0.99",
    "garbage_collection_threshold:0.8,per_process_memory_fraction:0.99",
    "max_split_size_mb:512,garbage_collection_threshold:0.8,per_process_memory_fraction:0.99",
    "garbage_collection_threshold:0.8",
    "expandable_segments:True,max_split_size_mb:128",
    "expandable_segments:True,max_split_size_mb:512",
)

# How a note about default settings an older torch does not take begins: a fact about the
# sweep, not something the user gave wrongly (the CLI prints it as info, not as a warning).
NOT_SWEPT = "not swept:"

FLAG_REASONS: dict[str, str] = {
    "max-split-with-expandable": (
        "max_split_size_mb with expandable_segments: a free block of at least max_split_size "
        "inside an expandable segment is never reused by a smaller request, so reserved memory "
        "can grow without bound across alloc/free cycles (PyTorch issue #123548); use one or the "
        "other"
    ),
    "gc-without-fraction": (
        "garbage_collection_threshold does nothing without a per-process memory fraction below "
        "1.0 (per_process_memory_fraction or torch.cuda.set_per_process_memory_fraction)"
    ),
    "gc-with-expandable": (
        "garbage collection never frees blocks of expandable segments (PR #134338), so "
        "garbage_collection_threshold has no effect with expandable_segments:True"
    ),
    "more-retries": (
        "more allocation retries than the default: each retry frees every cached block and "
        "synchronizes the device"
    ),
}

# Flags that keep a candidate from being recommended: harmful, a setting that does nothing, or
# one that fits only by flushing the cache where the default did not need to (a lower peak
# bought with synchronizing cudaFree calls on every retry).
NOT_RECOMMENDED_FLAGS: frozenset[str] = frozenset(
    {"max-split-with-expandable", "gc-without-fraction", "gc-with-expandable", "more-retries"}
)


@dataclass(frozen=True)
class TuningCandidate:
    """One setting's outcome on the workload.

    Attributes:
        alloc_conf: the ``PYTORCH_CUDA_ALLOC_CONF`` value; ``""`` is PyTorch's default.
        peak_reserved_bytes: the peak of ``reserved_bytes.all`` over the replay.
        peak_allocated_bytes: the peak of ``allocated_bytes.all`` over the replay.
        device_allocs: cudaMalloc calls (expandable segments: page-mapping calls).
        device_frees: cudaFree calls (expandable segments: unmapping calls); each synchronizes.
        alloc_retries: mallocs that had to free the whole cache and try again.
        ooms: the replay ran out of memory at the capacity (it stopped there).
        flags: keys of ``FLAG_REASONS`` that apply to this setting.
    """

    alloc_conf: str
    peak_reserved_bytes: int
    peak_allocated_bytes: int
    device_allocs: int
    device_frees: int
    alloc_retries: int
    ooms: bool
    flags: tuple[str, ...] = ()

    @property
    def device_calls(self) -> int:
        """cudaMalloc + cudaFree calls, the second ranking key."""
        return self.device_allocs + self.device_frees

    @property
    def recommendable(self) -> bool:
        """Fits the capacity and carries no flag that rules it out."""
        return not self.ooms and not NOT_RECOMMENDED_FLAGS.intersection(self.flags)


@dataclass(frozen=True)
class TuningResult:
    """The ranked outcome of a sweep.

    Attributes:
        baseline: the default setting (``alloc_conf == ""``).
        candidates: every candidate, best first (the baseline among them); those that run out
            of memory last.
        best: the first recommendable candidate (it may be the baseline), or None when every
            candidate runs out of memory or is ruled out.
        saving_bytes: ``baseline.peak_reserved_bytes - best.peak_reserved_bytes`` (0 when there
            is no best).
        capacity_bytes: the device capacity every candidate was replayed at.
        warnings: what the numbers do not cover (skipped settings, replay caveats).
        comparable: False when the settings cannot be compared on this workload: no setting
            made a segment decision (no cudaMalloc, cudaFree or page mapping: every request was
            served from the segments the trace started with), so every setting gives the same
            peak and ``best`` is None rather than a default that won by a tie.
    """

    baseline: TuningCandidate
    candidates: tuple[TuningCandidate, ...]
    best: TuningCandidate | None
    saving_bytes: int
    capacity_bytes: int
    warnings: tuple[str, ...] = field(default_factory=tuple)
    comparable: bool = True

    @property
    def default_is_best(self) -> bool:
        """No setting beats PyTorch's default."""
        return self.best is not None and self.best.alloc_conf == self.baseline.alloc_conf


def tune(
    source: TuningSource,
    capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
    *,
    device: int = 0,
    torch_version: str | None = None,
    candidates: Sequence[str] | None = None,
    progress: Callable[[int, int], None] | None = None,
    jobs: int | None = 1,
    reserved_outside_bytes: int = 0,
) -> TuningResult:
    """Replay a workload under each candidate setting and rank the settings.

    Args:
        source: a ``Snapshot`` (its ``device`` trace is replayed from the reconstructed start
            state, each candidate as a what-if from the first request), a sequence of trace
            events, or a factory returning a fresh iterable of events on each call. A one-shot
            iterator is read into memory once.
        capacity_bytes: device memory every candidate is replayed at, in bytes.
        device: the snapshot device to replay (ignored for events).
        torch_version: the PyTorch version whose parser and allocator to model; None is the
            newest release.
        candidates: ``PYTORCH_CUDA_ALLOC_CONF`` strings to sweep instead of ``DEFAULT_GRID``;
            the default setting ``""`` is always replayed first, as the baseline.
        progress: called as ``progress(done, total)`` with ``done`` = 0 before the first replay
            and after each replay.
        jobs: replay this many settings at once, each in its own process (None: one per CPU
            core). The results are those of the one-at-a-time sweep: every replay is
            deterministic and they are ranked in the same order. Needs the ``fork`` start
            method (Linux); elsewhere the settings are replayed one at a time.
        reserved_outside_bytes: device memory held outside the allocator (the CUDA context of
            ``oomkit tune --gpu NAME``): each candidate may reserve ``capacity_bytes`` less it.

    Returns:
        The ranked candidates, the best recommendable one and its saving over the default.

    Raises:
        AllocatorUsageError: ``capacity_bytes`` is not a positive int.
        ConfigError: no candidate besides the default is valid for ``torch_version``.
        TraceFormatError: from the events (a free of an unknown id, a corrupt trace file).
        UnknownDeviceError: the snapshot holds no such device.
    """
    if (
        isinstance(capacity_bytes, bool)
        or not isinstance(capacity_bytes, int)
        or capacity_bytes <= 0
    ):
        raise AllocatorUsageError(
            f"the capacity must be a positive number of bytes; got {capacity_bytes!r}. "
            "Example: --capacity 80GiB"
        )
    replay = _replayer(source, capacity_bytes, device, torch_version, reserved_outside_bytes)
    warnings: list[str] = []
    settings = _valid_settings(
        DEFAULT_GRID if candidates is None else candidates, torch_version, warnings,
        given=candidates is not None,
    )
    replayed = replay_settings(
        replay, [c for _, c in settings], jobs=jobs, progress=progress
    )
    results = [(text, config, r) for (text, config), r in zip(settings, replayed, strict=True)]

    baseline_result = results[0][2]
    gc_enabled = {
        text: _gc_enabled(config, capacity_bytes, torch_version) for text, config, _ in results
    }
    swept = [
        _candidate(text, config, result, baseline_result, gc_enabled[text])
        for text, config, result in results
    ]
    order = sorted(range(len(swept)), key=lambda i: (_rank_key(swept[i]), i))
    ranked = tuple(swept[i] for i in order)
    baseline = swept[0]
    # Settings act only through segment decisions (CUDACachingAllocator.cpp malloc:
    # alloc_block / release_block, expandable segments' map_block / unmap_block): where no
    # setting made one, all tie by construction and a ranking would only reflect that tie.
    comparable = any(c.device_calls for c in swept) or len({_rank_key(c) for c in swept}) > 1
    best = next((c for c in ranked if c.recommendable), None) if comparable else None
    saving = 0 if best is None else baseline.peak_reserved_bytes - best.peak_reserved_bytes

    _replay_warnings(baseline_result, warnings)
    if not comparable:
        warnings.append(
            "settings cannot be compared on this workload: no setting made a segment decision "
            "(no cudaMalloc, cudaFree or page mapping; every request was served from the "
            f"{format_bytes(baseline.peak_reserved_bytes)} of segments the trace started with), so "
            "every setting gives the same peak. Record the history from before the first CUDA "
            "allocation (torch.cuda.memory._record_memory_history at the start of the script)"
        )
    elif len(swept) > 1 and len({_rank_key(c) for c in swept}) == 1:
        warnings.append(
            "every setting gives the same result: the workload does not exercise the allocator "
            "settings (a snapshot without trace events holds only its final state; record one "
            "with torch.cuda.memory._record_memory_history before the workload)"
        )
    if all(c.ooms for c in swept):
        warnings.append(
            f"every setting runs out of memory at {capacity_bytes} bytes; try a larger capacity"
        )
    elif baseline.ooms and best is not None:
        warnings.append(
            f"the default runs out of memory at {capacity_bytes} bytes and "
            f"PYTORCH_CUDA_ALLOC_CONF={best.alloc_conf} does not; the saving compares a replay "
            "that stopped early"
        )
    return TuningResult(
        baseline=baseline,
        candidates=ranked,
        best=best,
        saving_bytes=saving,
        capacity_bytes=capacity_bytes,
        warnings=tuple(warnings),
        comparable=comparable,
    )


# ---------------------------------------------------------------------------- internals


def _replayer(
    source: TuningSource,
    capacity_bytes: int,
    device: int,
    torch_version: str | None,
    reserved_outside_bytes: int = 0,
) -> Callable[[AllocatorConfig], ReplayResult]:
    """One function that replays the source under a setting, whatever kind of source it is."""
    if isinstance(source, Snapshot):
        snapshot = source

        def replay_snap(config: AllocatorConfig) -> ReplayResult:
            # An explicit config is a what-if from the first request (§15.11); config=None would
            # replay under the recorded setting instead of the default.
            return replay_snapshot(
                snapshot,
                device,
                config=config,
                capacity_bytes=capacity_bytes,
                torch_version=torch_version,
                reserved_outside_bytes=reserved_outside_bytes,
            )

        return replay_snap

    if isinstance(source, Sequence):
        events_seq: Sequence[TraceEvent] = source

        def factory() -> Iterable[TraceEvent]:
            return events_seq

    elif callable(source):
        factory = source
    elif isinstance(source, Iterable):
        # A one-shot iterator can be replayed once only: keep its events for every candidate.
        kept = tuple(source)

        def factory() -> Iterable[TraceEvent]:
            return kept

    else:
        raise TypeError(
            f"tune() takes a Snapshot, a sequence of TraceEvent or a factory of them; got "
            f"{type(source).__name__}. Example: tune(lambda: read_trace(path)[1])"
        )

    def replay_events(config: AllocatorConfig) -> ReplayResult:
        events = factory()
        try:
            return simulate_events(
                events,
                config,
                capacity_bytes,
                torch_version=torch_version,
                reserved_outside_bytes=reserved_outside_bytes,
            )
        finally:
            # read_trace keeps its file open until the iterator is exhausted; an OOM stops early.
            close = getattr(events, "close", None)
            if callable(close):
                close()

    return replay_events


def _valid_settings(
    texts: Sequence[str], torch_version: str | None, warnings: list[str], *, given: bool = True
) -> list[tuple[str, AllocatorConfig]]:
    """Parse each setting as the modelled PyTorch would; skip rejected ones and duplicates.

    A rejected setting the caller ``given`` is a warning with PyTorch's reason; one of the
    default grid (an older torch without a key) is a note starting ``NOT_SWEPT``."""
    settings: list[tuple[str, AllocatorConfig]] = [("", AllocatorConfig())]
    seen = {AllocatorConfig()}
    rejected: list[tuple[str, ConfigError]] = []
    for text in texts:
        text = text.strip()
        try:
            config = AllocatorConfig.parse(text, torch_version=torch_version)
        except ConfigError as exc:
            rejected.append((text, exc))
            continue
        if config in seen:
            continue
        seen.add(config)
        settings.append((text, config))
    version = f"torch {torch_version}" if torch_version else "the newest torch"
    if rejected:
        names = ", ".join(repr(text) for text, _ in rejected)
        if given:
            warnings.append(
                f"skipped {len(rejected)} setting(s) that {version} rejects: {names}. "
                f"First reason: {rejected[0][1]}"
            )
        else:
            # The parser's last clause says why ("per_process_memory_fraction needs torch >=
            # 2.9"); the settings themselves are DEFAULT_GRID's.
            reason = str(rejected[0][1]).split(". Example:")[0].rsplit("; ", 1)[-1]
            warnings.append(
                f"{NOT_SWEPT} {len(rejected)} of the default settings, which {version} does "
                f"not take ({reason})"
            )
    if len(settings) == 1 and rejected:
        raise ConfigError(f"no candidate setting is valid for {version}: {warnings[-1]}")
    return settings


def _gc_enabled(config: AllocatorConfig, capacity_bytes: int, torch_version: str | None) -> bool:
    # The allocator decides from the fraction and the version's setMemoryFraction rule (§7, §9.5).
    return CachingAllocator(config, capacity_bytes, torch_version=torch_version).gc_enabled


def _candidate(
    text: str,
    config: AllocatorConfig,
    result: ReplayResult,
    baseline: ReplayResult,
    gc_enabled: bool,
) -> TuningCandidate:
    flags: list[str] = []
    if config.expandable_segments and config.max_split_size_bytes is not None:
        flags.append("max-split-with-expandable")
    if config.garbage_collection_threshold > 0.0:
        if not gc_enabled:
            flags.append("gc-without-fraction")
        elif config.expandable_segments:
            flags.append("gc-with-expandable")
    # An OOM ends in a retry of its own (§4 step 9), so compare only replays that both finished;
    # when the default itself runs out of memory, fitting at the cost of retries is still a win.
    if (
        not result.oom
        and not baseline.oom
        and result.num_alloc_retries > baseline.num_alloc_retries
    ):
        flags.append("more-retries")
    return TuningCandidate(
        alloc_conf=text,
        peak_reserved_bytes=result.peak_reserved_bytes,
        peak_allocated_bytes=result.peak_allocated_bytes,
        device_allocs=result.num_device_alloc,
        device_frees=result.num_device_free,
        alloc_retries=result.num_alloc_retries,
        ooms=result.oom,
        flags=tuple(flags),
    )


def _rank_key(candidate: TuningCandidate) -> tuple[bool, int, int, int]:
    return (
        candidate.ooms,
        candidate.peak_reserved_bytes,
        candidate.device_calls,
        candidate.alloc_retries,
    )


def _replay_warnings(result: ReplayResult, warnings: list[str]) -> None:
    for text in result.warnings:
        if text not in warnings:
            warnings.append(text)

"""Which allocation site leaks, and a plain-words guess why.

``attribute_leak`` replays a step-split allocator trace, keeps the live allocations after every
step grouped by allocation site (the innermost user frame, ``attribution.site_of``) and returns
the sites whose live bytes rise steadily after the warm-up. ``live_by_site`` and
``diff_live_sites`` do the same for two moments only. ``explain_leak`` reads the site's source
line and recognises the usual culprits; every guess is labelled as a likely cause.
"""

from __future__ import annotations

import linecache
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from statistics import median
from typing import Literal

from oomkit.core.trace import TraceEvent
from oomkit.diagnose._trend import LEAK_Z, detect_warmup_steps, trend
from oomkit.diagnose.attribution import site_of
from oomkit.errors import MemoryHealthError

__all__ = [
    "LeakCause",
    "LeakCauseKind",
    "LeakSite",
    "SiteKey",
    "SiteUsage",
    "attribute_leak",
    "diff_live_sites",
    "explain_leak",
    "live_by_site",
]

# (filename, line, function) of the innermost user frame; None when no user frame was recorded.
SiteKey = tuple[str, int, str] | None
LeakCauseKind = Literal[
    "loss_accumulated",
    "kept_in_list",
    "stored_in_container",
    "retain_graph",
    "hook_stores_tensors",
    "growing_tensor",
    "unknown",
]

# A scalar tensor takes one 512-byte block (CUDACachingAllocator.cpp kMinBlockSize); growing
# allocations this small, one per step, are the signature of a per-step scalar kept alive.
_SMALL_BLOCK_BYTES = 4096
# How far around the site to look for ``retain_graph=True`` (the training loop's body).
_CONTEXT_LINES = 40


@dataclass(frozen=True)
class SiteUsage:
    """Live allocations of one site at one moment.

    Attributes:
        live_bytes: their block bytes (requests rounded as ``memory_allocated`` counts them).
        count: how many.
    """

    live_bytes: int
    count: int


@dataclass(frozen=True)
class LeakSite:
    """An allocation site whose live memory grows from step to step.

    Attributes:
        filename: the user's file, or None when no user frame was recorded.
        line: its line.
        function: the function holding the line.
        growth_bytes_per_step: Theil–Sen slope of the site's live bytes per step.
        growth_bytes: live bytes at the last step minus at the first analysed step.
        growth_count: live allocations gained over the same steps.
        live_bytes: the site's live bytes at the last step.
        typical_size_bytes: the median block size of its live allocations at the last step.
        steps: how many step ends were compared.
    """

    filename: str | None
    line: int | None
    function: str | None
    growth_bytes_per_step: int
    growth_bytes: int
    growth_count: int
    live_bytes: int
    typical_size_bytes: int
    steps: int

    @property
    def label(self) -> str:
        """``file.py:12 in train`` or a placeholder when no user frame was recorded."""
        if self.filename is None:
            return "(no user frame recorded)"
        return f"{self.filename}:{self.line} in {self.function}"


@dataclass(frozen=True)
class LeakCause:
    """A plain-words guess at why a site leaks.

    Attributes:
        kind: which common cause it looks like; ``"unknown"`` when none matched.
        description: what is going on, labelled as a likely cause.
        fix: what to change.
        evidence: what the guess rests on (the source line, a size pattern).
    """

    kind: LeakCauseKind
    description: str
    fix: str
    evidence: str


def _key(frames: Sequence) -> SiteKey:
    frame = site_of(frames)
    return None if frame is None else (frame.filename, frame.line, frame.name)


class _LiveSet:
    """Live allocations by address, replayed from ``alloc`` / ``free_requested`` events."""

    def __init__(self, round_block: Callable[[int], int] | None) -> None:
        if round_block is None:
            # The allocator only where a trace is replayed: `oomkit report` reads monitor logs
            # with this module and no allocator (issue 41 item 4: start-up).
            from oomkit.core.allocator import round_size

            round_block = round_size
        self._round = round_block
        self.live: dict[int, tuple[SiteKey, int]] = {}

    def apply(self, events: Sequence[TraceEvent]) -> None:
        for ev in events:
            if ev.action == "alloc":
                size = self._round(ev.size) if ev.size > 0 else 0
                self.live[ev.address] = (_key(ev.frames), size)
            elif ev.action == "free_requested":
                # A free of an allocation made before the trace began is unknown here: skipped.
                self.live.pop(ev.address, None)

    def by_site(self) -> dict[SiteKey, SiteUsage]:
        sums: dict[SiteKey, list[int]] = {}
        for key, size in self.live.values():
            entry = sums.setdefault(key, [0, 0])
            entry[0] += size
            entry[1] += 1
        return {k: SiteUsage(v[0], v[1]) for k, v in sums.items()}

    def sizes_of(self, key: SiteKey) -> list[int]:
        return [size for k, size in self.live.values() if k == key]


def live_by_site(
    events: Sequence[TraceEvent], *, round_block: Callable[[int], int] | None = None
) -> dict[SiteKey, SiteUsage]:
    """The allocations a trace leaves live, grouped by allocation site.

    Args:
        events: a trace, oldest first (allocations freed before it began are not counted).
        round_block: request size to block size; PyTorch's default rounding unless given.

    Returns:
        Live bytes and count per site.
    """
    live = _LiveSet(round_block)
    live.apply(events)
    return live.by_site()


def diff_live_sites(
    before: Mapping[SiteKey, SiteUsage], after: Mapping[SiteKey, SiteUsage]
) -> list[tuple[SiteKey, int, int]]:
    """Sites whose live bytes rose between two moments: (site, bytes gained, count gained).

    Args:
        before: ``live_by_site`` at the earlier moment.
        after: ``live_by_site`` at the later moment.

    Returns:
        The sites that gained bytes, most bytes first.
    """
    empty = SiteUsage(0, 0)
    gains = []
    for key, now in after.items():
        then = before.get(key, empty)
        if now.live_bytes > then.live_bytes:
            gains.append((key, now.live_bytes - then.live_bytes, now.count - then.count))
    gains.sort(key=lambda g: (-g[1], str(g[0])))
    return gains


def attribute_leak(
    events_by_step: Sequence[Sequence[TraceEvent]],
    *,
    warmup_steps: int | None = None,
    round_block: Callable[[int], int] | None = None,
) -> list[LeakSite]:
    """Name the allocation sites whose live memory grows steadily from step to step.

    The trace is replayed step by step; at the end of each step the live allocations are
    grouped by site. A site leaks when its live bytes after the warm-up rise with a significant
    Mann–Kendall trend (the same test as ``detect_leak``) and a positive Theil–Sen slope.

    Args:
        events_by_step: the allocator trace cut at step boundaries: element ``i`` holds the
            events of step ``i`` (a simulated device's ``events()`` between two ``step()``
            calls). The first element may hold everything before the first step.
        warmup_steps: step ends to skip; None detects it from the total live bytes.
        round_block: request size to block size; PyTorch's default rounding unless given.

    Returns:
        The growing sites, most growth first; empty when nothing grows steadily.

    Raises:
        MemoryHealthError: ``warmup_steps`` is negative.
    """
    if warmup_steps is not None and warmup_steps < 0:
        raise MemoryHealthError(
            f"warmup_steps must be 0 or more; got {warmup_steps}. Example: warmup_steps=2"
        )
    live = _LiveSet(round_block)
    per_step: list[dict[SiteKey, SiteUsage]] = []
    for events in events_by_step:
        live.apply(events)
        per_step.append(live.by_site())
    totals = [sum(u.live_bytes for u in usage.values()) for usage in per_step]
    skip = detect_warmup_steps(totals) if warmup_steps is None else warmup_steps
    window = per_step[skip:]
    if len(window) < 3:
        return []
    xs = list(range(len(window)))
    empty = SiteUsage(0, 0)
    sites: list[LeakSite] = []
    for key, last in window[-1].items():
        series = [usage.get(key, empty) for usage in window]
        values = [u.live_bytes for u in series]
        if values[-1] <= values[0]:
            continue
        t = trend(xs, values)
        if t.slope_per_x <= 0 or t.mann_kendall_z < LEAK_Z:
            continue
        sizes = live.sizes_of(key)
        filename, line, function = key if key is not None else (None, None, None)
        sites.append(
            LeakSite(
                filename=filename,
                line=line,
                function=function,
                growth_bytes_per_step=round(t.slope_per_x),
                growth_bytes=values[-1] - values[0],
                growth_count=series[-1].count - series[0].count,
                live_bytes=last.live_bytes,
                typical_size_bytes=int(median(sizes)) if sizes else 0,
                steps=len(window),
            )
        )
    sites.sort(key=lambda s: (-s.growth_bytes, s.label))
    return sites


_APPEND = re.compile(r"\.(append|extend|insert)\s*\(")
_CONTAINER = re.compile(r"^\s*[\w.]+\s*\[[^\]]+\]\s*=[^=]|\.(setdefault|update)\s*\(")
_ACCUMULATE = re.compile(r"^\s*([\w.]+)\s*(\+=|=\s*\1\s*\+)")
_ASSIGN = re.compile(r"^\s*([A-Za-z_]\w*)\s*=[^=](.*)$")
_RETAIN = re.compile(r"retain_graph\s*=\s*True")


def explain_leak(
    site: LeakSite,
    *,
    get_line: Callable[[str, int], str] = linecache.getline,
) -> LeakCause:
    """Guess in plain words why a site leaks, from its source line and its allocations' sizes.

    Recognised: a loss (or metric) accumulated without ``.item()``; outputs appended to a list;
    tensors stored in a dict or other container (a global cache); state carried across steps
    with ``retain_graph=True``; a hook that stores tensors; tensors that grow in size rather
    than in number (growing inputs, a ``torch.cat`` buffer). Each is a likely cause, not a proof.

    Args:
        site: from ``attribute_leak``.
        get_line: ``(filename, line) -> source text`` (``linecache.getline``: ``""`` when the
            file cannot be read).

    Returns:
        The guess; ``kind`` is ``"unknown"`` when nothing matched.
    """
    text = ""
    if site.filename is not None and site.line is not None:
        text = get_line(site.filename, site.line).strip()
    where = f"`{text}` ({site.label})" if text else site.label
    function = site.function or ""
    if "hook" in function.lower():
        return LeakCause(
            "hook_stores_tensors",
            f"Likely cause: the hook {function} stores a tensor on every call ({where}), so "
            "each forward or backward adds one that is never dropped",
            "store .detach().cpu() copies or Python numbers in the hook, clear what it stores, "
            "or remove the hook handle when done (handle.remove())",
            "the growing allocations are made inside a function named like a hook",
        )
    if text and _APPEND.search(text):
        return LeakCause(
            "kept_in_list",
            f"Likely cause: outputs kept in a list: {where} adds a tensor every step and the "
            "list keeps it (and, if it requires grad, its autograd graph) alive",
            "append .detach() (or .item() / .cpu()) copies, or clear the list every step",
            f"the line appends: {text}",
        )
    if text and _CONTAINER.search(text):
        return LeakCause(
            "stored_in_container",
            f"Likely cause: tensors stored in a dict or other container that outlives the step "
            f"(a global cache): {where} stores a new entry every step and nothing removes it",
            "bound the cache (evict old keys), store .detach().cpu() copies, or clear it",
            f"the line stores into a container: {text}",
        )
    match = _ACCUMULATE.search(text) if text else None
    if match:
        name = match.group(1)
        return LeakCause(
            "loss_accumulated",
            f"Likely cause: a loss accumulated without .item(): `{name}` adds a tensor that "
            f"requires grad every step ({where}), so it keeps every step's autograd graph "
            "(and the activations it saved) alive",
            f"accumulate a number: `{name} += loss.item()` (or loss.detach())",
            f"the line accumulates into {name}: {text}",
        )
    assign = _ASSIGN.match(text) if text else None
    if assign and re.search(rf"\b{re.escape(assign.group(1))}\b", assign.group(2)):
        name = assign.group(1)
        nearby = _retain_graph_near(site, get_line)
        if nearby is not None:
            return LeakCause(
                "retain_graph",
                f"Likely cause: `{name}` is carried from step to step without .detach() and "
                f"backward runs with retain_graph=True (line {nearby}), so every step's graph "
                f"and its saved activations stay alive ({where})",
                f"detach the carried state each step (`{name} = {name}.detach()`) and drop "
                "retain_graph=True",
                f"the line feeds {name} back into itself and line {nearby} passes "
                "retain_graph=True",
            )
    if text and _RETAIN.search(text):
        return LeakCause(
            "retain_graph",
            f"Likely cause: backward with retain_graph=True at {where} keeps the graph alive "
            "while something still references it",
            "drop retain_graph=True, or detach what is kept across steps",
            f"the line passes retain_graph=True: {text}",
        )
    if site.growth_count <= 0:
        return LeakCause(
            "growing_tensor",
            f"Likely cause: the tensors from {where} get bigger every step while their number "
            "stays the same: inputs that grow by design (longer sequences, a curriculum) or a "
            "buffer grown with torch.cat; the first is not a leak",
            "if the sizes grow by design, cap them (bucket or truncate sequence lengths); "
            "otherwise preallocate the buffer or keep only its recent part",
            f"{site.growth_bytes} more bytes over {site.steps} steps without more allocations",
        )
    if site.typical_size_bytes <= _SMALL_BLOCK_BYTES:
        return LeakCause(
            "loss_accumulated",
            f"Likely cause: a small tensor (a loss or metric) kept every step from {where}, "
            "e.g. accumulated without .item(); its autograd graph may hold more",
            "keep Python numbers (.item()) for logging and running totals",
            f"{site.growth_count} small allocations "
            f"({site.typical_size_bytes} bytes each) piled up from one line",
        )
    return LeakCause(
        "unknown",
        f"tensors allocated at {where} stay alive across steps; something keeps a reference "
        "(a list, dict, global, object attribute or an autograd graph)",
        "find what holds them (e.g. gc.get_referrers on one) and drop or detach it",
        "no common pattern matched the source line",
    )


def _retain_graph_near(site: LeakSite, get_line: Callable[[str, int], str]) -> int | None:
    """The nearest line within ``_CONTEXT_LINES`` of the site passing ``retain_graph=True``."""
    assert site.filename is not None and site.line is not None
    for offset in range(_CONTEXT_LINES + 1):
        for line in (site.line + offset, site.line - offset):
            if line > 0 and _RETAIN.search(get_line(site.filename, line)):
                return line
    return None

"""A trace as integer columns: what the replay loop reads per event (issue 41).

The loop (:class:`~oomkit.core.replay.engine.ReplayEngine`) reads an action code, a size, a
stream, a recorded address and a *slot* per event from plain lists instead of five attribute
reads of a :class:`~oomkit.core.trace.TraceEvent` and string comparisons, and resolves a trace
id (an address, or a synthetic trace's opaque id) to its simulated pointer by indexing a list
with its slot, not through a dict: ids are numbered once, here, in order of first appearance.
``replay_snapshot`` builds the columns of a snapshot's trace once (``_prepared.py``) and every
replay of it reuses them.

The lists hold the events' own values (no copies of the integers): two pointers per event
and three per alloc, about 34 bytes per event of a 1M-event recording with the id numbering
(memory counts: issue 41 item 2 bounds a 1 GB snapshot's replay to 2 GB). An alloc whose fields are not plain ``int``,
or whose size is not positive, keeps its place with its own code (:data:`CHECKED_ALLOC`): the
loop then hands the event's own values to malloc, whose checks raise what they always raised.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from oomkit.core.trace import TraceEvent

__all__ = [
    "ALLOC",
    "CHECKED_ALLOC",
    "FREE_COMPLETED",
    "FREE_REQUESTED",
    "OTHER",
    "TraceColumns",
    "trace_columns",
]

# Action codes of the columns: the requests the loop serves itself, and everything else.
ALLOC: Final = 0
FREE_REQUESTED: Final = 1
FREE_COMPLETED: Final = 2
# An alloc whose size, stream or address is not an int, or whose size is not positive: malloc's
# own checks judge it (ALLOC goes to CachingAllocator.serve, which needs none).
CHECKED_ALLOC: Final = 3
OTHER: Final = 4

_CODES = {"alloc": ALLOC, "free_requested": FREE_REQUESTED, "free_completed": FREE_COMPLETED}


class TraceColumns:
    """One trace as lists (see the module docstring): ``actions`` and ``slots`` have an entry
    per event; ``sizes``, ``streams`` and ``addresses`` one per alloc (``ALLOC`` or
    ``CHECKED_ALLOC``), in trace order, so a column costs no memory for the frees.

    Attributes:
        actions: the action code of each event.
        slots: the number of each event's id (``address``): equal ids, equal slots.
        sizes: each alloc's request in bytes (0 for a CHECKED_ALLOC).
        streams: each alloc's stream (0 for a CHECKED_ALLOC).
        addresses: each alloc's recorded address (-1 for a CHECKED_ALLOC).
        slot_of: id -> slot, for every id the trace names.
    """

    __slots__ = ("actions", "slots", "sizes", "streams", "addresses", "slot_of")

    def __init__(
        self,
        actions: list[int],
        slots: list[int],
        sizes: list[int],
        streams: list[int],
        addresses: list[int],
        slot_of: dict[Any, int],
    ) -> None:
        self.actions = actions
        self.slots = slots
        self.sizes = sizes
        self.streams = streams
        self.addresses = addresses
        self.slot_of = slot_of


class _Numbering(dict[Any, int]):
    """Trace id -> slot; a new id gets the next slot when first looked up."""

    def __missing__(self, key: Any) -> int:
        slot = self[key] = len(self)
        return slot


def trace_columns(
    events: Sequence[TraceEvent],
    slot_of: dict[Any, int] | None = None,
    *,
    actions: list[int] | None = None,
    allocs: list[TraceEvent] | None = None,
    ints: bool = False,
) -> TraceColumns:
    """The columns of ``events``; ids are numbered on from ``slot_of`` (a dict it extends)
    when one is given (a trace read in chunks).

    ``actions`` (each event's code, a list the columns then own) and ``allocs`` (the alloc
    events in order), when the caller has them: the reconstruction's walk notes both as it
    reads every event (``_prepared.py``). ``ints``: the caller knows every event's size,
    stream and address is a plain ``int`` (a trace the snapshot reader read: its
    ``read_entries`` refuses an entry with any other), so only the sizes are checked.

    A replay from a fresh copy of a snapshot (``oomkit replay FILE --verify``) builds them
    every time, so each column is one comprehension or a ``map`` in C, and the type check
    looks at each column's set of types (issue 41: the per-alloc generator expressions made
    the columns 8% of a pure-Python real-trace verify).
    """
    if actions is None:
        get = _CODES.get
        actions = [get(e.action, OTHER) for e in events]
    numbered: dict[Any, int]
    if slot_of is None:
        # A subscript per event; only an id's first appearance calls __missing__.
        numbering = _Numbering()
        slots = [numbering[e.address] for e in events]
        numbered = dict(numbering)  # a plain dict: a lookup never numbers a new id
    else:
        numbered = slot_of
        slots = [numbered.setdefault(e.address, len(numbered)) for e in events]
    if allocs is None:
        allocs = [e for e in events if e.action == "alloc"]
    sizes = [e.size for e in allocs]
    streams = [e.stream for e in allocs]
    addresses = [e.address for e in allocs]
    checked = _checked(sizes, streams, addresses, ints)
    if checked:
        at = [i for i, code in enumerate(actions) if code == ALLOC]
        for k in checked:
            # Not plain ints, or not a positive size: malloc judges the event's own values.
            actions[at[k]] = CHECKED_ALLOC
            sizes[k] = 0
            streams[k] = 0
            addresses[k] = -1
    return TraceColumns(actions, slots, sizes, streams, addresses, numbered)



def _checked(
    sizes: list[Any], streams: list[Any], addresses: list[Any], ints: bool = False
) -> list[int]:
    """The allocs malloc must judge itself: a field that is not a plain int, or a size that
    is not positive (none in a loaded trace but zero-byte requests). ``ints``: every field is
    known to be a plain int; the type check (a call per field, 2% of a compiled fresh-copy
    verify, issue 41) is then left out."""
    if ints or {*map(type, sizes), *map(type, streams), *map(type, addresses)} <= {int}:
        if not sizes or min(sizes) > 0:
            return []
        return [k for k, size in enumerate(sizes) if size <= 0]
    return [
        k
        for k in range(len(sizes))
        if type(sizes[k]) is not int
        or type(streams[k]) is not int
        or type(addresses[k]) is not int
        or sizes[k] <= 0
    ]

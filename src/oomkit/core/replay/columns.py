"""A trace as integer columns: what the replay loop reads per event (issue 41).

The loop (:class:`~oomkit.core.replay.engine.ReplayEngine`) reads an action code, a size, a
stream, a recorded address and a *slot* per event from plain lists instead of five attribute
reads of a :class:`~oomkit.core.trace.TraceEvent` and string comparisons, and resolves a trace
id (an address, or a synthetic trace's opaque id) to its simulated pointer by indexing a list
with its slot, not through a dict: ids are numbered once, here, in order of first appearance.
``replay_snapshot`` builds the columns of a snapshot's trace once (``_prepared.py``) and every
replay of it reuses them.

The lists hold the events' own values (no copies of the integers), so the columns cost five
pointers per event. An event whose fields are not plain ``int`` keeps its place with its own
code (:data:`CHECKED_ALLOC`, ``OTHER``): the loop then hands the event's own values to the
allocator, whose checks raise what they always raised.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
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
    """One trace, event by event, as lists of the same length (see the module docstring).

    Attributes:
        actions: the action code of each event.
        slots: the number of each event's id (``address``): equal ids, equal slots.
        addresses: each alloc's recorded address (-1 where it is not an int).
        sizes: each alloc's request in bytes (0 where it is not an int).
        streams: each alloc's stream (0 where it is not an int).
        slot_of: id -> slot, for every id the trace names.
    """

    __slots__ = ("actions", "slots", "addresses", "sizes", "streams", "slot_of")

    def __init__(
        self,
        actions: list[int],
        slots: list[int],
        addresses: list[int],
        sizes: list[int],
        streams: list[int],
        slot_of: dict[Any, int],
    ) -> None:
        self.actions = actions
        self.slots = slots
        self.addresses = addresses
        self.sizes = sizes
        self.streams = streams
        self.slot_of = slot_of


def trace_columns(
    events: Sequence[TraceEvent], slot_of: dict[Any, int] | None = None
) -> TraceColumns:
    """The columns of ``events``; ids are numbered on from ``slot_of`` (a dict it extends)
    when one is given (a trace read in chunks)."""
    numbered: dict[Any, int] = {} if slot_of is None else slot_of
    codes = _CODES
    actions = [codes.get(e.action, OTHER) for e in events]
    addresses = [e.address for e in events]
    slots = [numbered.setdefault(a, len(numbered)) for a in addresses]
    sizes = [e.size for e in events]
    streams = [e.stream for e in events]
    for i in _unchecked(actions, addresses, sizes, streams):
        # A field of another type: keep the event's place, let malloc judge its values.
        if actions[i] == ALLOC:
            actions[i] = CHECKED_ALLOC
        if type(addresses[i]) is not int:
            addresses[i] = -1
        sizes[i] = 0
        streams[i] = 0
    for i, size in enumerate(sizes):
        if size <= 0 and actions[i] == ALLOC:
            actions[i] = CHECKED_ALLOC
    return TraceColumns(actions, slots, addresses, sizes, streams, numbered)


def _unchecked(
    actions: list[int], addresses: list[Any], sizes: list[Any], streams: list[Any]
) -> Iterable[int]:
    """Indices of the events with a field that is not a plain int (none in a loaded trace)."""
    if all(type(x) is int for x in addresses) and all(type(x) is int for x in sizes) and all(
        type(x) is int for x in streams
    ):
        return ()
    return [
        i
        for i in range(len(actions))
        if type(addresses[i]) is not int
        or type(sizes[i]) is not int
        or type(streams[i]) is not int
    ]

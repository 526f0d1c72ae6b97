"""Reading a snapshot's trace while the file is still being unpickled, so it is never whole.

The C unpickler keeps every object it built in its memo until ``load`` returns (protocol 4
memoizes every dict and list), so a 1 GB file's 5M raw trace entries (about 700 bytes each as
Python dicts and frame lists) were all alive at once before the first was read: 3.5 GB. A
:class:`TraceDrain` runs after each frame the unpickler reads (``unpickler.ReadHook``): it finds
the device trace lists among the unpickler's objects, reads the entries appended to them so far
into ``TraceEvent`` records, and empties what it read. The memo still holds each entry dict
and frame list, but hollow: an empty dict, and a frame list whose one item is the tuple of
``Frame`` records it was read into (``read_stack``; a later entry that refers to the same
list, as PyTorch's ``free_requested`` does to its ``alloc``'s, gets the same frames through
it). What the normaliser reads after the load is then the part of each trace not read yet.

A trace list is a list whose first item is a dict with an ``action`` key. Looking for it copies
the memo, so that is done when the bytes read pass 1, 2, 4, 8, ... MiB and only until one is
found: a file with several large device traces has its first drained, the others read after
the load as before.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable

from oomkit.core.trace import Frame, TraceEvent

__all__ = ["ReadEntries", "TraceDrain", "read_stack"]

# Reads entries[0:stop] of a raw trace list into records appended to ``events``, and empties
# each entry read; returns how many it read (fewer where an entry is malformed: the normaliser
# reports it after the load).
ReadEntries = Callable[[list, int, list[TraceEvent]], int]

# Bytes read before the memo is first searched for a trace list (then at each doubling).
_FIRST_SEARCH_BYTES = 1 << 20


def read_stack(raw: list) -> tuple[Frame, ...] | None:
    """The frames a raw frame list was read into, if it was emptied by a drain; else None.

    An emptied list holds one tuple: the stack's ``Frame`` records, or ``()``. The unpickler
    cannot build a ``Frame`` (it resolves no global), and a raw list holding only an empty tuple
    reads as no frames anyway (an item that is not a dict is skipped), so nothing in a file is
    mistaken for one.
    """
    first = raw[0]
    if type(first) is tuple and (not first or type(first[0]) is Frame):
        return first
    return None


class TraceDrain:
    """Called after each frame the unpickler reads; reads and empties the trace found so far.

    Args:
        read_entries: the normaliser's entry reader (``_Normaliser.read_entries``).
    """

    def __init__(self, read_entries: ReadEntries) -> None:
        self._read_entries = read_entries
        self._next_search_bytes = _FIRST_SEARCH_BYTES
        # Each trace list found, by id, with the records read from it so far (the list is held
        # here, so its id is not reused while the drain lives).
        self.read: dict[int, tuple[list, list[TraceEvent]]] = {}
        self._stopped: set[int] = set()

    def __call__(self, unpickler: pickle.Unpickler, bytes_read: int) -> None:
        if not self.read and bytes_read >= self._next_search_bytes:
            self._next_search_bytes *= 2
            self._search(unpickler)
        for key, (entries, events) in self.read.items():
            if entries and key not in self._stopped:
                self._drain(key, entries, events)

    def _search(self, unpickler: pickle.Unpickler) -> None:
        for value in unpickler.memo.copy().values():
            if type(value) is list and value and type(value[0]) is dict and "action" in value[0]:
                self.read[id(value)] = (value, [])

    def _drain(self, key: int, entries: list, events: list[TraceEvent]) -> None:
        # The reader empties each entry it reads (reader.py _Normaliser.read_entries).
        count = self._read_entries(entries, len(entries), events)
        del entries[:count]
        if entries:  # a malformed entry: the normaliser reads the rest, and says which
            self._stopped.add(key)

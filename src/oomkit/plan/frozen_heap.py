"""Python's cyclic garbage collector kept off what a search has already built.

A batch search keeps what it makes: the model, built once (``model_cache.py``), every traced
recording (tens of thousands of events each, kept by ``trace_interpolation.py`` to learn from)
and every prediction. CPython's collector walks every tracked object at each full (generation 2)
collection, and tracing one step allocates enough objects to set off several: on
``oomkit fit gpt2-124m --gpu h100`` 8 full collections cost 0.9 s of a 6-7 s search, more as the
search goes on. ``gc.freeze()`` (CPython Modules/gcmodule.c ``gc_freeze_impl``) moves every
tracked object to a permanent generation that collections skip. Frozen objects are still freed
by reference counting as usual; only cyclic garbage made before a freeze waits for
``gc.unfreeze()``, which returns them all to the oldest generation when the search ends.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["frozen_heap"]


@contextmanager
def frozen_heap() -> Iterator[Callable[[], None]]:
    """Within it, the function it yields freezes every object that exists (call it before each
    probe, so a full collection walks only what that probe made); on exit all is unfrozen.

    It does nothing when the caller keeps frozen objects itself (``gc.get_freeze_count() > 0``:
    unfreezing would undo that) or has turned the collector off.
    """
    if gc.get_freeze_count() or not gc.isenabled():
        yield lambda: None
        return
    try:
        yield gc.freeze
    finally:
        gc.unfreeze()

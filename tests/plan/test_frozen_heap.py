"""Tests for plan/frozen_heap.py: the collector kept off what a search built, and given back."""

from __future__ import annotations

import gc
import weakref

import pytest

from oomkit.core.target import Target
from oomkit.plan.frozen_heap import frozen_heap


@pytest.fixture(autouse=True)
def _nothing_frozen():
    gc.unfreeze()
    yield
    gc.unfreeze()
    gc.enable()


def test_freezes_what_exists_when_asked_and_unfreezes_on_exit():
    """Nothing is frozen until the yielded function runs; after it, what existed is; on exit,
    nothing is, even when the body raises."""
    kept = [object() for _ in range(10)]
    with pytest.raises(RuntimeError), frozen_heap() as freeze:
        assert gc.get_freeze_count() == 0
        freeze()
        assert gc.get_freeze_count() > len(kept)
        raise RuntimeError("a probe failed")
    assert gc.get_freeze_count() == 0
    assert kept


class _Node:
    """A cycle's member: only the cyclic collector can free it once it is dropped."""


def _dropped_cycle() -> weakref.ref:
    """A self-referencing object, already unreachable: alive until a collection frees it."""
    node = _Node()
    node.self = node  # type: ignore[attr-defined]
    return weakref.ref(node)


def test_leaves_a_callers_own_frozen_objects_alone():
    """Objects the caller froze stay frozen through and after it, and it freezes nothing more.

    Asserted on cyclic garbage rather than on ``gc.get_freeze_count()`` alone: frozen objects
    are still freed by reference counting (anything the test run made earlier may drop one at
    any moment), so the count may fall, but a frozen cycle is never collected.
    """
    gc.disable()  # no automatic collection between making the caller's cycle and freezing it
    callers = _dropped_cycle()
    gc.freeze()
    gc.enable()
    before = gc.get_freeze_count()
    assert before > 0
    with frozen_heap() as freeze:
        gc.disable()
        made_inside = _dropped_cycle()
        freeze()  # the caller keeps frozen objects: this must not freeze made_inside
        gc.enable()
        gc.collect()
        assert made_inside() is None
        assert callers() is not None
        assert gc.get_freeze_count() <= before
    gc.collect()
    assert callers() is not None  # still frozen after the exit: it did not unfreeze
    assert gc.get_freeze_count() <= before


def test_does_nothing_with_the_collector_off():
    gc.disable()
    with frozen_heap() as freeze:
        freeze()
        assert gc.get_freeze_count() == 0
    assert not gc.isenabled()


def test_a_batch_search_leaves_nothing_frozen():
    """max_batch_size freezes before each probe and unfreezes at its end."""
    torch = pytest.importorskip("torch")
    from oomkit.core.gpus import GpuSpec
    from oomkit.plan.batch_search import max_batch_size

    seen = []

    def build(batch):
        seen.append(gc.get_freeze_count())
        return lambda: torch.empty(batch * 2**20, dtype=torch.uint8)

    gpu = GpuSpec(name="test GPU", total_memory_bytes=64 * 2**20, context_overhead_bytes=0)
    result = max_batch_size(build, target=Target.resolve(gpu), margin_bytes=0)
    assert result.batch_size == 64  # 64 MiB of 64 MiB, no margin
    assert seen and all(count > 0 for count in seen)
    assert gc.get_freeze_count() == 0

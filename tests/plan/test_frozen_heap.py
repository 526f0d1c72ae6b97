"""Tests for plan/frozen_heap.py: the collector kept off what a search built, and given back."""

from __future__ import annotations

import gc

import pytest

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


def test_leaves_a_callers_own_frozen_objects_alone():
    """Objects the caller froze stay frozen through and after it (it does not freeze more)."""
    gc.freeze()
    before = gc.get_freeze_count()
    assert before > 0
    with frozen_heap() as freeze:
        [object() for _ in range(10)]
        freeze()
        assert gc.get_freeze_count() == before
    assert gc.get_freeze_count() == before


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
    result = max_batch_size(build, gpu=gpu, margin_bytes=0)
    assert result.batch_size == 64  # 64 MiB of 64 MiB, no margin
    assert seen and all(count > 0 for count in seen)
    assert gc.get_freeze_count() == 0

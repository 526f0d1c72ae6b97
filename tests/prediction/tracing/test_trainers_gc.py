"""A Hugging Face Trainer restarted per step collects garbage once, as one run does."""

from __future__ import annotations

import contextlib
import gc
from pathlib import Path

import pytest

from oomkit.core.target import Target
from oomkit.prediction.predictor import predict
from oomkit.prediction.tracing import trainers
from oomkit.scenario.user_function import load_user_step

pytest.importorskip("transformers")
memory = pytest.importorskip("accelerate.utils.memory")

BUILDERS = Path(__file__).parent / "trainer_builders" / "builders.py"
STEPS = 3


def _predict():
    user = load_user_step(f"{BUILDERS}:hf_trainer", batch_size=8, seq_len=128)
    return predict(user.step_fn, track=user.track, steps=STEPS, target=Target.resolve("h100"))


def test_only_the_first_train_collects_and_every_restart_empties_the_cache(monkeypatch):
    """3 steps restart train() 3 times; each begins with accelerate's free_memory ->
    clear_device_cache(garbage_collection=True). The first collects (1 gc.collect), the 2
    restarts reach clear_device_cache without the collection, so its empty_cache still runs;
    after the recording, accelerate's own function is back in place."""
    collections: list[int] = []
    clears: list[bool] = []
    original_collect = gc.collect
    original_clear = memory.clear_device_cache

    def counting_collect(*args, **kwargs):
        collections.append(1)
        return original_collect(*args, **kwargs)

    def counting_clear(garbage_collection=False):
        clears.append(garbage_collection)
        return original_clear(garbage_collection=garbage_collection)

    monkeypatch.setattr(gc, "collect", counting_collect)
    monkeypatch.setattr(memory, "clear_device_cache", counting_clear)
    _predict()
    assert clears == [True, False, False]
    assert len(collections) == 1
    assert memory.clear_device_cache is counting_clear


def test_skipping_the_restarts_collections_changes_no_byte(monkeypatch):
    """Recorded with every restart collecting (as before) or not, the prediction is the same:
    peaks, per-step peaks, allocation counts and the timeline; the collection frees no device
    tensor between steps of this trainer."""
    skipped = _predict()
    monkeypatch.setattr(trainers, "_restart_without_gc_collect", contextlib.nullcontext)
    collected = _predict()
    assert skipped.peak_allocated_bytes == collected.peak_allocated_bytes == 130621952
    assert skipped.peak_reserved_bytes == collected.peak_reserved_bytes == 153092096
    assert skipped.step_peaks == collected.step_peaks
    assert (skipped.events, skipped.num_device_alloc, skipped.num_device_free) == (
        collected.events,
        collected.num_device_alloc,
        collected.num_device_free,
    )
    assert skipped.timeline == collected.timeline

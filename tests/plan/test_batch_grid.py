"""Tests for max_batch_size's sizes (multiple_of, power_of_two), its answer without allocator
retries, the non-monotonic curve it explains, and its advice when nothing fits."""

from __future__ import annotations

import pytest

from oomkit.core.gpus import GpuSpec
from oomkit.core.target import Target
from oomkit.plan._batch_grid import Grid
from oomkit.plan.batch_advice import infeasible_advice
from oomkit.plan.batch_search import max_batch_size

torch = pytest.importorskip("torch")

MiB = 2**20
GPU = GpuSpec(name="test GPU", total_memory_bytes=100 * MiB, context_overhead_bytes=0)


def _linear(batch):
    # One request of (batch + 4) * 2 MiB (>= 10 MiB: its own segment, exactly this size,
    # CUDACachingAllocator.cpp get_allocation_size): with a 10 MiB margin, batch 41 fits.
    def step():
        torch.empty((batch + 4) * 2 * MiB, dtype=torch.uint8)

    return step


def _retrying(spike_at=None):
    """A freed (b + 4) * 2 MiB block stays cached while (b + 5) * 2 MiB is asked for: both fit
    at once up to batch 18 (90 MiB usable after the margin); above, only after the allocator
    frees its cache and retries (CUDACachingAllocator.cpp malloc: release_cached_blocks, then
    cudaMalloc again), up to batch 40. ``spike_at``: that batch asks for 100 MiB more."""

    def build(batch):
        def step():
            first = torch.empty((batch + 4) * 2 * MiB, dtype=torch.uint8)
            del first
            extra = 50 if batch == spike_at else 0
            torch.empty((batch + 5 + extra) * 2 * MiB, dtype=torch.uint8)

        return step

    return build


def test_multiple_of_tries_only_its_multiples():
    """multiple_of=8: 8, 16, 32, 64 (too big), then 48, 40: the answer 40, not 41."""
    result = max_batch_size(_linear, target=Target.resolve(GPU), margin_bytes=10 * MiB, interpolate=False,
                            multiple_of=8)
    assert result.probe_order == (8, 16, 32, 64, 48, 40)
    assert (result.batch_size, result.first_failing_batch) == (40, 48)
    assert (result.multiple_of, result.power_of_two) == (8, False)
    assert result.peak_reserved_bytes == 88 * MiB


def test_power_of_two_tries_only_powers_of_two():
    """power_of_two: indices 1, 2, 4, 8 (sizes 1, 2, 8, 128), then bisection 32, 64: 32."""
    result = max_batch_size(_linear, target=Target.resolve(GPU), margin_bytes=10 * MiB, interpolate=False,
                            power_of_two=True)
    assert result.probe_order == (1, 2, 8, 128, 32, 64)
    assert (result.batch_size, result.first_failing_batch) == (32, 64)
    assert result.peak_reserved_bytes == 72 * MiB


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(multiple_of=3, power_of_two=True), "never multiples of 3"),
        (dict(multiple_of=0), "multiple_of"),
        (dict(multiple_of=64, max_batch=32), "no size from start_batch 1 to max_batch 32"),
    ],
)
def test_impossible_grids_are_refused(kwargs, match):
    """A grid with no size to try is a ValueError naming the parameters."""
    with pytest.raises(ValueError, match=match):
        max_batch_size(_linear, target=Target.resolve(GPU), margin_bytes=10 * MiB, **kwargs)


def test_grid_indices_round_to_allowed_sizes():
    """index_at_most / index_at_least bracket a size by the grid's own sizes."""
    grid = Grid(8, power_of_two=True)  # 8, 16, 32, ...
    assert [grid.size(i) for i in (1, 2, 3)] == [8, 16, 32]
    assert (grid.index_at_most(31), grid.index_at_least(31)) == (2, 3)
    assert (grid.index_at_most(7), grid.index_at_least(7)) == (0, 1)
    plain = Grid()
    assert (plain.index_at_most(41), plain.index_at_least(41)) == (41, 41)


def test_answer_is_the_largest_batch_without_allocator_retries():
    """Batch 40 fits only by freeing the cache and retrying: the answer is 18, the largest
    without, and 40 is named with its retry; allow_retries=True answers 40."""
    result = max_batch_size(_retrying(), target=Target.resolve(GPU), margin_bytes=10 * MiB, steps=1,
                            interpolate=False)
    assert result.probe_order == (1, 2, 4, 8, 16, 32, 64, 48, 40, 44, 42, 41, 28, 22, 19, 17, 18)
    assert result.batch_size == 18
    assert result.peak_reserved_bytes == 90 * MiB  # 44 + 46 MiB, both held
    assert (result.with_retries_batch_size, result.with_retries_count) == (40, 1)
    assert result.non_monotonic is None
    assert (
        "batch 40 fits too, but only with the allocator freeing its cache and retrying 1 time(s)"
        in " ".join(result.warnings)
    )
    loose = max_batch_size(_retrying(), target=Target.resolve(GPU), margin_bytes=10 * MiB, steps=1,
                           interpolate=False, allow_retries=True)
    assert (loose.batch_size, loose.with_retries_batch_size) == (40, None)


def test_a_batch_that_fits_above_one_that_does_not_is_explained():
    """Batch 17 asks for 100 MiB more and fails while 40 fits: the result names the pair and
    a warning explains why a curve can be non-monotonic; the clean answer is 16."""
    result = max_batch_size(_retrying(spike_at=17), target=Target.resolve(GPU), margin_bytes=10 * MiB, steps=1,
                            interpolate=False)
    assert result.batch_size == 16
    assert result.non_monotonic == (40, 17)
    text = " ".join(result.warnings)
    assert "the curve is not monotonic: batch 40 fits but the smaller batch 17 does not" in text


def test_advice_leaves_out_what_the_step_already_does():
    """A bf16-mixed, checkpointed step is not told to use bf16-mixed or checkpointing; an fp32
    step on a T4 (7.5) is told fp16-mixed, and never pure bf16."""
    done = infeasible_advice(
        "Llama 8B, batch 1, seq 2048, bf16-mixed, adamw, checkpointing, train", (8, 9)
    )
    assert done == [
        "bf16 weights, gradients and optimizer states (--precision bf16)",
        "8-bit AdamW states (--optimizer adamw8bit)",
        "SGD with momentum, one state instead of two (--optimizer sgd)",
        "LoRA adapters instead of full fine-tuning (--lora 8)",
        "a shorter sequence or smaller images",
    ]
    t4 = infeasible_advice("GPT-2 124M, batch 1, seq 1024, fp32, sgd, train", (7, 5))
    assert t4 == [
        "mixed precision (--precision fp16-mixed)",
        "activation checkpointing (--checkpointing full)",
        "LoRA adapters instead of full fine-tuning (--lora 8)",
        "a shorter sequence or smaller images",
    ]


def test_lengths_advice_is_computed_from_the_step_too():
    """fit --lengths' message when batch 1 fails: no bf16-mixed for a bf16-mixed step."""
    from oomkit.core.target import Target
    from oomkit.plan.envelope_fit import EnvelopeProbe, _infeasible

    target = Target.resolve("rtx4090")
    probe = EnvelopeProbe(1, False, 30 * 2**30, None)
    error = _infeasible(probe, target, 482 * MiB, "GPT-2 124M, batch 1, seq 1024, bf16-mixed, "
                        "adamw, train")
    text = str(error)
    assert "bf16-mixed" not in text
    assert "Try bf16 weights, gradients and optimizer states (--precision bf16), activation " \
        "checkpointing (--checkpointing full)" in text
    assert error.needed_reserved_bytes == 30 * 2**30

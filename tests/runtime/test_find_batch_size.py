"""oomkit.find_batch_size: confirm a prediction with <= 2 probes, else an OOM-safe search."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oomkit.errors import NoFeasibleBatchSizeError
from oomkit.runtime import use_device
from oomkit.runtime.batch_probe import BatchTrial, find_batch_size


class _FakeDevice:
    name = "fake"

    def __init__(self) -> None:
        self.empty_cache_calls = 0

    def empty_cache(self) -> None:
        self.empty_cache_calls += 1


class _Step:
    """A train step that raises the real torch.OutOfMemoryError above ``capacity`` samples."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.tried: list[int] = []

    def __call__(self, batch_size: int) -> None:
        self.tried.append(batch_size)
        if batch_size > self.capacity:
            raise torch.OutOfMemoryError(f"CUDA out of memory at batch {batch_size}")


class _SearchResult:
    """Stands in for oomkit.plan.batch_search.BatchSearchResult (only .batch_size is read)."""

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size


@pytest.fixture
def device():
    """The fake device, with ``release_after_oom``'s full ``gc.collect()`` (most of an OOM's cost in
    a process that has imported torch) counted instead of run: the fake steps hold no tensors.
    test_cleanup_between_probes_drops_the_failed_step runs the real collection."""
    fake = _FakeDevice()
    with use_device(fake), mock.patch("oomkit.runtime.device.gc.collect") as collect:
        fake.collect = collect  # type: ignore[attr-defined]
        yield fake


@pytest.fixture
def collecting_device():
    """The fake device with the real ``gc.collect()``."""
    fake = _FakeDevice()
    with use_device(fake):
        yield fake


def test_exponential_then_binary_search(device):
    """Capacity 37 from 1: 1..64 doubling, then bisect 32..64 down to 37; one OOM per failure."""
    step = _Step(37)
    result = find_batch_size(step)
    assert result.sizes_tried == (1, 2, 4, 8, 16, 32, 64, 48, 40, 36, 38, 37)
    assert step.tried == list(result.sizes_tried)
    assert result.batch_size == 37 and result.method == "search" and result.predicted is None
    assert result.oom_count == 4
    assert [p.batch_size for p in result.probes if p.outcome == "oom"] == [64, 48, 40, 38]
    assert device.collect.call_count == 4  # release_after_oom: once per OOM


def test_correct_prediction_costs_one_probe_and_no_oom(device):
    """A prediction that fits is confirmed with a single real step."""
    step = _Step(37)
    result = find_batch_size(step, predicted=37)
    assert result.probes == (BatchTrial(37, "ok"),)
    assert result.batch_size == 37 and result.method == "predicted" and result.oom_count == 0
    assert device.empty_cache_calls == 1  # cleaned up after the probe


def test_prediction_slightly_too_high_costs_one_oom(device):
    """Predicted 40 OOMs, 90% of it (36) runs: two probes, one OOM, and a warning."""
    result = find_batch_size(_Step(37), predicted=40)
    assert result.sizes_tried == (40, 36)
    assert result.batch_size == 36 and result.method == "predicted" and result.oom_count == 1
    assert result.warnings == ("predicted batch 40 ran out of memory; 36 ran",)


def test_prediction_far_too_high_falls_back_to_a_bounded_search(device):
    """Predicted 100 and 90 OOM: halve below 90 to 45 (OOM), 22 (ok), then bisect 22..45."""
    result = find_batch_size(_Step(37), predicted=100)
    assert result.sizes_tried == (100, 90, 45, 22, 33, 39, 36, 37, 38)
    assert result.batch_size == 37 and result.method == "search" and result.oom_count == 5


def test_predict_callable_and_result_objects_are_accepted(device):
    """predict= is called once; a result with .batch_size is read like an int."""
    calls = []

    def predict():
        calls.append(1)
        return _SearchResult(30)

    result = find_batch_size(_Step(37), predict=predict)
    assert calls == [1] and result.predicted == 30 and result.sizes_tried == (30,)


def test_start_that_ooms_searches_downward(device):
    """Start 64 with capacity 5: halve 32, 16, 8, 4 (ok), then bisect 4..8."""
    result = find_batch_size(_Step(5), start=64)
    assert result.sizes_tried == (64, 32, 16, 8, 4, 6, 5)
    assert result.batch_size == 5 and result.oom_count == 5


def test_cap_stops_growth(device):
    """With max_batch_size=20 and room for 100, the search stops at the cap."""
    result = find_batch_size(_Step(100), start=4, max_batch_size=20)
    assert result.sizes_tried == (4, 8, 16, 20)
    assert result.batch_size == 20 and result.oom_count == 0
    assert result.warnings == ("max_batch_size 20 ran; larger sizes not tried",)


def test_nothing_fits(device):
    """Even batch 1 OOMs: NoFeasibleBatchSizeError lists the sizes tried."""
    with pytest.raises(NoFeasibleBatchSizeError, match="sizes tried: 4, 2, 1"):
        find_batch_size(_Step(0), start=4)


def test_cleanup_between_probes_drops_the_failed_step(collecting_device):
    """Tensors referenced by a failed step's frame are freed, and the cache emptied, before the
    next probe."""
    import weakref

    refs = []

    def step(batch_size):
        held = torch.zeros(batch_size)
        refs.append(weakref.ref(held))
        if batch_size > 2:
            raise torch.OutOfMemoryError("CUDA out of memory")
        if len(refs) > 1:
            assert refs[-2]() is None  # the previous (failed) probe's tensor is gone

    find_batch_size(step, start=4)
    assert collecting_device.empty_cache_calls == 3  # after 4 (OOM), 2 (ok), 3 (OOM)


def test_non_oom_errors_propagate(device):
    """A RuntimeError that only mentions memory is not an OOM: it stops the search."""

    def step(batch_size):
        if batch_size > 2:
            raise RuntimeError("CUDA out of memory (but not a torch.OutOfMemoryError)")

    with pytest.raises(RuntimeError, match="not a torch.OutOfMemoryError"):
        find_batch_size(step)


def test_bad_arguments_are_refused():
    """start, max_batch_size and the prediction must be positive."""
    with pytest.raises(ValueError, match="start must be >= 1"):
        find_batch_size(_Step(1), start=0)
    with pytest.raises(ValueError, match="predicted batch size must be >= 1"):
        find_batch_size(_Step(1), predicted=0)


@settings(max_examples=60, deadline=None)
@given(capacity=st.integers(1, 500), start=st.integers(1, 64), predicted=st.integers(1, 600))
def test_search_finds_the_exact_capacity(capacity, start, predicted):
    """Any capacity: the search returns it exactly, never tries a size twice, and a prediction
    within 10% above the capacity costs at most 2 probes and 1 OOM."""
    # The fake step holds no tensors: skip the full gc per OOM, which dominates in a big process.
    with use_device(_FakeDevice()), mock.patch("oomkit.runtime.device.gc.collect"):
        searched = find_batch_size(_Step(capacity), start=start)
        guided = find_batch_size(_Step(capacity), predicted=predicted)
    assert searched.batch_size == capacity
    assert len(set(searched.sizes_tried)) == len(searched.sizes_tried)
    assert guided.batch_size <= capacity
    if predicted <= capacity:
        assert guided.sizes_tried == (predicted,) and guided.batch_size == predicted
    elif int(predicted * 0.9) <= capacity:
        assert len(guided.probes) == 2 and guided.oom_count == 1
    else:
        assert guided.batch_size == capacity


# ---------------------------------------------------------------- on the simulated CUDA device


def _mlp_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 8)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train_step(batch_size: int) -> None:
        # zero_grad first: a probe that OOMed in backward left partial gradients behind.
        opt.zero_grad(set_to_none=True)
        x, y = torch.randn(batch_size, 32), torch.randint(0, 8, (batch_size,))
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    return train_step


def test_search_on_a_2_mib_simulated_gpu(simulated_device):
    """A real MLP step on a 2 MiB GPU: doubling from 16 OOMs at 128, bisection settles on 116."""
    device = simulated_device("2MiB")
    result = find_batch_size(_mlp_step(), start=16)
    assert result.sizes_tried == (16, 32, 64, 128, 96, 112, 120, 116, 118, 117)
    assert result.batch_size == 116
    assert result.oom_count == device.oom_count == 4


@pytest.mark.parametrize("batch_size, fits", [(116, True), (117, False)])
def test_116_is_the_true_maximum_on_a_fresh_2_mib_gpu(simulated_device, batch_size, fits):
    """Two steps at 116 run on a fresh device; 117 does not (the search's answer is exact)."""
    device = simulated_device("2MiB")
    step = _mlp_step()
    try:
        step(batch_size)
        step(batch_size)
    except torch.OutOfMemoryError:
        pass
    assert device.oom_count == (0 if fits else 1)


def test_prediction_on_a_2_mib_simulated_gpu(simulated_device):
    """Right prediction: one probe, no OOM. 5% too high (122): one OOM, then 90% (109) runs."""
    device = simulated_device("2MiB")
    step = _mlp_step()
    assert find_batch_size(step, predicted=116).sizes_tried == (116,)
    assert device.oom_count == 0
    result = find_batch_size(step, predicted=122)
    assert result.sizes_tried == (122, 109) and result.batch_size == 109
    assert result.method == "predicted" and device.oom_count == 1

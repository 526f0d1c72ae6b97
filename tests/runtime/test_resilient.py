"""oomkit.resilient: OOM recovery by micro-batching with exact gradients and no lost samples."""

from __future__ import annotations

import logging
from collections import namedtuple
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from oomkit.errors import BatchSplitError
from oomkit.runtime import use_device
from oomkit.runtime.resilient import Resilient, batch_size_of, resilient, split_batch


class _FakeDevice:
    """A DeviceMemory that counts empty_cache calls (everything else is zero)."""

    name = "fake"

    def __init__(self) -> None:
        self.empty_cache_calls = 0

    def empty_cache(self) -> None:
        self.empty_cache_calls += 1

    def memory_stats(self) -> dict[str, int]:
        return {}

    def memory_allocated(self) -> int:
        return 0

    memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

    def reset_peak_memory_stats(self) -> None:
        pass

    def mem_get_info(self) -> tuple[int, int]:
        return 0, 0

    def synchronize(self) -> None:
        pass


def _oom() -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")


class _Job:
    """A tiny classifier whose step OOMs when a micro-batch is larger than ``limit`` samples."""

    def __init__(self, n: int = 8, limit: int | None = None, reduction: str = "mean") -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 3)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.batch = (torch.arange(n), torch.randn(n, 4), torch.randint(0, 3, (n,)))
        self.limit = limit
        self.reduction = reduction
        self.calls: list[list[int]] = []  # sample ids of each micro-batch the step saw
        self.grads: list[list[torch.Tensor]] = []  # gradients the optimizer stepped on

    def step(self, batch):
        ids, x, y = batch
        self.calls.append(ids.tolist())
        if self.limit is not None and len(ids) > self.limit:
            raise _oom()
        return F.cross_entropy(self.model(x), y, reduction=self.reduction)

    def optimizer_step(self) -> None:
        self.grads.append([p.grad.clone() for p in self.model.parameters()])
        self.optimizer.step()

    def wrap(self, **kwargs) -> Resilient:
        return resilient(
            self.step, optimizer=self.optimizer, optimizer_step=self.optimizer_step, **kwargs
        )

    def reference_grads(self) -> list[torch.Tensor]:
        """Gradients of the whole batch in one step, without oomkit, on a copy of the model."""
        model = torch.nn.Linear(4, 3)
        model.load_state_dict(self.model.state_dict())
        _, x, y = self.batch
        F.cross_entropy(model(x), y, reduction=self.reduction).backward()
        return [p.grad for p in model.parameters()]


def _sizes(calls: list[list[int]]) -> list[int]:
    return [len(c) for c in calls]


def test_no_oom_runs_the_batch_once_and_steps_once():
    """Without an OOM the step sees the whole batch once and the optimizer steps once."""
    job = _Job(n=8)
    reference = job.reference_grads()
    wrapped = job.wrap()
    loss = wrapped(job.batch)
    assert _sizes(job.calls) == [8]
    assert wrapped.events == [] and wrapped.oom_count == 0 and wrapped.optimizer_steps == 1
    assert wrapped.micro_batch_size is None
    assert loss.requires_grad is False
    for got, want in zip(job.grads[0], reference, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_oom_halves_until_it_fits_and_gradients_match():
    """Batch 8 with room for 3: tries 8, then 4, then four micro-batches of 2; same gradients."""
    job = _Job(n=8, limit=3)
    reference = job.reference_grads()
    with use_device(_FakeDevice()) as device:
        wrapped = job.wrap()
        loss = wrapped(job.batch)
    # Attempt 1: [8] OOM. Attempt 2: first micro-batch of 4 OOMs. Attempt 3: 2+2+2+2.
    assert _sizes(job.calls) == [8, 4, 2, 2, 2, 2]
    assert [(e.failed_micro_batch_size, e.next_micro_batch_size) for e in wrapped.events] == [
        (8, 4),
        (4, 2),
    ]
    assert [e.micro_batch_index for e in wrapped.events] == [0, 0]
    assert wrapped.oom_count == 2 and device.empty_cache_calls == 2
    assert wrapped.optimizer_steps == 1 and len(job.grads) == 1
    assert wrapped.micro_batch_size == 2
    final_ids = [i for call in job.calls[2:] for i in call]
    assert final_ids == list(range(8))  # every sample exactly once, in order
    for got, want in zip(job.grads[0], reference, strict=True):
        torch.testing.assert_close(got, want)
    assert loss.shape == ()


def test_returned_loss_is_the_full_batch_mean():
    """The loss returned after splitting equals the mean loss over the whole batch."""
    job = _Job(n=6, limit=2)
    model_copy = torch.nn.Linear(4, 3)
    model_copy.load_state_dict(job.model.state_dict())
    _, x, y = job.batch
    expected = F.cross_entropy(model_copy(x), y).detach()
    with use_device(_FakeDevice()):
        loss = job.wrap()(job.batch)
    assert _sizes(job.calls) == [6, 3, 2, 2, 2]
    torch.testing.assert_close(loss, expected)


def test_the_working_micro_batch_is_remembered_for_later_steps():
    """After a recovery, the next step starts at the working size and pays no OOM."""
    job = _Job(n=8, limit=3)
    with use_device(_FakeDevice()):
        wrapped = job.wrap()
        wrapped(job.batch)
        job.calls.clear()
        wrapped(job.batch)
    assert _sizes(job.calls) == [2, 2, 2, 2]
    assert wrapped.oom_count == 2 and wrapped.optimizer_steps == 2
    wrapped.reset()
    assert wrapped.micro_batch_size is None


def test_uneven_split_weights_each_micro_batch_by_its_size():
    """Batch 7 with room for 2: 7, then 4+3 (OOM), then 2+2+2+1; gradients still match."""
    job = _Job(n=7, limit=2)
    reference = job.reference_grads()
    with use_device(_FakeDevice()):
        job.wrap()(job.batch)
    assert _sizes(job.calls) == [7, 4, 2, 2, 2, 1]
    for got, want in zip(job.grads[0], reference, strict=True):
        torch.testing.assert_close(got, want)


def test_sum_reduced_loss_is_not_rescaled():
    """With loss_reduction="sum" the micro-batch losses add up unweighted to the batch's."""
    job = _Job(n=8, limit=4, reduction="sum")
    reference = job.reference_grads()
    with use_device(_FakeDevice()):
        job.wrap(loss_reduction="sum")(job.batch)
    assert _sizes(job.calls) == [8, 4, 4]
    for got, want in zip(job.grads[0], reference, strict=True):
        torch.testing.assert_close(got, want)


def test_partial_gradients_of_a_failed_attempt_are_zeroed():
    """An OOM after backward already accumulated a micro-batch's gradient leaves no trace of it."""
    job = _Job(n=8)
    reference = job.reference_grads()
    backwards = []

    def backward(loss):
        loss.backward()  # the gradient is accumulated, then the step "runs out" afterwards
        backwards.append(1)
        if len(backwards) == 2:
            raise _oom()

    with use_device(_FakeDevice()):
        wrapped = job.wrap(micro_batch_size=4, backward=backward)
        wrapped(job.batch)
    # 4 ok, 4 OOM after its backward; retry at 2: 2+2+2+2.
    assert _sizes(job.calls) == [4, 4, 2, 2, 2, 2]
    assert [e.micro_batch_index for e in wrapped.events] == [1]
    for got, want in zip(job.grads[0], reference, strict=True):
        torch.testing.assert_close(got, want)


def test_oom_at_one_sample_reraises_the_oom_with_a_note():
    """When micro-batches of one sample still OOM, the OOM propagates and nothing is stepped."""
    job = _Job(n=4, limit=0)
    with use_device(_FakeDevice()):
        wrapped = job.wrap()
        with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate") as info:
            wrapped(job.batch)
    assert _sizes(job.calls) == [4, 2, 1]
    assert any("micro-batches of 1 sample" in note for note in info.value.__notes__)
    assert wrapped.optimizer_steps == 0 and job.grads == []
    assert all(p.grad is None for p in job.model.parameters())
    assert [e.next_micro_batch_size for e in wrapped.events] == [2, 1, None]


def test_other_exceptions_propagate_without_retry():
    """A non-OOM error (even one whose text mentions memory) is not retried."""
    calls = []

    def step(batch):
        calls.append(len(batch))
        raise RuntimeError("CUDA out of memory. Tried to allocate 1 GiB")

    model = torch.nn.Linear(2, 2)
    wrapped = resilient(step, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="Tried to allocate"):
        wrapped(torch.zeros(8, 2))
    assert calls == [8] and wrapped.events == []


def test_evaluation_oom_never_shrinks_the_training_micro_batch():
    """evaluate() and no_grad calls split on OOM with their own size; training stays unsplit."""
    job = _Job(n=8, limit=3)
    with use_device(_FakeDevice()):
        wrapped = job.wrap()
        eval_loss = wrapped.evaluate(job.batch)
        assert _sizes(job.calls) == [8, 4, 2, 2, 2, 2]
        assert wrapped.eval_micro_batch_size == 2 and wrapped.micro_batch_size is None
        assert [e.phase for e in wrapped.events] == ["eval", "eval"]
        assert wrapped.optimizer_steps == 0
        assert all(p.grad is None for p in job.model.parameters())
        job.calls.clear()
        with torch.no_grad():
            wrapped(job.batch)
        assert _sizes(job.calls) == [2, 2, 2, 2]  # remembered eval size, no new OOM
        job.limit = None
        job.calls.clear()
        wrapped(job.batch)
    assert _sizes(job.calls) == [8]  # training still tries the whole batch
    assert wrapped.micro_batch_size is None and wrapped.optimizer_steps == 1
    assert eval_loss.shape == ()


def test_evaluation_concatenates_per_sample_outputs():
    """An eval step returning one value per sample gets them back concatenated in order."""
    seen = []

    def step(x):
        seen.append(len(x))
        if len(x) > 2:
            raise _oom()
        return x * 10

    with use_device(_FakeDevice()):
        out = resilient(step).evaluate(torch.arange(5.0))
    assert seen == [5, 3, 2, 2, 1]
    torch.testing.assert_close(out, torch.arange(5.0) * 10)


def test_oom_in_the_optimizer_step_is_not_retried():
    """An OOM in optimizer.step propagates with a note; splitting the batch cannot help."""
    job = _Job(n=4)

    def optimizer_step():
        raise _oom()

    wrapped = resilient(job.step, optimizer=job.optimizer, optimizer_step=optimizer_step)
    with pytest.raises(torch.OutOfMemoryError) as info:
        wrapped(job.batch)
    assert any("optimizer step" in note for note in info.value.__notes__)
    assert _sizes(job.calls) == [4] and wrapped.events == [] and wrapped.optimizer_steps == 0


def test_training_without_an_optimizer_is_refused():
    """A training call needs optimizer= so the wrapper can zero and step the whole gradient."""
    with pytest.raises(TypeError, match="optimizer=opt"):
        resilient(lambda b: b.sum())(torch.zeros(2, 2))


def test_step_must_return_a_scalar_loss():
    """A step that returns a non-scalar is rejected with the calling contract."""
    model = torch.nn.Linear(2, 2)
    wrapped = resilient(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="scalar tensor"):
        wrapped(torch.zeros(3, 2))


def test_decorator_form_keeps_the_function_name_and_logs(caplog):
    """@resilient(optimizer=...) wraps the function and logs each recovered OOM as a warning."""
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @resilient(optimizer=opt)
    def train_step(x):
        if len(x) > 4:
            raise _oom()
        return model(x).mean()

    with use_device(_FakeDevice()), caplog.at_level(logging.WARNING, "oomkit.runtime.resilient"):
        train_step(torch.ones(8, 2))
    assert train_step.__name__ == "train_step"
    assert [r.getMessage() for r in caplog.records] == [
        "CUDA OOM in train step 1 (batch 8, micro-batch 8); retrying with micro-batch 4"
    ]


def test_split_batch_handles_dicts_namedtuples_and_passthrough_values():
    """Dicts, namedtuples and lists split by their first dimension; non-tensors are kept."""
    Pair = namedtuple("Pair", "x y")
    batch = {"ids": torch.arange(5), "pair": Pair(torch.zeros(5, 2), [torch.ones(5)]), "tag": "a"}
    chunks = split_batch(batch, 2)
    assert [batch_size_of(c) for c in chunks] == [2, 2, 1]
    assert chunks[2]["ids"].tolist() == [4] and chunks[1]["tag"] == "a"
    assert isinstance(chunks[0]["pair"], Pair) and chunks[0]["pair"].y[0].shape == (2,)


def test_batch_with_unequal_first_dims_cannot_be_split():
    """Tensors that disagree on the batch dimension are refused with what to pass instead."""
    with pytest.raises(BatchSplitError, match=r"first dims \[3, 4\]"):
        batch_size_of((torch.zeros(3), torch.zeros(4)))
    with pytest.raises(BatchSplitError, match="no tensor"):
        batch_size_of({"a": 1})


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 24), limit=st.integers(1, 24), start=st.one_of(st.none(), st.integers(1, 24))
)
def test_recovery_invariants(n, limit, start):
    """Any batch, memory limit and starting size: sizes halve, each sample once, same gradient."""
    job = _Job(n=n, limit=limit)
    reference = job.reference_grads()
    # Each caught OOM runs gc.collect() (runtime/device.py release_after_oom), which in a test
    # process holding torch, transformers and every earlier test's objects costs most of this
    # test's time: counted here instead of run.
    with use_device(_FakeDevice()), mock.patch("oomkit.runtime.device.gc.collect") as collect:
        wrapped = job.wrap(micro_batch_size=start)
        wrapped(job.batch)
    micro = n if start is None else min(start, n)
    expected_failures = []
    while micro > limit:
        expected_failures.append(micro)
        micro = (micro + 1) // 2
    assert [e.failed_micro_batch_size for e in wrapped.events] == expected_failures
    assert wrapped.oom_count == len(expected_failures) and wrapped.optimizer_steps == 1
    assert collect.call_count == len(expected_failures)  # one release per caught OOM
    final = job.calls[len(expected_failures) :]
    assert [i for call in final for i in call] == list(range(n))
    assert all(len(call) <= micro for call in final)
    for got, want in zip(job.grads[0], reference, strict=True):
        torch.testing.assert_close(got, want)


# ---------------------------------------------------------------- on the simulated CUDA device


def _mlp() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 8)
    )
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_real_training_loop_recovers_on_a_2_mib_simulated_gpu(simulated_device):
    """A real MLP step on 256 samples OOMs at 256 and 128 on a 2 MiB GPU, then trains at 64.

    Hidden activations take 4 KiB a sample: 256 samples need 1 MiB blocks beside the model
    (168 KiB) and the batch, more than the one 2 MiB small-pool segment the device can hold.
    """
    torch.manual_seed(1)
    x, y, ids = torch.randn(256, 32), torch.randint(0, 8, (256,)), torch.arange(256)
    reference, _ = _mlp()
    F.cross_entropy(reference(x), y).backward()

    device = simulated_device("2MiB")
    model, opt = _mlp()
    seen: list[list[int]] = []
    grads: list[list[torch.Tensor]] = []

    def step(batch):
        i, xb, yb = batch
        seen.append(i.tolist())
        return F.cross_entropy(model(xb), yb)

    def optimizer_step():
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()

    wrapped = resilient(step, optimizer=opt, optimizer_step=optimizer_step)
    wrapped((ids, x, y))
    assert _sizes(seen) == [256, 128, 64, 64, 64, 64]
    assert [i for call in seen[2:] for i in call] == list(range(256))
    assert device.oom_count == wrapped.oom_count == 2
    assert [(e.failed_micro_batch_size, e.micro_batch_index) for e in wrapped.events] == [
        (256, 0),
        (128, 0),
    ]
    for got, want in zip(grads[0], reference.parameters(), strict=True):
        torch.testing.assert_close(got, want.grad)
    seen.clear()
    wrapped((ids, x, y))  # the next step starts at 64 and pays no OOM
    assert _sizes(seen) == [64, 64, 64, 64] and device.oom_count == 2
    assert wrapped.optimizer_steps == 2

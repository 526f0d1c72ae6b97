"""Python numbers turned into tensors where CUDA turns them (emulations/scalars.py)."""

from __future__ import annotations

import pytest
import torch

from oomkit.prediction.tracing import trace_step


def _events(recording) -> list[tuple[str, int, str | None]]:
    """Allocations (with what made them) and completed frees, in order."""
    return [(e.action, e.size, dict(e.tags).get("emulated") or dict(e.tags).get("op"))
            if e.action == "alloc" else (e.action, e.size, None)
            for e in recording.events[recording.step_starts[0]:]
            if e.action in ("alloc", "free_completed")]


def _step(body):
    """``body(x)`` on a fresh [4, 8] fp32 tensor made inside the step."""
    def step():
        x = torch.zeros(4, 8)
        body(x)

    return trace_step(step)


@pytest.mark.parametrize(("base", "wrapped"), [(10000.0, 8), (2, 8), (1 + 1j, 16)])
def test_a_number_base_is_wrapped_on_the_device_after_the_output(base, wrapped):
    """Pow.cpp pow_Scalar_out: the output, then wrapped_scalar_tensor(base, exp.device())
    (kDouble, kLong or kComplexDouble), freed when the kernel returns."""
    recording = _step(lambda x: base ** x)
    out = 4 * 8 * (8 if isinstance(base, complex) else 4)
    assert _events(recording)[1:4] == [
        ("alloc", out, "aten.pow.Scalar"),
        ("alloc", wrapped, "pow_scalar_base"),
        ("free_completed", wrapped, None),
    ]


def test_a_base_of_one_wraps_nothing():
    """pow_Scalar_out fills the output with 1 for a base of 1: no device scalar."""
    recording = _step(lambda x: 1.0 ** x)
    assert [size for action, size, _ in _events(recording) if action == "alloc"] == [128, 128]


@pytest.mark.parametrize("index", [(slice(None), -1), 0, (Ellipsis, slice(1, 3)), (None, 2)])
def test_assigning_a_number_through_basic_indexing_allocates_nothing(index):
    """THPVariable_setitem makes the number a CPU tensor for a CUDA tensor: the slice is filled
    from the host (the H200's trace of GPT-2's labels[:, -1] = -100 has no request)."""

    def body(x):
        x[index] = -100

    assert _events(_step(body)) == [
        ("alloc", 128, "aten.zeros.default"), ("free_completed", 128, None)
    ]


def test_assigning_a_number_through_a_tensor_index_keeps_the_device_copy():
    """Tensor indices reach _index_put_impl_, which copies a host number to the device
    (value.to(self.device())): 8 bytes on the device, as before, freed with the assignment."""

    def body(x):
        x[torch.tensor([0, 2])] = 5.0

    sizes = [size for action, size, _ in _events(_step(body)) if action == "alloc"]
    assert 4 in sizes  # the number, as the fp32 tensor's dtype, on the device


def test_the_assigned_values_are_what_python_assigns():
    """The host number reaches the slice: a CPU run of the same code agrees on shapes and the
    meta result keeps the tensor's dtype."""
    x = torch.zeros(2, 3, device="meta", dtype=torch.bfloat16)

    def step(x):
        x[:, 1] = 3
        x[0] = True

    recording = trace_step(step, x)
    assert x.dtype == torch.bfloat16 and x.shape == (2, 3)
    assert [e for e in _events(recording) if e[0] == "alloc"] == []


def test_on_a_fake_process_group_the_assigned_number_is_host_memory():
    """FSDP2's fake world: every tensor's fake device is the host's, so the hook's host number is
    a fake tensor marked as host memory (fake_storages.mark_host); unmarked, copy_ would account
    it as an 8-byte allocation first seen. labels[:, -1] = -100 records none."""
    from torch.distributed.fsdp import fully_shard

    from oomkit.prediction.tracing.distributed import trace_distributed_step

    def build(mesh):
        with torch.device("cpu"):
            model = torch.nn.Linear(8, 8)
            fully_shard(model, mesh=mesh)
            labels = torch.zeros(4, 8, dtype=torch.long)

        def step():
            labels[:, -1] = -100
            model(torch.randn(4, 8)).sum().backward()

        return step, (model, labels)

    recording = trace_distributed_step(build, world_size=2, steps=1)
    allocs = [e for e in recording.events[recording.step_starts[0]:] if e.action == "alloc"]
    # The step's first allocation is the input; nothing of 8 bytes (the number) anywhere.
    assert dict(allocs[0].tags).get("op") == "aten.randn.default"
    assert [e.size for e in allocs if e.size == 8] == []

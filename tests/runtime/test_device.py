"""The runtime seam: use_device overrides, OOM detection by type, clean-up after a caught OOM."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from oomkit.runtime import current_device, is_out_of_memory, release_after_oom, use_device


class _CountingDevice:
    name = "fake"

    def __init__(self) -> None:
        self.empty_cache_calls = 0

    def empty_cache(self) -> None:
        self.empty_cache_calls += 1


def test_use_device_nests_and_restores():
    """The innermost use_device wins and is removed when its block exits."""
    outer, inner = _CountingDevice(), _CountingDevice()
    with use_device(outer):
        assert current_device() is outer
        with use_device(inner):
            assert current_device() is inner
        assert current_device() is outer


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_current_device_without_cuda_says_what_to_do():
    """Without CUDA and without an override the error names the simulated device."""
    with pytest.raises(RuntimeError, match="SimulatedCudaDevice"):
        current_device()


def test_out_of_memory_is_decided_by_type_not_text():
    """A RuntimeError whose text looks like an OOM is not one; torch.OutOfMemoryError is."""
    assert is_out_of_memory(torch.OutOfMemoryError("anything"))
    assert not is_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))


def test_release_after_oom_frees_tensors_held_by_the_traceback():
    """The frames of a caught OOM keep tensors alive until release_after_oom drops them."""
    device = _CountingDevice()

    def step() -> None:
        big = torch.empty(1000)
        holder.append(weakref.ref(big))
        raise torch.OutOfMemoryError("simulated")

    holder: list[weakref.ref] = []
    with use_device(device):
        try:
            step()
        except torch.OutOfMemoryError as exc:
            caught = exc
        gc.collect()
        assert holder[0]() is not None  # the traceback's frame still references `big`
        release_after_oom(caught)
    assert holder[0]() is None
    assert device.empty_cache_calls == 1

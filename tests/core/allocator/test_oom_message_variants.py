"""The OOM message's NVML sentences and the other OOM-type errors (ref §12.2, §12.4)."""

from __future__ import annotations

import pytest

from oomkit.core.allocator import AllocatorConfig, CachingAllocator, SimulatedOutOfMemoryError
from oomkit.core.allocator.oom_message import process_memory_info

MiB = 2**20
GiB = 2**30


def test_process_sentences_exact_text():
    """reportProcessMemoryInfo: own pid gets the "Including non-PyTorch memory" sentence."""
    text = process_memory_info([(4242, 3 * GiB), (77, 512 * MiB), (5, 1024)], self_pid=4242)
    assert text == (
        "Including non-PyTorch memory, this process has 3.00 GiB memory in use. "
        "Process 77 has 512.00 MiB memory in use. "
        "Process 5 has 1024 bytes memory in use. "
    )
    assert process_memory_info([], self_pid=1) == ""


def test_oom_message_carries_process_sentences():
    """The provider's sentences sit between "is free. " and "Of the allocated memory"."""
    a = CachingAllocator(
        capacity_bytes=30 * MiB,
        process_memory=lambda: [(10, 25 * MiB), (11, 5 * MiB)],
        pid=10,
    )
    a.malloc(5 * MiB)
    with pytest.raises(SimulatedOutOfMemoryError) as info:
        a.malloc(16 * MiB)
    assert str(info.value).startswith(
        "CUDA out of memory. Tried to allocate 16.00 MiB. GPU 0 has a total capacity of 30.00 MiB"
        " of which 10.00 MiB is free. Including non-PyTorch memory, this process has 25.00 MiB "
        "memory in use. Process 11 has 5.00 MiB memory in use. Of the allocated memory 5.00 MiB"
        " is allocated by PyTorch, and 15.00 MiB is reserved by PyTorch but unallocated."
    )


def test_oom_message_without_provider_has_no_process_sentences():
    """No provider (no NVML): the sentence is empty, as in PyTorch."""
    a = CachingAllocator(capacity_bytes=10 * MiB)
    with pytest.raises(SimulatedOutOfMemoryError) as info:
        a.malloc(20 * MiB)
    assert "is free. Of the allocated memory 0 bytes is allocated" in str(info.value)
    assert a.process_memory_info() == ""


def test_classic_message_has_no_process_sentences():
    """<= 2.0 text has no PROC part even with a provider (§12.3)."""
    a = CachingAllocator(
        capacity_bytes=10 * MiB, torch_version="2.0", process_memory=lambda: [(1, MiB)], pid=1
    )
    with pytest.raises(SimulatedOutOfMemoryError) as info:
        a.malloc(20 * MiB)
    assert "in use" not in str(info.value)
    assert str(info.value).startswith("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0;")


def test_one_exabyte_request():
    """Requests >= 2^60 fail before the device allocator: no num_ooms, no segment (§12.4)."""
    a = CachingAllocator()
    with pytest.raises(
        SimulatedOutOfMemoryError,
        match=r"^CUDA out of memory\. Tried to allocate more than 1EB memory\.$",
    ):
        a.malloc(2**60)
    assert a.memory_stats()["num_ooms"] == 0
    with pytest.raises(SimulatedOutOfMemoryError, match="Tried to allocate 1073741824.00 GiB"):
        a.malloc(2**60 - 1)
    assert a.memory_stats()["num_ooms"] == 1


def _rejecting(config: str, capacity_bytes: int) -> CachingAllocator:
    return CachingAllocator(AllocatorConfig.parse(config), capacity_bytes=capacity_bytes)


def test_throw_on_cudamalloc_oom_rejects_instead_of_releasing_cache():
    """MAIN26: the rejection skips Steps 7-9, keeps the cache, counts num_oom_rejections."""
    a = _rejecting("throw_on_cudamalloc_oom:True", 30 * MiB)
    a.free(a.malloc(5 * MiB, stream=1))  # 20 MiB cached on another stream
    with pytest.raises(SimulatedOutOfMemoryError) as info:
        a.malloc(5 * MiB)
    assert str(info.value) == (
        "CUDA out of memory. Allocation was preemptively rejected because it would exceed "
        "per_process_memory_fraction limit. Requested size: 5.00 MiB"
    )
    assert info.value.rejected is True
    s = a.memory_stats()
    assert (s["num_ooms"], s["num_alloc_retries"], s["num_sync_all_streams"]) == (0, 0, 0)
    assert a.num_oom_rejections == 1
    assert a.memory_reserved() == 20 * MiB
    a.reset_accumulated_memory_stats()
    assert a.num_oom_rejections == 0


def test_without_the_flag_the_same_request_succeeds():
    """Control: without throw_on_cudamalloc_oom, Step 9 frees the cache and the retry wins."""
    a = CachingAllocator(capacity_bytes=30 * MiB)
    a.free(a.malloc(5 * MiB, stream=1))
    a.malloc(5 * MiB)
    assert a.memory_stats()["num_alloc_retries"] == 1


def test_rejection_uses_the_config_fraction_truncated():
    """The limit is trunc(config fraction * total), even after set_per_process_memory_fraction(1)."""
    a = _rejecting("throw_on_cudamalloc_oom:True,per_process_memory_fraction:0.5", 100 * MiB)
    assert a.allowed_memory_maximum == 50 * MiB
    a.set_per_process_memory_fraction(1.0)  # the Python API lifts Step 6.2's limit only
    assert a.allowed_memory_maximum is None
    a.malloc(40 * MiB)
    with pytest.raises(SimulatedOutOfMemoryError, match="Requested size: 12.00 MiB$") as info:
        a.malloc(12 * MiB)
    assert info.value.rejected is True
    assert a.num_oom_rejections == 1


def test_fraction_limit_fires_before_the_rejection():
    """With the config fraction also setting the limit, Step 6.2 gives a normal OOM (§4 step 6.3)."""
    a = _rejecting("throw_on_cudamalloc_oom:True,per_process_memory_fraction:0.5", 100 * MiB)
    a.malloc(40 * MiB)
    with pytest.raises(SimulatedOutOfMemoryError) as info:
        a.malloc(20 * MiB)
    assert info.value.rejected is False
    assert "50.00 MiB allowed; " in str(info.value)
    assert a.num_oom_rejections == 0


def test_rejection_not_modelled_before_main26():
    """torch 2.4 has no throw_on_cudamalloc_oom: a direct config flag changes nothing."""
    a = CachingAllocator(
        AllocatorConfig(throw_on_cudamalloc_oom=True), capacity_bytes=30 * MiB, torch_version="2.4"
    )
    a.free(a.malloc(5 * MiB, stream=1))
    a.malloc(5 * MiB)
    assert a.num_oom_rejections == 0

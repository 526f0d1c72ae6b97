"""Parsing PyTorch's out-of-memory error texts (every variant of ref §12) into bytes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oomkit.core.allocator import AllocatorConfig, CachingAllocator, SimulatedOutOfMemoryError
from oomkit.core.allocator.oom_message import oom_message
from oomkit.core.allocator.versions import behaviour_for
from oomkit.diagnose.oom_text import ProcessMemory, find_oom_texts, parse_oom_text
from oomkit.errors import OomkitError, OomTextError

MiB = 2**20
GiB = 2**30


def _oom(allocator: CachingAllocator, nbytes: int) -> SimulatedOutOfMemoryError:
    with pytest.raises(SimulatedOutOfMemoryError) as info:
        allocator.malloc(nbytes)
    return info.value


@pytest.mark.parametrize(
    ("torch_version", "variant", "versions"),
    [
        ("2.0", "classic", "1.5-2.0"),
        ("2.1", "native", "2.1"),
        ("2.4", "native", ">=2.2"),
        (None, "native", ">=2.2"),
    ],
)
def test_simulated_messages_parse_back_to_their_figures(torch_version, variant, versions):
    """The simulator's message for each version parses back to the state that raised it."""
    a = CachingAllocator(capacity_bytes=GiB, torch_version=torch_version)
    a.malloc(300 * MiB)
    a.free(a.malloc(100 * MiB))
    a.malloc(30 * MiB)  # splits the cached 100 MiB segment: 70 MiB stay reserved, unallocated
    error = _oom(a, 700 * MiB)
    parsed = parse_oom_text(f"torch.OutOfMemoryError: {error}")
    assert parsed.variant == variant
    assert parsed.torch_versions == versions
    assert parsed.device == 0
    assert parsed.requested_bytes == 700 * MiB
    assert parsed.total_bytes == GiB
    assert parsed.free_bytes == error.free_bytes
    assert parsed.allocated_bytes == 330 * MiB
    assert parsed.reserved_bytes == error.reserved_bytes == 400 * MiB
    assert parsed.reserved_unallocated_bytes == 70 * MiB
    assert parsed.outside_allocator_bytes == 0


def test_memory_fraction_clause_gives_allowed_bytes():
    """`set_per_process_memory_fraction` adds "N allowed;" to both message families."""
    for version, variant in (("2.0", "classic"), (None, "native")):
        a = CachingAllocator(capacity_bytes=GiB, torch_version=version)
        a.set_per_process_memory_fraction(0.5)
        a.malloc(400 * MiB)
        parsed = parse_oom_text(str(_oom(a, 200 * MiB)))
        assert (parsed.variant, parsed.allowed_bytes) == (variant, 512 * MiB)
        assert parsed.allocated_bytes == 400 * MiB


def test_private_pools_and_process_sentences():
    """2.2+: NVML process sentences and the private-pool clause are read, AL excludes P."""
    text = oom_message(
        behaviour_for(None),
        alloc_size=2 * GiB,
        device=3,
        total=80 * GiB,
        free=GiB,
        allocated=60 * GiB,
        reserved=70 * GiB,
        allowed=None,
        private_pool_cached=4 * GiB,
        process_info=(
            "Including non-PyTorch memory, this process has 71.50 GiB memory in use. "
            "Process 4242 has 7.25 GiB memory in use. "
        ),
    )
    parsed = parse_oom_text(text)
    assert parsed.device == 3
    assert parsed.private_pool_bytes == 4 * GiB
    assert parsed.allocated_bytes == 60 * GiB
    assert parsed.reserved_bytes == 70 * GiB
    assert parsed.reserved_unallocated_bytes == 6 * GiB
    assert parsed.outside_allocator_bytes == 9 * GiB
    assert parsed.processes == (
        ProcessMemory(None, round(71.5 * GiB)),
        ProcessMemory(4242, round(7.25 * GiB)),
    )


def test_real_classic_message_wrapped_in_a_commented_log():
    """A 1.x message broken over '#'-commented lines still parses (from a public script)."""
    text = """# RuntimeError: CUDA out of memory. Tried to allocate 36.00 MiB (GPU 0; 7.93 GiB total
# capacity; 130.35 MiB already
# allocated; 47.06 MiB free; 188.00 MiB reserved in total by PyTorch) If reserved memory is
# >> allocated memory try setting max_split_size_mb to avoid fragmentation."""
    parsed = parse_oom_text(text)
    assert parsed.variant == "classic"
    assert parsed.requested_bytes == 36 * MiB
    assert parsed.total_bytes == round(7.93 * GiB)
    assert parsed.allocated_bytes == round(130.35 * MiB)
    assert parsed.free_bytes == round(47.06 * MiB)
    assert parsed.reserved_bytes == 188 * MiB
    assert parsed.tolerance_bytes["total_bytes"] == GiB // 200
    assert parsed.tolerance_bytes["requested_bytes"] == MiB // 200


def test_cached_wording_of_torch_1_4_and_earlier():
    """1.4 said "cached" for reserved: 9.66 GiB allocated + 9.88 GiB cannot fit 10.76 GiB."""
    parsed = parse_oom_text(
        "RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 10.76 GiB total "
        "capacity; 9.66 GiB already allocated; 17.56 MiB free; 9.88 GiB cached)"
    )
    assert (parsed.variant, parsed.torch_versions) == ("classic", "<=1.4")
    assert parsed.reserved_bytes == round(9.88 * GiB)


def test_cuda_malloc_async_message():
    """backend:cudaMallocAsync's multi-line message (CUDAMallocAsyncAllocator.cpp mallocAsync)."""
    text = (
        "torch.OutOfMemoryError: Allocation on device 1 would exceed allowed memory. "
        "(out of memory)\nCurrently allocated     : 30.50 GiB\nRequested               : "
        "2.00 GiB\nDevice limit            : 39.39 GiB\nFree (according to CUDA): 1.12 GiB\n"
        "PyTorch limit (set by user-supplied memory fraction)\n                        : "
        "31.51 GiB"
    )
    parsed = parse_oom_text(text)
    assert parsed.variant == "cuda_malloc_async"
    assert parsed.device == 1
    assert parsed.allocated_bytes == round(30.5 * GiB)
    assert parsed.requested_bytes == 2 * GiB
    assert parsed.total_bytes == round(39.39 * GiB)
    assert parsed.free_bytes == round(1.12 * GiB)
    assert parsed.allowed_bytes == round(31.51 * GiB)
    assert parsed.reserved_bytes is None
    assert parsed.outside_allocator_bytes is None


def test_one_exabyte_preemptive_and_driver_variants():
    """The figure-less variants are recognised by their fixed wording."""
    exa = parse_oom_text("CUDA out of memory. Tried to allocate more than 1EB memory.")
    assert (exa.variant, exa.requested_bytes) == ("exa", 2**60)
    rejected = parse_oom_text(
        "CUDA out of memory. Allocation was preemptively rejected because it would exceed "
        "per_process_memory_fraction limit. Requested size: 512.00 MiB"
    )
    assert (rejected.variant, rejected.requested_bytes) == ("fraction_rejected", 512 * MiB)
    driver = parse_oom_text(
        "RuntimeError: CUDA error: out of memory\nCUDA kernel errors might be asynchronously "
        "reported at some other API call"
    )
    assert driver.variant == "driver"
    assert driver.requested_bytes is None


def test_several_ranks_in_one_log():
    """Each rank's message is found, in order; a simulated 1EB request is one too."""
    a = CachingAllocator(capacity_bytes=GiB)
    first = str(_oom(a, 2 * GiB))
    second = str(_oom(a, 2**60))
    found = find_oom_texts(f"[rank0]: {first}\n[rank1]: {second}\n")
    assert [f.variant for f in found] == ["native", "exa"]
    assert found[0].requested_bytes == 2 * GiB


@pytest.mark.parametrize("text", ["", "Segmentation fault", "CUDA out of memory. Tried to"])
def test_text_without_a_message_is_a_clear_error(text):
    """Garbage gets one OomTextError that says what to paste."""
    with pytest.raises(OomTextError, match="no CUDA out-of-memory message found.*Paste"):
        parse_oom_text(text)
    assert issubclass(OomTextError, OomkitError) and issubclass(OomTextError, ValueError)


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=2**45))
def test_parsed_size_is_within_its_tolerance(size_bytes):
    """Any format_size output parses back to within the stated tolerance of the truth."""
    text = oom_message(
        behaviour_for(None),
        alloc_size=size_bytes,
        device=0,
        total=2**46,
        free=0,
        allocated=0,
        reserved=0,
        allowed=None,
    )
    parsed = parse_oom_text(text)
    assert parsed.requested_bytes is not None
    assert abs(parsed.requested_bytes - size_bytes) <= parsed.tolerance_bytes["requested_bytes"]


def test_expandable_configuration_does_not_change_the_wording():
    """expandable_segments messages (2.13) parse like any native one."""
    a = CachingAllocator(AllocatorConfig.parse("expandable_segments:True"), capacity_bytes=GiB)
    a.malloc(900 * MiB)
    parsed = parse_oom_text(str(_oom(a, 300 * MiB)))
    assert parsed.variant == "native"
    assert parsed.allocated_bytes == 900 * MiB


def test_cached_wording_up_to_torch_1_3_is_the_cache_not_the_total():
    """Up to 1.3 "N cached" was reserved minus allocated (PR #13751): 6.64 GiB allocated with
    150.86 MiB cached is 6.79 GiB reserved (ryujaehun/pytorch-gpu-benchmark#1)."""
    parsed = parse_oom_text(
        "RuntimeError: CUDA out of memory. Tried to allocate 32.00 MiB (GPU 0; 7.79 GiB total "
        "capacity; 6.64 GiB already allocated; 21.00 MiB free; 150.86 MiB cached)"
    )
    assert parsed.reserved_bytes == round(6.64 * GiB) + round(150.86 * MiB)
    assert parsed.reserved_unallocated_bytes == round(150.86 * MiB)
    assert parsed.tolerance_bytes["reserved_bytes"] == GiB // 200 + MiB // 200


def test_classic_message_without_its_closing_parenthesis():
    """A copy-paste that lost the ')' is still read (singhsourabh/Resume-NER#4)."""
    parsed = parse_oom_text(
        "RuntimeError: CUDA out of memory. Tried to allocate 92.00 MiB (GPU 0; 1.96 GiB total "
        "capacity; 1.46 GiB already allocated; 16.38 MiB free; 1.51 GiB reserved in total by "
        "PyTorch"
    )
    assert parsed.reserved_bytes == round(1.51 * GiB)


def test_a_message_cut_after_its_first_sentences_says_so_with_its_figures():
    """A paste of a native message's first line: the error says what it holds and what is
    missing, instead of "no message found"; a request above the device's total says so."""
    head = (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
        "total capacity of 23.65 GiB of which 1.13 GiB is free."
    )
    with pytest.raises(OomTextError) as raised:
        parse_oom_text(f"Traceback (most recent call last):\n  ...\n{head}\n")
    message = str(raised.value)
    assert message.startswith(
        "the out-of-memory message is cut short: it says a request of 2.00 GiB failed on GPU 0 "
        "with 1.13 GiB free of 23.65 GiB, but not how much of the device PyTorch had allocated"
    )
    assert "up to '... is reserved by PyTorch but unallocated.'" in message
    with pytest.raises(OomTextError, match=r"cut short: it says a request of 512.00 MiB failed, but"):
        parse_oom_text("RuntimeError: CUDA out of memory. Tried to allocate 512.00 MiB.")
    with pytest.raises(OomTextError, match="a request larger than the whole device"):
        parse_oom_text(head.replace("2.00 GiB.", "30.00 GiB."))
    # The whole message is parsed as before.
    whole = head + (
        " Including non-PyTorch memory, this process has 22.51 GiB memory in use. Of the "
        "allocated memory 21.90 GiB is allocated by PyTorch, and 151.04 MiB is reserved by "
        "PyTorch but unallocated."
    )
    assert parse_oom_text(whole).variant == "native"


# Allocation failures outside the caching allocator, as each library prints them, and who the
# diagnosis names (diagnosis._WHO_FAILED).
_OUTSIDE = [
    ("RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
     "here cuBLAS"),
    ("RuntimeError: cuDNN error: CUDNN_STATUS_ALLOC_FAILED", "here cuDNN"),
    ("RuntimeError: cusolver error: CUSOLVER_STATUS_ALLOC_FAILED, when calling `cusolverDnCreate`",
     "here cuSOLVER"),
    ("RuntimeError: cuFFT error: CUFFT_ALLOC_FAILED", "here cuFFT"),
    ("NCCL WARN Cuda failure 'out of memory'", "here NCCL"),
    ("ncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\nCuda failure 2 'out of "
     "memory'", "here NCCL"),
    ("RuntimeError: CUDA driver error: out of memory", None),
]


@settings(max_examples=30, deadline=None)
@given(
    case=st.sampled_from(_OUTSIDE),
    before=st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=200),
)
def test_allocation_failures_outside_the_allocator_are_the_driver_variant(case, before):
    """cuBLAS, cuDNN, cuSOLVER, cuFFT and NCCL running out of memory: the figure-less 'driver'
    variant wherever it sits in a log, and the diagnosis names the library. They had been
    'no CUDA out-of-memory message found'."""
    from oomkit.diagnose.diagnosis import diagnose_oom_text

    text, who = case
    found = find_oom_texts(f"{before}\n{text}\n")
    assert [f.variant for f in found][-1:] == ["driver"]
    finding = diagnose_oom_text(parse_oom_text(text)).causes[0].summary
    assert finding.startswith("a CUDA call outside PyTorch's caching allocator ran out")
    assert (who in finding) if who else ("; here" not in finding)


def test_an_mps_message_is_refused_naming_the_backend():
    """Apple's MPS backend: not a CUDA message, said so (it had been 'no CUDA out-of-memory
    message found')."""
    with pytest.raises(OomTextError, match="Apple's MPS backend; oomkit explains CUDA's"):
        parse_oom_text(
            "RuntimeError: MPS backend out of memory (MPS allocated: 18.13 GB, other "
            "allocations: 384.00 KB, max allowed: 18.13 GB). Tried to allocate 256.00 MB on "
            "private pool."
        )

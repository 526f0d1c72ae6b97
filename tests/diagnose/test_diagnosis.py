"""Diagnosing an OOM from its message: a labelled set of cases made with the simulator."""

from __future__ import annotations

import pytest

from oomkit.core.allocator import CachingAllocator, SimulatedOutOfMemoryError
from oomkit.core.gpus import DEFAULT_CONTEXT_OVERHEAD_BYTES, get_gpu
from oomkit.diagnose.diagnosis import CAUSES, diagnose_oom_text
from oomkit.diagnose.oom_text import parse_oom_text

MiB = 2**20
GiB = 2**30
CONTEXT = DEFAULT_CONTEXT_OVERHEAD_BYTES


def _message(allocator: CachingAllocator, nbytes: int) -> str:
    with pytest.raises(SimulatedOutOfMemoryError) as info:
        allocator.malloc(nbytes)
    return str(info.value)


def _shortage(version):
    a = CachingAllocator(
        capacity_bytes=8 * GiB, reserved_outside_bytes=CONTEXT, torch_version=version
    )
    for _ in range(7):
        a.malloc(GiB)
    return _message(a, GiB)


def _fragmentation(version):
    a = CachingAllocator(
        capacity_bytes=8 * GiB, reserved_outside_bytes=CONTEXT, torch_version=version
    )
    # Seven 1 GiB segments, each split by a 600 MiB tensor that stays (best fit puts each in its
    # own segment: the 424 MiB remainders are too small for the next): 2968 MiB cached in pieces.
    blocks = [a.malloc(GiB) for _ in range(7)]
    for block in blocks:
        a.free(block)
    for _ in blocks:
        a.malloc(600 * MiB)
    return _message(a, 2 * GiB)


def _outside(version):
    a = CachingAllocator(
        capacity_bytes=8 * GiB, reserved_outside_bytes=4 * GiB, torch_version=version
    )
    a.malloc(2 * GiB)
    return _message(a, 3 * GiB)


def _fraction(version):
    a = CachingAllocator(
        capacity_bytes=8 * GiB, reserved_outside_bytes=CONTEXT, torch_version=version
    )
    a.set_per_process_memory_fraction(0.5)
    a.malloc(3 * GiB)
    return _message(a, 2 * GiB)


def _exceeds(version):
    a = CachingAllocator(capacity_bytes=8 * GiB, torch_version=version)
    return _message(a, 9 * GiB)


CASES = {
    "shortage": _shortage,
    "fragmentation": _fragmentation,
    "outside_pytorch": _outside,
    "fraction_limit": _fraction,
    "request_exceeds_device": _exceeds,
}


@pytest.mark.parametrize("version", ["2.0", "2.1", None])
@pytest.mark.parametrize("cause", sorted(CASES))
def test_labelled_case_gets_its_cause(cause, version):
    """Every labelled case, in every message variant, is classified as its label."""
    diagnosis = diagnose_oom_text(parse_oom_text(CASES[cause](version)))
    assert diagnosis.cause == cause
    assert diagnosis.causes[0].cause == cause
    assert set(f.cause for f in diagnosis.causes) <= set(CAUSES)


def test_fragmentation_evidence_and_top_remedy():
    """Fragmentation shows the cached bytes and ranks expandable segments first, priced."""
    diagnosis = diagnose_oom_text(parse_oom_text(_fragmentation(None)))
    finding = diagnosis.causes[0]
    # "2.90 GiB is reserved by PyTorch but unallocated": two decimals of GiB (±5.12 MiB).
    assert abs(finding.evidence_bytes["reserved_unallocated_bytes"] - 7 * 424 * MiB) <= GiB // 200
    assert finding.evidence_bytes["requested_bytes"] == 2 * GiB
    top = diagnosis.remedies[0]
    assert top.title == "expandable segments"
    assert top.saving_bytes == finding.evidence_bytes["reserved_unallocated_bytes"]
    assert "expandable_segments:True" in top.code
    assert "max_split_size_mb" not in "".join(r.code for r in diagnosis.remedies)
    titles = [r.title for r in diagnosis.remedies]
    assert "do not rely on torch.cuda.empty_cache()" in titles


def test_outside_memory_names_the_excess_over_the_context():
    """Memory outside the allocator beyond a CUDA context is the cause, with the figures."""
    diagnosis = diagnose_oom_text(parse_oom_text(_outside(None)))
    finding = diagnosis.causes[0]
    assert finding.cause == "outside_pytorch"
    assert finding.evidence_bytes["outside_allocator_bytes"] == 4 * GiB
    # It accounts for the whole 1 GiB deficit (3 GiB asked, 2 GiB free); what is clearly someone
    # else's is what lies above the context's upper bound (400 MiB + 800 MiB of libraries).
    assert finding.explained_bytes == GiB
    assert finding.evidence_bytes["context_high_bytes"] == CONTEXT + 800 * MiB
    assert diagnosis.remedies[0].saving_bytes == 4 * GiB - (CONTEXT + 800 * MiB)


def test_catalog_gpu_is_matched_by_total_memory_for_its_context():
    """A message from an H100's total memory uses the H100's context figure."""
    h100 = get_gpu("h100-sxm")
    a = CachingAllocator(capacity_bytes=h100.total_memory_bytes, reserved_outside_bytes=6 * GiB)
    a.malloc(70 * GiB)
    diagnosis = diagnose_oom_text(parse_oom_text(_message(a, 8 * GiB)))
    outside = next(f for f in diagnosis.causes if f.cause == "outside_pytorch")
    assert outside.evidence_bytes["expected_context_bytes"] == h100.context_overhead_bytes
    assert h100.name in outside.summary


def test_fraction_limit_remedy_and_paragraph():
    """A fraction limit with free memory left ranks first; the paragraph uses the user's numbers.
    Raising the fraction of 0.5 (4 GiB of 8) lets the allocator use what the device offers, 8 GiB
    less its CUDA context: 4 GiB less the context, within the message's rounding (it had said
    4 GiB, the whole rest of the device). The shortage is against the limit, and says so."""
    diagnosis = diagnose_oom_text(parse_oom_text(_fraction(None)))
    assert diagnosis.remedies[0].title == "raise the per-process memory fraction"
    assert abs(diagnosis.remedies[0].saving_bytes - (4 * GiB - CONTEXT)) <= GiB // 100
    shortage = next(f for f in diagnosis.causes if f.cause == "shortage")
    assert "against the 4.00 GiB the per-process memory fraction allows (the device would offer" in (
        shortage.summary
    )
    reduce = next(r for r in diagnosis.remedies if r.title.startswith("reduce memory per step"))
    assert "more than the per-process memory fraction allows; raising it (above)" in reduce.why
    assert "Allocated (3.00 GiB" in diagnosis.memory_explained
    assert "nvidia-smi shows about" in diagnosis.memory_explained


def test_figureless_variants():
    """1EB requests, preemptive rejections and driver errors get their causes."""
    exa = diagnose_oom_text(
        parse_oom_text("CUDA out of memory. Tried to allocate more than 1EB memory.")
    )
    assert exa.cause == "request_exceeds_device"
    rejected = diagnose_oom_text(
        parse_oom_text(
            "CUDA out of memory. Allocation was preemptively rejected because it would exceed "
            "per_process_memory_fraction limit. Requested size: 1.00 GiB"
        )
    )
    assert rejected.cause == "fraction_limit"
    driver = diagnose_oom_text(parse_oom_text("RuntimeError: CUDA error: out of memory"))
    assert driver.cause == "outside_pytorch"
    assert driver.warnings


def test_shortage_states_the_shortfall():
    """A plain shortage says how much more the tensors need than the device offers."""
    diagnosis = diagnose_oom_text(parse_oom_text(_shortage(None)))
    finding = diagnosis.causes[0]
    assert finding.evidence_bytes["available_bytes"] == 8 * GiB - CONTEXT
    assert finding.explained_bytes == 8 * GiB - (8 * GiB - CONTEXT)
    assert any(r.saving_bytes is None and "shortfall" in r.title for r in diagnosis.remedies)


def test_remedies_that_do_not_lower_the_peak_rank_last():
    """Remedy.rank_key: lowering the peak first, then bytes saved, then measured before estimated."""
    from oomkit.diagnose.diagnosis import Remedy

    others = Remedy("empty_cache", 10 * 2**30, "high", "", "", estimate=False, lowers_peak=False)
    small = Remedy("small", 2**20, "low", "", "")
    big_est = Remedy("big estimate", 2**30, "low", "", "")
    big_measured = Remedy("big measured", 2**30, "high", "", "", estimate=False)
    ranked = sorted([others, small, big_est, big_measured], key=Remedy.rank_key)
    assert [r.title for r in ranked] == ["big measured", "big estimate", "small", "empty_cache"]

"""The arithmetic of explain on every message format oomkit parses (issue 16 items 8-9, issue 14
item 5): the context is a range, never a cause; shortage only when nothing else would do."""

from __future__ import annotations

import json

import pytest

from oomkit.core.allocator.oom_message import format_size as fmt
from oomkit.diagnose.diagnosis import Remedy, diagnose_oom_text
from oomkit.diagnose.oom_text import parse_oom_text
from oomkit.interfaces.reports.diagnosis import diagnosis_to_json
from oomkit.interfaces.reports.diagnosis_html import write_diagnosis_html

MiB = 2**20
GiB = 2**30
T_24 = 25_756_696_576  # an RTX 4090's total memory (23.99 GiB): matched in the catalog


def native(q, t, f, a, r, *, capacity="capacity", procs="", allowed=None, private=0):
    """A 2.2+ (or 2.1 ``capacty``) message from its figures, worded as CUDACachingAllocator.cpp."""
    allow = f"{fmt(allowed)} allowed; " if allowed is not None else ""
    priv = f"with {fmt(private)} allocated in private pools (e.g., CUDA Graphs), " if private else ""
    return (
        f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {fmt(q)}. GPU 0 has a "
        f"total {capacity} of {fmt(t)} of which {fmt(f)} is free. {procs}{allow}Of the allocated "
        f"memory {fmt(a + private)} is allocated by PyTorch, {priv}and {fmt(r - a - private)} is "
        "reserved by PyTorch but unallocated. If reserved but unallocated memory is large try "
        "setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
    )


def classic(q, t, f, a, r, *, word="reserved in total by PyTorch"):
    """A <= 2.0 message (``cached`` for <= 1.4)."""
    return (
        f"RuntimeError: CUDA out of memory. Tried to allocate {fmt(q)} (GPU 0; {fmt(t)} total "
        f"capacity; {fmt(a)} already allocated; {fmt(f)} free; {fmt(r)} {word})"
    )


def malloc_async(q, t, f, a):
    """A backend:cudaMallocAsync message (CUDAMallocAsyncAllocator.cpp mallocAsync)."""
    return (
        "Allocation on device 0 would exceed allowed memory. (out of memory)\n"
        f"Currently allocated     : {fmt(a)}\nRequested               : {fmt(q)}\n"
        f"Device limit            : {fmt(t)}\nFree (according to CUDA): {fmt(f)}\n"
        "PyTorch limit (set by user-supplied memory fraction)\n"
        f"                        : {fmt(t)}"
    )


FORMATS = {
    ">=2.2": lambda q, t, f, a, r: native(q, t, f, a, r),
    "2.1": lambda q, t, f, a, r: native(q, t, f, a, r, capacity="capacty"),
    "1.5-2.0": lambda q, t, f, a, r: classic(q, t, f, a, r),
    "<=1.4": lambda q, t, f, a, r: classic(q, t, f, a, r, word="cached"),
}


@pytest.mark.parametrize("version", sorted(FORMATS))
def test_a_process_holding_more_than_the_usable_figure_is_not_a_shortage(version):
    """Issue 16 item 9: 140 MiB outside the allocator is all the context there was; the cached
    1.5 GiB would have served the 1.5 GiB request: fragmentation, no shortage."""
    r = 23 * GiB + 512 * MiB
    f = 50 * MiB
    t = r + f + 140 * MiB
    text = FORMATS[version](1536 * MiB, t, f, 22 * GiB, r)
    parsed = parse_oom_text(text)
    assert parsed.torch_versions == version
    diagnosis = diagnose_oom_text(parsed)
    assert [c.cause for c in diagnosis.causes] == ["fragmentation"]
    assert diagnosis.remedies[0].title == "expandable segments"


@pytest.mark.parametrize("version", sorted(FORMATS))
def test_a_small_cache_and_a_shortage_lead_with_the_shortage(version):
    """Issue 14 item 5: 100 MiB cached cannot serve 2 GiB; the tensors are 1.5 GiB short."""
    t = T_24
    f = 400 * MiB
    r = t - f - 500 * MiB  # 500 MiB outside: an RTX 4090's lazy context, nothing else
    a = r - 100 * MiB
    diagnosis = diagnose_oom_text(parse_oom_text(FORMATS[version](2 * GiB, t, f, a, r)))
    assert diagnosis.cause == "shortage"
    assert "outside_pytorch" not in [c.cause for c in diagnosis.causes]
    shortfall = diagnosis.causes[0].evidence_bytes["shortfall_bytes"]
    # Q - F exactly: a 100 MiB cache (under 5% of reserved) is ordinary overhead, counted as
    # held (format_size rounds each figure to two decimals of its unit).
    assert abs(shortfall - (2 * GiB - 400 * MiB)) <= 3 * GiB // 200
    assert diagnosis.remedies[0].title == "reduce memory per step by at least the shortfall"


@pytest.mark.parametrize("version", [">=2.2", "2.1"])
def test_context_within_its_range_is_not_a_cause(version):
    """1.1 GiB outside the allocator on a 24 GB Ada card (lazy: up to 1.2 GiB) is the context."""
    t = T_24
    f = 300 * MiB
    r = t - f - 1100 * MiB
    diagnosis = diagnose_oom_text(parse_oom_text(FORMATS[version](GiB, t, f, r, r)))
    assert [c.cause for c in diagnosis.causes] == ["shortage"]
    assert "(256.00 MiB-1.20 GiB) on RTX 4090, lazy" in diagnosis.memory_explained


def test_eager_era_message_allows_an_eager_context():
    """A <= 1.4 message (CUDA <= 10.2: eager) with 1.5 GiB outside is still only the context."""
    t = T_24
    f = 300 * MiB
    r = t - f - 1536 * MiB
    text = classic(GiB, t, f, r, r, word="cached")
    assert [c.cause for c in diagnose_oom_text(parse_oom_text(text)).causes] == ["shortage"]
    # The same figures in a 2.2+ message (lazy only) name the memory outside PyTorch.
    modern = diagnose_oom_text(parse_oom_text(native(GiB, t, f, r, r)))
    assert "outside_pytorch" in [c.cause for c in modern.causes]


def test_other_processes_named_from_nvml_sentences():
    """NVML's sentences: this process's own non-PyTorch memory is its context; others' 6 GiB is
    the cause, and freeing it alone would have let the 3 GiB request succeed."""
    t = T_24
    f = 200 * MiB
    own_outside = 600 * MiB
    others = 6 * GiB
    r = t - f - own_outside - others
    procs = (
        f"Including non-PyTorch memory, this process has {fmt(r + own_outside)} memory in use. "
        f"Process 4242 has {fmt(others)} memory in use. "
    )
    diagnosis = diagnose_oom_text(parse_oom_text(native(3 * GiB, t, f, r, r, procs=procs)))
    assert diagnosis.cause == "outside_pytorch"
    finding = diagnosis.causes[0]
    assert finding.evidence_bytes["other_processes_bytes"] == others
    assert diagnosis.remedies[0].title == "free the memory held outside PyTorch"


def test_private_pools_count_as_held():
    """Free cached blocks of private pools (CUDA graphs) cannot serve the request."""
    t = T_24
    f = 100 * MiB
    r = t - f - 400 * MiB
    a = r - 3 * GiB
    text = native(GiB, t, f, a, r, private=3 * GiB)
    parsed = parse_oom_text(text)
    assert parsed.reserved_unallocated_bytes is not None
    assert abs(parsed.reserved_unallocated_bytes) <= GiB // 100
    assert diagnose_oom_text(parsed).cause == "shortage"


def test_cuda_malloc_async_arithmetic():
    """cudaMallocAsync: no cache to blame; 600 MiB outside is the context; a shortage."""
    diagnosis = diagnose_oom_text(
        parse_oom_text(malloc_async(GiB, 8 * GiB, 400 * MiB, 8 * GiB - 1000 * MiB))
    )
    assert [c.cause for c in diagnosis.causes] == ["shortage"]
    shortfall = diagnosis.causes[0].evidence_bytes["shortfall_bytes"]
    assert abs(shortfall - (GiB - 400 * MiB)) <= GiB // 100


def _plain_shortage():
    t = 8 * GiB
    f = 200 * MiB
    r = t - f - 400 * MiB
    return parse_oom_text(native(GiB, t, f, r - 50 * MiB, r))


def test_a_remedy_that_saves_nothing_is_never_first_nor_lowers_the_peak(tmp_path):
    """Issue 16 item 8: on a plain shortage the empty_cache advice ranks last, in the terminal
    order, in JSON (lowers_peak false) and in the HTML's Try first."""
    parsed = _plain_shortage()
    diagnosis = diagnose_oom_text(parsed)
    assert diagnosis.cause == "shortage"
    titles = [r.title for r in diagnosis.remedies]
    assert titles[0] == "reduce memory per step by at least the shortfall"
    assert titles[-1] == "do not rely on torch.cuda.empty_cache()"
    remedies = json.loads(json.dumps(diagnosis_to_json(diagnosis, parsed)))["remedies"]
    nothing = [r for r in remedies if r["saving_bytes"] == 0]
    assert nothing and all(r["lowers_peak"] is False for r in nothing)
    html = tmp_path / "d.html"
    write_diagnosis_html(str(html), diagnosis, source="-")
    page = html.read_text()
    assert "Try first: reduce memory per step" in page
    assert "Try first: do not rely" not in page


def test_zero_saving_remedy_is_coerced_and_ranked_after_unknown():
    """Remedy(saving_bytes=0) never lowers the peak and ranks after an unknown saving."""
    zero = Remedy("nothing", 0, "high", "", "", estimate=False)
    unknown = Remedy("unknown", None, "low", "", "")
    assert zero.lowers_peak is False
    assert sorted([zero, unknown], key=Remedy.rank_key) == [unknown, zero]

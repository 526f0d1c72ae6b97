"""Leak and fragmentation detection on synthetic per-step series and traces (exact numbers)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oomkit.core.trace import Frame, TraceEvent
from oomkit.diagnose._trend import bin_minima, trend
from oomkit.diagnose.memory_health import (
    MIN_LEAK_BYTES,
    FragmentationFinding,
    LeakFinding,
    LeakSite,
    MemorySample,
    SiteUsage,
    attribute_leak,
    detect_fragmentation,
    detect_leak,
    detect_warmup_steps,
    diff_live_sites,
    explain_leak,
    live_by_site,
    memory_findings,
    samples_from_records,
)
from oomkit.errors import MemoryHealthError, OomkitError

KiB = 2**10
MiB = 2**20
GiB = 2**30
BASE = 500 * MiB


def _series(values: list[int], **extra: list) -> list[MemorySample]:
    out = []
    for i, v in enumerate(values):
        fields = {k: vs[i] for k, vs in extra.items()}
        out.append(MemorySample(step=i, allocated_bytes=v, reserved_bytes=2 * GiB, **fields))
    return out


# ----------------------------------------------------------------------------- trend statistics


def test_trend_of_a_line_is_exact() -> None:
    """A strictly rising line: slope exact, S = n(n-1)/2, z = (S-1)/sqrt(n(n-1)(2n+5)/18)."""
    t = trend(list(range(10)), [100 + 7 * i for i in range(10)])
    assert t.slope_per_x == 7.0
    assert t.mann_kendall_s == 45
    assert t.kendall_tau == 1.0
    assert t.mann_kendall_z == pytest.approx(44 / math.sqrt(125))


def test_trend_corrects_variance_for_ties() -> None:
    """Ties shrink the variance: [0,0,1,1,2,2] has S = 12 and variance (6*5*17 - 3*2*1*9)/18."""
    t = trend(list(range(6)), [0, 0, 1, 1, 2, 2])
    assert t.mann_kendall_s == 12
    assert t.mann_kendall_z == pytest.approx(11 / math.sqrt((510 - 54) / 18))
    assert t.slope_per_x == 0.5


def test_trend_of_constant_series_is_flat() -> None:
    """A constant series has slope 0 and z 0 (no division by a zero variance)."""
    t = trend([0, 1, 2, 3], [5, 5, 5, 5])
    assert (t.slope_per_x, t.mann_kendall_s, t.mann_kendall_z) == (0.0, 0, 0.0)


def test_bin_minima_keeps_each_bins_minimum() -> None:
    """Six points in three bins: the first x of each bin and its lowest value."""
    assert bin_minima([0, 1, 2, 3, 4, 5], [9, 4, 7, 8, 1, 3], 3) == ([0, 2, 4], [4, 7, 1])
    assert bin_minima([0, 1], [5, 6], 3) == ([0, 1], [5, 6])


def test_long_series_trend_is_binned() -> None:
    """A 1000-step line is reduced to 256 bins of minima; the slope stays exact."""
    t = trend(list(range(1000)), [3 * i for i in range(1000)])
    assert t.points == 256
    assert t.slope_per_x == pytest.approx(3.0, rel=0.01)


# ----------------------------------------------------------------------------- warm-up


def test_warmup_is_at_least_two_steps() -> None:
    """A flat series still skips two samples (the first optimizer step and the one after)."""
    assert detect_warmup_steps([BASE] * 20) == 2


def test_warmup_extends_over_early_jumps() -> None:
    """Jumps of 500, 400, 100 bytes into samples 1-3 against flat later steps: 4 skipped."""
    values = [0, 500, 900, 1000] + [1000] * 20
    assert detect_warmup_steps(values) == 4


def test_warmup_stops_within_the_first_third() -> None:
    """Big jumps into every sample of the first third: the warm-up stops there (8 of 24)."""
    values = [i * 100_000 for i in range(9)] + [800_000 + i * 1000 for i in range(1, 16)]
    assert len(values) == 24
    assert detect_warmup_steps(values) == 8


# ----------------------------------------------------------------------------- detect_leak


def test_steady_leak_exact_numbers() -> None:
    """1 MiB per step over 20 steps: slope, total, window, start/end and tau are exact."""
    samples = _series([BASE + i * MiB for i in range(20)])
    finding = detect_leak(samples)
    assert isinstance(finding, LeakFinding)
    assert finding.growth_bytes_per_step == MiB
    assert finding.warmup_steps == 2
    assert (finding.first_step, finding.last_step) == (2, 19)
    assert finding.total_growth_bytes == 17 * MiB
    assert finding.start_allocated_bytes == BASE + 2 * MiB
    assert finding.end_allocated_bytes == BASE + 19 * MiB
    assert finding.peak_bytes == BASE + 19 * MiB
    assert finding.kendall_tau == 1.0
    assert finding.late_growth_bytes_per_step == MiB
    assert "grows by 1.00 MiB per step" in finding.summary


def test_leak_after_optimizer_warmup_jump() -> None:
    """A 300 MiB jump at step 1 (Adam state) is skipped; the 2 MiB/step leak after it is found."""
    values = [BASE] + [BASE + 300 * MiB + i * 2 * MiB for i in range(1, 20)]
    finding = detect_leak(_series(values))
    assert finding is not None
    assert finding.growth_bytes_per_step == 2 * MiB


def test_warmup_jump_alone_is_not_a_leak() -> None:
    """One jump at the first optimizer step, then flat: no leak."""
    assert detect_leak(_series([BASE] + [BASE + 300 * MiB] * 19)) is None


def test_noisy_leak_is_found_with_robust_slope() -> None:
    """1 MiB/step under +-3 MiB alternating noise and one 200 MiB spike: slope stays 1 MiB."""
    noise = [3 * MiB if i % 2 else -3 * MiB for i in range(40)]
    values = [BASE + i * MiB + noise[i] for i in range(40)]
    values[25] += 200 * MiB
    finding = detect_leak(_series(values))
    assert finding is not None
    assert finding.growth_bytes_per_step == MiB


def test_noise_without_trend_is_not_a_leak() -> None:
    """A repeating noise pattern (batch sizes 1-7 MiB apart) has no trend: not flagged."""
    pattern = [0, 5, 2, 7, 1, 6, 3]
    values = [BASE + pattern[i % 7] * MiB for i in range(42)]
    assert detect_leak(_series(values)) is None


def test_growth_that_levels_off_is_not_a_leak() -> None:
    """A cache filling for 10 steps, then level for 10 (second-half slope 0): not flagged."""
    values = [BASE + min(i, 10) * 4 * MiB for i in range(24)]
    assert detect_leak(_series(values), warmup_steps=2) is None


def test_small_growth_is_not_reported() -> None:
    """512 bytes per step (a scalar kept each step) is below MIN_LEAK_BYTES: not flagged."""
    assert detect_leak(_series([BASE + 512 * i for i in range(50)])) is None
    finding = detect_leak(
        _series([BASE + 512 * i for i in range(50)]), min_growth_bytes=0, min_growth_pct=0
    )
    assert finding is not None and finding.total_growth_bytes == 512 * 47


def test_growth_below_percent_of_peak_is_not_reported() -> None:
    """2 MiB total on a 40 GiB peak is under 1% of the peak: not flagged; at 0% it is."""
    values = [40 * GiB + i * (MiB // 8) for i in range(18)]
    assert detect_leak(_series(values)) is None
    assert detect_leak(_series(values), min_growth_pct=0) is not None


def test_too_few_steps_after_warmup() -> None:
    """Seven samples with warm-up 2 leave five: fewer than six, no verdict."""
    assert detect_leak(_series([BASE + i * 10 * MiB for i in range(7)])) is None
    assert detect_leak(_series([BASE + i * 10 * MiB for i in range(8)])) is not None


def test_falling_memory_is_not_a_leak() -> None:
    """Memory released step by step is not flagged."""
    assert detect_leak(_series([BASE - i * MiB for i in range(20)])) is None


def test_explicit_warmup_is_used() -> None:
    """warmup_steps=5 starts the window at step 5."""
    finding = detect_leak(_series([BASE + i * MiB for i in range(20)]), warmup_steps=5)
    assert finding is not None and finding.first_step == 5 and finding.warmup_steps == 5


def test_peak_counts_recorded_peaks() -> None:
    """peak_bytes is the highest of allocated and the recorded per-step peaks."""
    samples = _series(
        [BASE + i * 3 * MiB for i in range(10)],
        peak_allocated_bytes=[BASE + 900 * MiB] + [None] * 9,
    )
    finding = detect_leak(samples)
    assert finding is not None and finding.peak_bytes == BASE + 900 * MiB


def test_bad_input_raises() -> None:
    """Steps that do not increase and a negative warm-up raise MemoryHealthError (an OomkitError)."""
    samples = [MemorySample(3, 1, 1), MemorySample(3, 2, 2)]
    with pytest.raises(MemoryHealthError, match="increasing steps"):
        detect_leak(samples)
    with pytest.raises(OomkitError, match="warmup_steps must be 0 or more"):
        detect_leak(_series([1, 2, 3]), warmup_steps=-1)


@settings(max_examples=60, deadline=None)
@given(
    slope=st.integers(min_value=MIN_LEAK_BYTES // 8, max_value=64 * MiB),
    start=st.integers(min_value=0, max_value=10 * GiB),
    n=st.integers(min_value=12, max_value=80),
)
def test_linear_leak_slope_is_exact(slope: int, start: int, n: int) -> None:
    """Any steady growth of >= 128 KiB/step over 12+ steps is flagged with its exact slope."""
    finding = detect_leak(_series([start + i * slope for i in range(n)]), min_growth_pct=0)
    assert finding is not None
    assert finding.growth_bytes_per_step == slope


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.integers(min_value=0, max_value=GiB), min_size=8, max_size=60))
def test_non_increasing_series_never_flagged(values: list[int]) -> None:
    """A series that never rises is never a leak, whatever its values."""
    values.sort(reverse=True)
    assert detect_leak(_series(values)) is None


# ----------------------------------------------------------------------------- records


def test_samples_from_monitor_records() -> None:
    """StepRecord-like objects convert by attribute name; missing optional fields become None."""
    records = [
        SimpleNamespace(
            step=0,
            allocated_bytes=10,
            reserved_bytes=20,
            inactive_split_bytes=3,
            num_alloc_retries=1,
            time_s=0.5,
        ),
        SimpleNamespace(step=1, allocated_bytes=11, reserved_bytes=20),
    ]
    samples = samples_from_records(records)
    assert samples[0] == MemorySample(0, 10, 20, inactive_split_bytes=3, num_alloc_retries=1)
    assert samples[1] == MemorySample(1, 11, 20)


def test_samples_from_records_without_fields_raises() -> None:
    """A record without allocated_bytes raises a MemoryHealthError saying what to pass."""
    with pytest.raises(MemoryHealthError, match="allocated_bytes"):
        samples_from_records([SimpleNamespace(step=0, reserved_bytes=1)])


# ----------------------------------------------------------------------------- attribution


def _alloc(aid: int, size: int, where: tuple[str, int, str]) -> TraceEvent:
    return TraceEvent("alloc", aid, size, 0, None, (Frame(*where),))


def _free(aid: int, size: int) -> TraceEvent:
    return TraceEvent("free_requested", aid, size, 0, None, ())


LEAKY = ("/home/u/train.py", 42, "train")
TEMP = ("/home/u/train.py", 40, "train")
INTERNAL = ("/site/torch/nn/functional.py", 10, "linear")


def _leaky_trace(steps: int) -> list[list[TraceEvent]]:
    """Per step: a kept 1000-byte tensor from line 42, a 3 MiB temporary from line 40."""
    out = []
    for s in range(steps):
        kept, temp = 2 * s + 1, 2 * s + 2
        out.append(
            [
                _alloc(temp, 3 * MiB, TEMP),
                _alloc(kept, 1000, LEAKY),
                _free(temp, 3 * MiB),
            ]
        )
    return out


def test_attribute_leak_names_the_growing_site() -> None:
    """Only line 42 grows: one 1024-byte block (1000 rounded to 512s) per step."""
    sites = attribute_leak(_leaky_trace(12))
    assert len(sites) == 1
    site = sites[0]
    assert (site.filename, site.line, site.function) == LEAKY
    assert site.growth_bytes_per_step == 1024
    assert site.growth_bytes == 9 * 1024  # steps 2..11 after the 2-step warm-up
    assert site.growth_count == 9
    assert site.live_bytes == 12 * 1024
    assert site.typical_size_bytes == 1024
    assert site.steps == 10
    assert site.label == "/home/u/train.py:42 in train"


def test_attribute_leak_uses_innermost_user_frame() -> None:
    """Frames inside torch are skipped: the site is the first user frame."""
    steps = [
        [TraceEvent("alloc", s + 1, 4096, 0, None, (Frame(*INTERNAL), Frame(*LEAKY)))]
        for s in range(10)
    ]
    sites = attribute_leak(steps, warmup_steps=0)
    assert [(s.filename, s.line) for s in sites] == [(LEAKY[0], LEAKY[1])]
    assert sites[0].growth_bytes == 9 * 4096


def test_attribute_leak_ignores_steady_sites() -> None:
    """A site that frees what it allocates each step is never named."""
    steps = [[_alloc(s + 1, MiB, TEMP), _free(s + 1, MiB)] for s in range(10)]
    assert attribute_leak(steps) == []


def test_attribute_leak_negative_warmup_raises() -> None:
    """A negative warm-up is refused with the fix in the message."""
    with pytest.raises(MemoryHealthError, match="Example: warmup_steps=2"):
        attribute_leak([], warmup_steps=-3)


def test_live_by_site_and_diff() -> None:
    """Two moments of the same trace: the diff gains 3 blocks of 1024 bytes at line 42."""
    trace = _leaky_trace(5)
    before = live_by_site([ev for step in trace[:2] for ev in step])
    after = live_by_site([ev for step in trace for ev in step])
    key = LEAKY
    assert before[key] == SiteUsage(2048, 2)
    assert after[key] == SiteUsage(5120, 5)
    assert diff_live_sites(before, after) == [(key, 3072, 3)]


# ----------------------------------------------------------------------------- explain_leak


def _site(
    line_text: str,
    *,
    function: str = "train",
    size: int = 128 * KiB,
    nearby: dict[int, str] | None = None,
) -> tuple[LeakSite, object]:
    site = LeakSite("/u/t.py", 50, function, size, 10 * size, 10, 12 * size, size, 12)
    lines = {50: line_text, **(nearby or {})}
    return site, lambda filename, line: lines.get(line, "") + "\n"


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("    total_loss += loss", "loss_accumulated"),
        ("    val_loss = val_loss + F.cross_entropy(out, y)", "loss_accumulated"),
        ("    outputs.append(model(x))", "kept_in_list"),
        ("    CACHE[key] = encoder(x)", "stored_in_container"),
        ("    self.cache.setdefault(k, emb(x))", "stored_in_container"),
        ("    y = model(x)", "unknown"),
    ],
)
def test_explain_leak_by_source_line(text: str, kind: str) -> None:
    """The source line names the likely cause; anything else is unknown."""
    site, get_line = _site(text)
    cause = explain_leak(site, get_line=get_line)
    assert cause.kind == kind
    if kind != "unknown":
        assert cause.description.startswith("Likely cause: ")


def test_explain_leak_retain_graph_needs_the_flag_nearby() -> None:
    """State fed back into itself is blamed on retain_graph only when retain_graph=True is near."""
    site, get_line = _site(
        "    h = 0.9 * h + enc(x)", nearby={53: "    loss.backward(retain_graph=True)"}
    )
    cause = explain_leak(site, get_line=get_line)
    assert cause.kind == "retain_graph"
    assert "line 53" in cause.description
    site, get_line = _site("    h = 0.9 * h + enc(x)")
    assert explain_leak(site, get_line=get_line).kind == "unknown"


def test_explain_leak_hook_by_function_name() -> None:
    """An allocation inside a function named like a hook: a hook that stores tensors."""
    site, get_line = _site("    store.append(out.clone())", function="save_hook")
    assert explain_leak(site, get_line=get_line).kind == "hook_stores_tensors"


def test_explain_leak_small_blocks_without_source() -> None:
    """No source line, 512-byte blocks gained one per step: likely a scalar loss kept."""
    site, get_line = _site("", size=512)
    cause = explain_leak(site, get_line=get_line)
    assert cause.kind == "loss_accumulated"
    assert "10 small allocations (512 bytes each)" in cause.evidence


# ----------------------------------------------------------------------------- fragmentation


def _frag_samples(n: int = 10, **over: list) -> list[MemorySample]:
    fields = {
        "peak_allocated_bytes": [6 * GiB] * n,
        "peak_reserved_bytes": [7 * GiB] * n,
        "inactive_split_bytes": [100 * MiB] * n,
        "num_alloc_retries": [0] * n,
        "largest_free_block_bytes": [GiB] * n,
    }
    fields.update(over)
    return [
        MemorySample(i, 5 * GiB, 7 * GiB, **{k: v[i] for k, v in fields.items()}) for i in range(n)
    ]


def test_healthy_cache_is_not_flagged() -> None:
    """1 GiB unused of 7 GiB (14%), flat split blocks, no retries, steady free block: None."""
    assert detect_fragmentation(_frag_samples()) is None


def test_reserved_unused_exact() -> None:
    """Peak reserved 8 GiB over peak allocated 5 GiB: 3 GiB (37.5%) unused is flagged."""
    finding = detect_fragmentation(
        _frag_samples(peak_allocated_bytes=[5 * GiB] * 10, peak_reserved_bytes=[8 * GiB] * 10)
    )
    assert isinstance(finding, FragmentationFinding)
    assert finding.signals == ("reserved_unused",)
    assert finding.unused_bytes == 3 * GiB
    assert finding.unused_pct == 37.5
    assert finding.recommendations[0].startswith("PYTORCH_CUDA_ALLOC_CONF=expandable_segments")
    assert "3.00 GiB (38%) of reserved memory is unused" in finding.summary


def test_inactive_split_growth_and_retries() -> None:
    """Split free blocks growing 64 MiB/step and 3 retries: both signals with exact numbers."""
    finding = detect_fragmentation(
        _frag_samples(
            inactive_split_bytes=[i * 64 * MiB for i in range(10)],
            num_alloc_retries=[0] * 7 + [1, 2, 3],
        )
    )
    assert finding is not None
    assert finding.signals == ("inactive_split_growth", "alloc_retries")
    assert finding.inactive_split_growth_bytes_per_step == 64 * MiB
    assert finding.inactive_split_bytes == 576 * MiB
    assert finding.alloc_retries == 3
    assert any("retries flush the cache" in r for r in finding.recommendations)


def test_largest_free_block_shrinking() -> None:
    """The largest free block falling from 1 GiB to 100 MiB is flagged with both ends."""
    sizes = [GiB - i * 100 * MiB for i in range(10)]
    finding = detect_fragmentation(_frag_samples(largest_free_block_bytes=sizes))
    assert finding is not None
    assert finding.signals == ("largest_free_shrinking",)
    assert (finding.largest_free_first_bytes, finding.largest_free_last_bytes) == (
        GiB,
        GiB - 900 * MiB,
    )


def _growing_requests_trace() -> list[TraceEvent]:
    """Requests of 11, 12, ... 39 MiB, each freed after the next: every one needs a new segment."""
    events: list[TraceEvent] = []
    previous = None
    for i in range(1, 30):
        aid = 2 * i
        events.append(TraceEvent("alloc", aid, (10 + i) * MiB + 1, 0, None, ()))
        events.append(TraceEvent("alloc", aid + 1, 512, 0, None, ()))
        if previous is not None:
            events.append(TraceEvent("free_requested", previous, 0, 0, None, ()))
            events.append(TraceEvent("free_completed", previous, 0, 0, None, ()))
        previous = aid
    return events


def test_fragmentation_priced_on_recorded_history() -> None:
    """With the history, settings are replayed: expandable segments reserve 122 MiB, not 770."""
    samples = _frag_samples(
        peak_allocated_bytes=[78 * MiB] * 10, peak_reserved_bytes=[770 * MiB] * 10
    )
    finding = detect_fragmentation(
        samples, events=_growing_requests_trace(), capacity_bytes=8 * GiB
    )
    assert finding is not None and finding.tuning is not None
    assert finding.tuning.baseline.peak_reserved_bytes == 807403520
    assert finding.tuning.best is not None
    assert finding.tuning.best.alloc_conf == "expandable_segments:True"
    assert finding.tuning.best.peak_reserved_bytes == 127926272
    assert finding.recommendations[0].startswith(
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: peak reserved 122.00 MiB instead of "
        "770.00 MiB"
    )


def test_memory_findings_orders_leak_then_fragmentation() -> None:
    """A leaking, fragmenting run gives [LeakFinding, FragmentationFinding]; a healthy one []."""
    n = 12
    records = [
        SimpleNamespace(
            step=i,
            allocated_bytes=BASE + i * 8 * MiB,
            reserved_bytes=4 * GiB,
            peak_allocated_bytes=BASE + i * 8 * MiB,
            peak_reserved_bytes=4 * GiB,
            num_alloc_retries=i,
        )
        for i in range(n)
    ]
    findings = memory_findings(records)
    assert [type(f) for f in findings] == [LeakFinding, FragmentationFinding]
    assert findings[0].growth_bytes_per_step == 8 * MiB
    assert memory_findings(_frag_samples()) == []


def test_explain_leak_growing_tensor() -> None:
    """Bytes grow while the allocation count does not: a growing tensor, not an accumulation."""
    site = LeakSite("/u/t.py", 7, "train", MiB, 9 * MiB, 0, 20 * MiB, 20 * MiB, 10)
    cause = explain_leak(site, get_line=lambda filename, line: "    x = batch['ids']\n")
    assert cause.kind == "growing_tensor"
    assert cause.evidence == f"{9 * MiB} more bytes over 10 steps without more allocations"

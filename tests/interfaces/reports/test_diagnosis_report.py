"""The terminal diagnosis report's remedy lines: what is saved, and what only frees memory."""

from __future__ import annotations

from oomkit.diagnose.diagnosis import Remedy
from oomkit.interfaces.reports.diagnosis import REMEDIES_HEADING, remedy_headline, remedy_saving

GiB = 2**30


def test_a_remedy_that_lowers_the_peak_saves_bytes_estimates_marked():
    """Replay-priced: 'saves 1.50 GiB'; estimated: 'saves ~1.50 GiB'; unknown says so."""
    priced = Remedy("expandable segments", 3 * GiB // 2, "medium", "", "", estimate=False)
    estimated = Remedy("activation checkpointing", 3 * GiB // 2, "low", "", "")
    unknown = Remedy("smaller batch", None, "low", "", "")
    assert remedy_saving(priced) == "saves 1.50 GiB"
    assert remedy_saving(estimated) == "saves ~1.50 GiB"
    assert remedy_saving(unknown) == "saves unknown"
    assert remedy_saving(Remedy("do not rely on empty_cache()", 0, "high", "", "")) == "saves nothing"
    assert (
        remedy_headline(2, priced) == "2. expandable segments — saves 1.50 GiB (medium confidence)"
    )


def test_empty_cache_is_not_said_to_save_this_process_memory():
    """A remedy whose bytes go to other processes says so instead of 'saves'."""
    release = Remedy(
        "release cached memory for other processes",
        7 * GiB,
        "high",
        "",
        "",
        estimate=False,
        lowers_peak=False,
    )
    assert remedy_saving(release) == "frees 7.00 GiB; this process's peak stays"
    assert "what lowers the peak first" in REMEDIES_HEADING


def test_a_remedys_json_carries_the_measured_fields_in_measured_remedys_order():
    """A plain remedy's JSON ends with fits, peak_reserved_bytes and flag (None), the fields
    MeasuredRemedy adds, in its order; a measured one's keep their values; the headline says
    whether a measured remedy fits."""
    from dataclasses import fields

    from oomkit.diagnose.measured_remedy import MeasuredRemedy
    from oomkit.interfaces.reports.diagnosis import remedy_to_json

    base = {f.name for f in fields(Remedy)}
    added = [f.name for f in fields(MeasuredRemedy) if f.name not in base]
    plain = Remedy("expandable segments", 2**30, "medium", "x = 1", "why")
    out = remedy_to_json(plain)
    assert list(out)[-3:] == added == ["fits", "peak_reserved_bytes", "flag"]
    assert [out[k] for k in added] == [None, None, None]
    measured = MeasuredRemedy("bf16", 2**30, "high", "x = 1", "why", fits=True,
                              peak_reserved_bytes=5 * 2**30, flag="--precision bf16-mixed")
    assert {k: remedy_to_json(measured)[k] for k in added} == {
        "fits": True, "peak_reserved_bytes": 5 * 2**30, "flag": "--precision bf16-mixed"}
    assert remedy_headline(1, measured).endswith(", fits (high confidence)")
    assert ", fits" not in remedy_headline(1, plain)
    still = MeasuredRemedy("sgd", 2**30, "high", "x = 1", "why", fits=False)
    assert ", still does not fit (high confidence)" in remedy_headline(2, still)

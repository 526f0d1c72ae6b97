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

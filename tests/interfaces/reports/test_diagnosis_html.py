"""`oomkit explain --html`: the diagnosis page, parsed and rendered in headless Chromium."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oomkit.core.snapshot import snapshot_from_data
from oomkit.diagnose.diagnosis import diagnose_oom_text
from oomkit.diagnose.oom_text import parse_oom_text
from oomkit.diagnose.snapshot_diagnosis import diagnose_snapshot
from oomkit.interfaces.reports.diagnosis_html import (
    diagnosis_html,
    segment_runs,
    snapshot_timeline,
    write_diagnosis_html,
)
from oomkit.interfaces.reports.html import BlockRun
from oomkit.runtime.simulated import SimulatedCudaDevice

MiB = 2**20
TEXT = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
    "capacity of 23.65 GiB of which 1.20 GiB is free. Of the allocated memory 17.00 GiB is "
    "allocated by PyTorch, and 5.00 GiB is reserved by PyTorch but unallocated."
)


@pytest.fixture(scope="module")
def oom_snapshot():
    """Four 200 MiB tensors on a 1 GiB device, one replaced by 150 MiB, then 300 MiB refused."""
    device = SimulatedCudaDevice("1GiB", context_overhead_bytes=0, record_history=True)
    with device:
        a, b, c, d = (torch.empty(200 * MiB, dtype=torch.uint8) for _ in range(4))
        del a
        x = torch.empty(150 * MiB, dtype=torch.uint8)  # splits the cached 200 MiB block
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(300 * MiB, dtype=torch.uint8)
        snapshot = snapshot_from_data(device.snapshot())
        del b, c, d, x
    return snapshot


def test_segment_runs_merge_blocks(oom_snapshot):
    """Segments in address order; the split segment shows its 50 MiB free tail."""
    runs = segment_runs(oom_snapshot.segments_for(0))
    assert sorted(runs, key=lambda r: (r.state, r.size_bytes)) == sorted(
        [
            BlockRun(runs[0].segment, 150 * MiB, "allocated"),
            BlockRun(runs[0].segment, 50 * MiB, "free"),
            *(
                BlockRun(r.segment, 200 * MiB, "allocated")
                for r in runs
                if r.size_bytes == 200 * MiB
            ),
        ],
        key=lambda r: (r.state, r.size_bytes),
    )
    assert sum(r.size_bytes for r in runs) == 800 * MiB


def test_snapshot_timeline_levels(oom_snapshot):
    """The timeline ends at the OOM's levels and never loses the peak when points merge."""
    full = snapshot_timeline(oom_snapshot)
    assert (full[-1].allocated_bytes, full[-1].reserved_bytes) == (750 * MiB, 800 * MiB)
    assert max(p.allocated_bytes for p in full) == 800 * MiB
    merged = snapshot_timeline(oom_snapshot, max_points=3)
    assert len(merged) == 3
    assert max(p.allocated_bytes for p in merged) == 800 * MiB
    assert merged[-1].event_index == len(oom_snapshot.trace_for(0)) - 1


def test_snapshot_page_sections(oom_snapshot, tmp_path, parse_html):
    """Verdict, causes, remedies with code, timeline and segment map; nothing loads remotely."""
    diagnosis = diagnose_snapshot(oom_snapshot)
    path = write_diagnosis_html(
        tmp_path / "oom.html", diagnosis, snapshot=oom_snapshot, source="oom.pickle"
    )
    html = path.read_text()
    page = parse_html(html)
    ids = [a["id"] for a in page.of("section")]
    assert ids[:4] == ["verdict", "causes", "remedies", "memory"]
    assert {"timeline", "segments", "attribution"} <= set(ids)
    assert len(page.of("pre")) == len(diagnosis.remedies) >= 1
    assert [p["data-name"] for p in page.of("path")] == ["allocated", "reserved"]
    assert {r["data-state"] for r in page.of("rect") if "data-state" in r} == {"allocated", "free"}
    assert "largest free block 50.00 MiB" in "".join(page.text)
    assert all(
        not re.match(r"https?:", value or "") for _, attrs in page.tags for value in attrs.values()
    )
    assert page.of("script") == [] and page.of("link") == [] and page.of("img") == []


def test_text_page_has_no_plots(parse_html):
    """An error text's diagnosis: the same sections, no timeline and no segment map."""
    diagnosis = diagnose_oom_text(parse_oom_text(TEXT))
    page = parse_html(diagnosis_html(diagnosis))
    ids = [a["id"] for a in page.of("section")]
    assert "timeline" not in ids and "segments" not in ids
    assert page.of("svg") == []
    assert "Cause: fragmentation of PyTorch's cache" in "".join(page.text)


def test_page_loads_in_chromium(chromium, oom_snapshot, tmp_path, parse_html):
    """Headless Chromium loads the page and its DOM holds the verdict and both plots."""
    diagnosis = diagnose_snapshot(oom_snapshot)
    path = write_diagnosis_html(tmp_path / "oom.html", diagnosis, snapshot=oom_snapshot)
    done = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", path.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    dom = parse_html(done.stdout)
    assert [a["id"] for a in dom.of("section")][:3] == ["verdict", "causes", "remedies"]
    assert len(dom.of("svg")) == 2
    assert [p["data-name"] for p in dom.of("path")] == ["allocated", "reserved"]
    assert len([r for r in dom.of("rect") if "data-state" in r]) >= 4
    assert "Cause:" in "".join(dom.text)


def test_explain_html_flag(oom_snapshot, tmp_path, capsys, parse_html):
    """`oomkit explain SNAPSHOT --html FILE` writes the page beside the terminal report."""
    from oomkit.core.snapshot import write_snapshot
    from oomkit.interfaces.cli import main

    snap = write_snapshot(
        tmp_path / "oom.pickle",
        oom_snapshot.segments,
        oom_snapshot.device_traces,
        oom_snapshot.allocator_settings,
    )
    out = tmp_path / "report.html"
    assert main(["explain", str(snap), "--html", str(out)]) == 0
    assert capsys.readouterr().out.startswith("Cause:")
    page = parse_html(out.read_text())
    assert {"verdict", "timeline", "segments"} <= {a["id"] for a in page.of("section")}
    assert f"oomkit explain {snap}" in "".join(page.text)
    text_out = tmp_path / "text.html"
    assert main(["explain", TEXT, "--html", str(text_out), "--json"]) == 0
    text_ids = {a["id"] for a in parse_html(text_out.read_text()).of("section")}
    assert "verdict" in text_ids and "timeline" not in text_ids


def test_timeline_marker_says_oom_only_where_one_was_recorded(oom_snapshot):
    """The marker reads "OOM" at a recorded OOM and "peak" on a snapshot that has none."""
    oom_page = diagnosis_html(diagnose_snapshot(oom_snapshot), snapshot=oom_snapshot)
    assert ">OOM</text>" in oom_page
    device = SimulatedCudaDevice("1GiB", context_overhead_bytes=0, record_history=True)
    with device:
        a = torch.empty(200 * MiB, dtype=torch.uint8)
        del a
        b = torch.empty(100 * MiB, dtype=torch.uint8)
        calm = snapshot_from_data(device.snapshot())
        del b
    calm_page = diagnosis_html(diagnose_snapshot(calm), snapshot=calm)
    assert ">OOM</text>" not in calm_page
    assert ">peak</text>" in calm_page


def test_saved_prediction_page_has_its_timeline(parse_html):
    """A saved prediction's page plots its timeline with the OOM marked and the usable limit."""
    sys.path.insert(0, str(Path(__file__).parents[2] / "diagnose"))  # the labelled cases
    from cases.prediction import PREDICTION

    from oomkit.diagnose.prediction_diagnosis import diagnose_prediction

    data = {
        **PREDICTION,
        "timeline": [
            {"event_index": 10, "step": 0, "allocated_bytes": 2**30, "reserved_bytes": 2**31,
             "by_category_bytes": {"parameter": 2**29, "activation": 2**29}},
            {"event_index": 385, "step": 0, "allocated_bytes": 3 * 2**30, "reserved_bytes": 3 * 2**30,
             "by_category_bytes": {"activation": 5 * 2**29, "parameter": 2**29}},
        ],
    }
    diagnosis = diagnose_prediction(data, measure=False)
    html = diagnosis_html(diagnosis, prediction=data)
    page = parse_html(html)
    assert "timeline" in [a["id"] for a in page.of("section")]
    names = [p["data-name"] for p in page.of("path")]
    assert names == ["allocated", "reserved", "activation", "parameter"]
    assert ">OOM</text>" in html
    broken = diagnosis_html(diagnosis, prediction={**data, "timeline": [{"event_index": 1}]})
    assert 'id="timeline"' not in broken

"""oomkit diff's HTML page: the parts bar and the timelines, parsed and in a real browser."""

from __future__ import annotations

import subprocess

from oomkit.core.snapshot import load_snapshot
from oomkit.core.snapshot.writer import write_snapshot
from oomkit.core.trace import TraceEvent
from oomkit.diagnose.run_diff import diff_runs, run_memory_from_snapshot
from oomkit.interfaces.cli import main
from oomkit.interfaces.reports.diff import diff_html

MiB = 2**20


def _tiny_snapshot(path, size):
    seg = {
        "device": 0, "address": 0x1000_0000, "total_size": 20 * MiB, "stream": 0,
        "segment_type": "large", "allocated_size": size, "active_size": size,
        "requested_size": size, "is_expandable": False,
        "blocks": [
            {"address": 0x1000_0000, "size": size, "requested_size": size, "state": "active_allocated"},
            {"address": 0x1000_0000 + size, "size": 20 * MiB - size, "requested_size": 0, "state": "inactive"},
        ],
    }
    events = [TraceEvent("segment_alloc", 0x1000_0000, 20 * MiB), TraceEvent("alloc", 0x1000_0000, size)]
    return write_snapshot(path, [seg], {0: events})


def test_snapshot_diff_writes_html(tmp_path, capsys, parse_html):
    """Two snapshots: terminal output names the parts; --html holds the verdict and 4 SVGs."""
    a = _tiny_snapshot(tmp_path / "a.pickle", 4 * MiB)
    b = _tiny_snapshot(tmp_path / "b.pickle", 6 * MiB)
    out_html = tmp_path / "d.html"
    assert main(["diff", str(a), str(b), "--html", str(out_html)]) == 0
    text = " ".join(capsys.readouterr().out.split())  # rich wraps at 80 columns in a pipe
    assert "allocated +2.00 MiB, fragmentation -2.00 MiB (both at peak reserved)" in text
    page = parse_html(out_html.read_text())
    assert "peak reserved 20.00 MiB -> 20.00 MiB" in "".join(page.text)
    assert [tag for tag, _ in page.tags].count("svg") == 4  # parts bar, aligned chart, one per side


def test_diff_page_loads_in_chromium(tmp_path, chromium):
    """Headless Chromium loads the page; its DOM has the four part bars and the verdict."""
    a = run_memory_from_snapshot(load_snapshot(_tiny_snapshot(tmp_path / "a.pickle", 4 * MiB)))
    b = run_memory_from_snapshot(load_snapshot(_tiny_snapshot(tmp_path / "b.pickle", 8 * MiB)))
    page = tmp_path / "d.html"
    page.write_text(diff_html(diff_runs(a, b)))
    done = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0
    assert done.stdout.count('class="part"') == 4
    assert "allocated +4.00 MiB" in done.stdout


def test_envelope_page_loads_in_chromium(tmp_path, chromium):
    """The envelope page of a hand-built creeping run: the verdict and the worst-step marker."""
    from oomkit.core.gpus import GpuSpec
    from oomkit.core.target import Target
    from oomkit.interfaces.reports.envelope import write_envelope_html
    from oomkit.prediction.envelope import predict_envelope
    from oomkit.prediction.tracing.recording import TraceRecording

    def synthetic(length_mib):
        act = length_mib * MiB
        cat = (("category", "activation"),)
        events = (
            TraceEvent("alloc", 1, 4096, tags=(("category", "parameter"),)),
            TraceEvent("alloc", 2, act, tags=cat),
            TraceEvent("free_requested", 2, act, tags=cat),
            TraceEvent("free_completed", 2, act, tags=cat),
            TraceEvent("alloc", 3, act, tags=cat),
            TraceEvent("free_requested", 3, act, tags=cat),
            TraceEvent("free_completed", 3, act, tags=cat),
        )
        return TraceRecording(events=events, step_starts=(1, 4))

    target = Target.resolve(GpuSpec("test GPU", 8 * 2**30, 0))
    env = predict_envelope(synthetic, [12, 14, 16], target)
    page = write_envelope_html(tmp_path / "env.html", env)
    done = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0
    assert "worst step 3 of 3 (length 16)" in done.stdout
    assert "worst: step 3" in done.stdout

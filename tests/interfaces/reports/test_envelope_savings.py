"""`predict --lengths`: the same signed saving in the terminal, JSON and HTML (issue 35 item 7)."""

from __future__ import annotations

import dataclasses
import io

from rich.console import Console

from oomkit.core.gpus import GpuSpec
from oomkit.core.target import Target
from oomkit.core.trace import TraceEvent
from oomkit.interfaces.reports.envelope import envelope_html, envelope_to_json, render_envelope
from oomkit.prediction.envelope import EnvelopeRemedy, predict_envelope
from oomkit.prediction.tracing.recording import TraceRecording

MiB = 2**20
GiB = 2**30


def _synthetic(length_mib: int) -> TraceRecording:
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


def test_a_remedy_that_costs_memory_reads_the_same_everywhere():
    """saving -3.50 GiB: '-3.50 GiB' on the terminal and the page, -3758096384 in JSON."""
    env = predict_envelope(_synthetic, [12, 16], Target.resolve(GpuSpec("test", 8 * GiB, 0)))
    peak = env.worst_peak_reserved_bytes
    costs = EnvelopeRemedy("--pad-to 4096", peak + 3584 * MiB, -3584 * MiB, None)
    saves = EnvelopeRemedy("largest batch first", peak - 2 * MiB, 2 * MiB, None)
    env = dataclasses.replace(env, remedies=(saves, costs))
    assert [r["saving_bytes"] for r in envelope_to_json(env)["remedies"]] == [2 * MiB, -3584 * MiB]
    out = io.StringIO()
    render_envelope(env, Console(file=out, width=200, color_system=None))
    terminal = out.getvalue()
    assert "-3.50 GiB" in terminal and "2.00 MiB" in terminal
    page = envelope_html(env)
    assert '<td class="num">-3.50 GiB</td>' in page
    assert '<td class="num">2.00 MiB</td>' in page
    assert '<td class="num">0 B</td>' not in page

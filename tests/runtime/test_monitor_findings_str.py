"""print(mon.findings) shows one readable line per finding (what and how much), not reprs."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from oomkit.diagnose.memory_health import FragmentationFinding  # noqa: E402
from oomkit.runtime.monitor import Findings, Monitor  # noqa: E402


def _leaky(monitor: Monitor, steps: int) -> list:
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(256, 256)
    kept = []
    for _ in range(steps):
        out = model(x)
        out.square().mean().backward()
        opt.step()
        opt.zero_grad()
        kept.append(out.detach())  # 256 KiB a step kept alive
        monitor.step()
    return kept


def test_printed_leak_finding_is_one_line_with_the_numbers(simulated_device, capsys):
    """A 256 KiB-per-step leak prints as 'leak: allocated memory grows by 256.00 KiB per step ...'."""
    simulated_device("64MiB")
    with Monitor() as monitor:
        _leaky(monitor, 14)
    findings = monitor.findings
    assert isinstance(findings, Findings) and isinstance(findings, list)
    print(findings)
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert len(lines) == len(findings) >= 1
    assert lines[0].startswith("leak: allocated memory grows by 256.00 KiB per step (steps ")
    assert "LeakFinding(" not in out and "growth_bytes_per_step" not in out
    assert str(findings[0]) == lines[0]


def test_no_findings_prints_a_sentence(simulated_device, capsys):
    """A monitor with no records: 'no memory leak or fragmentation found', still an empty list."""
    simulated_device("64MiB")
    with Monitor() as monitor:
        pass
    print(monitor.findings)
    assert capsys.readouterr().out == "no memory leak or fragmentation found\n"
    assert monitor.findings == []


def test_fragmentation_finding_str_names_the_bytes():
    """str(FragmentationFinding): 'fragmentation: ' then its numbers, on one line."""
    finding = FragmentationFinding(
        signals=("reserved_unused", "alloc_retries"),
        unused_bytes=3 * 2**30,
        unused_pct=37.5,
        inactive_split_bytes=None,
        inactive_split_growth_bytes_per_step=None,
        alloc_retries=4,
        largest_free_first_bytes=None,
        largest_free_last_bytes=None,
        recommendations=("expandable_segments:True",),
    )
    assert str(finding) == (
        "fragmentation: the cache is fragmenting: 3.00 GiB (38%) of reserved memory is unused at "
        "the step peaks; 4 allocation retries (each flushes the cache). Try "
        "expandable_segments:True"
    )
    assert str(Findings([finding])) == str(finding)

"""`oomkit tune` on a real snapshot whose trace makes no segment decision (issue 35 item 7)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from oomkit.interfaces.cli import main

SHARED = Path(__file__).resolve().parents[3] / ".." / "shared" / "snapshots"
# 7 segments (32 MiB), one trace event: every request is served from what was already reserved.
SNAPSHOT = SHARED / "jogregoire__How-Diffusion-Models-Work" / "509f225852__my_snapshot.pickle"
pytestmark = pytest.mark.skipif(not SNAPSHOT.is_file(), reason="../shared/snapshots is absent")


def test_tune_says_settings_cannot_be_compared(capsys, monkeypatch):
    """No table of 21 tied settings and no 'the default is already best': one verdict, last."""
    monkeypatch.setenv("COLUMNS", "400")
    assert main(["tune", str(SNAPSHOT), "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert lines[-1] == (
        "Settings cannot be compared on 509f225852__my_snapshot.pickle: the replay made no "
        "segment decision under any of the 21 settings, so none changes its peak reserved "
        "(32.00 MiB). Record the history from before the first CUDA allocation "
        "(torch.cuda.memory._record_memory_history at the start of the script) to compare them."
    )
    assert "already best" not in out
    assert "expandable_segments:True" not in out
    assert main(["tune", str(SNAPSHOT), "--jobs", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["comparable"] is False
    assert data["best"] is None and data["saving_bytes"] == 0
    assert len(data["candidates"]) == 21
    assert {c["peak_reserved_bytes"] for c in data["candidates"]} == {32 * 2**20}

"""`oomkit replay SNAPSHOT --what-if A --what-if B`: several settings, in parallel, in one table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _replay_snapshot import MiB, replay_snapshot

from oomkit.interfaces.cli import main

SETTINGS = ["", "expandable_segments:True", "max_split_size_mb:100"]


def _what_if(path: Path, capsys, *extra: str) -> tuple[int, dict]:
    argv = ["replay", str(path), "--json"]
    for setting in SETTINGS:
        argv += ["--what-if", setting]
    rc = main(argv + list(extra))
    return rc, json.loads(capsys.readouterr().out)


def test_what_if_json_exact_bytes_per_setting(tmp_path, capsys):
    """Default: 300 + 20 + 2 MiB reserved. max_split_size_mb:100 cannot split the cached 300 MiB
    block for the 200 MiB request (oversize blocks are not split), so it cudaMallocs a fourth
    segment: 522 MiB reserved, 217 MiB of it unused at the peak."""
    rc, out = _what_if(replay_snapshot(tmp_path), capsys, "--jobs", "1")
    assert rc == 0
    rows = out["settings"]
    assert [r["alloc_conf"] for r in rows] == SETTINGS
    assert [r["peak_reserved_bytes"] for r in rows] == [322 * MiB, 322 * MiB, 522 * MiB]
    assert [r["peak_allocated_bytes"] for r in rows] == [305 * MiB] * 3
    assert [r["peak_reserved_minus_peak_allocated_bytes"] for r in rows] == [17 * MiB, 17 * MiB, 217 * MiB]
    assert rows[2]["peak_reserved_minus_peak_allocated_pct"] == round(100 * 217 / 522, 2)
    assert [r["num_device_alloc"] for r in rows] == [3, 3, 4]
    assert [r["oom"] for r in rows] == [False, False, False]


def test_what_if_exit_1_when_a_setting_would_oom(tmp_path, capsys):
    """At 320 MiB the default OOMs at the 1000 B request (event 8); the other two fit."""
    rc, out = _what_if(replay_snapshot(tmp_path), capsys, "--capacity", "320MiB", "--jobs", "1")
    assert rc == 1
    rows = out["settings"]
    assert [r["oom"] for r in rows] == [True, False, False]
    assert rows[0]["oom_event_index"] == 8
    assert out["capacity_bytes"] == 320 * MiB


def test_what_if_jobs_2_identical_to_jobs_1(tmp_path, capsys):
    """The process pool gives the serial run's JSON, byte for byte, in the settings' order."""
    path = replay_snapshot(tmp_path)
    serial = _what_if(path, capsys, "--capacity", "320MiB", "--jobs", "1")
    parallel = _what_if(path, capsys, "--capacity", "320MiB", "--jobs", "2")
    assert parallel == serial


def test_what_if_table(tmp_path, capsys, monkeypatch):
    """The terminal table: one row per setting with peak reserved, its excess over peak allocated
    and OOM."""
    monkeypatch.setenv("COLUMNS", "160")
    path = replay_snapshot(tmp_path)
    argv = ["replay", str(path), "--capacity", "320MiB", "--jobs", "1"]
    for setting in SETTINGS:
        argv += ["--what-if", setting]
    assert main(argv) == 1
    lines = [line.rstrip() for line in capsys.readouterr().out.splitlines()]
    default = next(line for line in lines if "(default)" in line)
    assert "320.00 MiB" in default and "15.00 MiB (4.7%)" in default and "at event 8" in default
    expandable = next(line for line in lines if "expandable_segments:True" in line)
    assert expandable.split("│")[-2].strip() == "no"


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--verify"], "cannot take --verify"),
        (["--alloc-conf", "expandable_segments:True"], "cannot take --alloc-conf"),
        (["--what-if", "max_split_size_mb:banana"], "max_split_size_mb"),
    ],
)
def test_what_if_refusals_exit_2(tmp_path, capsys, extra, message):
    """--what-if with --verify or --alloc-conf, or a setting PyTorch rejects: exit 2, explained."""
    path = replay_snapshot(tmp_path)
    assert main(["replay", str(path), "--what-if", "", *extra]) == 2
    assert message in capsys.readouterr().err


def test_jobs_must_be_positive(tmp_path, capsys):
    """--jobs 0 is a usage error from argparse (exit 2)."""
    path = replay_snapshot(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(["replay", str(path), "--what-if", "", "--jobs", "0"])
    assert exc.value.code == 2
    assert "positive number of processes" in capsys.readouterr().err


def test_progress_bar_counts_every_setting_on_a_terminal(tmp_path, capsys, monkeypatch):
    """On a terminal (no --json) the shared progress bar is drawn and advanced to 3 of 3."""
    from contextlib import contextmanager

    from oomkit.interfaces.cli import replay as replay_cli

    seen: list[tuple[str, bool, list[tuple[int, int]]]] = []

    @contextmanager
    def spy_bar(enabled, what):
        updates: list[tuple[int, int]] = []
        seen.append((what, enabled, updates))
        yield lambda done, total: updates.append((done, total))

    monkeypatch.setattr(replay_cli, "progress_enabled", lambda args, stream: not args.json)
    monkeypatch.setattr(replay_cli, "progress_bar", spy_bar)
    path = replay_snapshot(tmp_path)
    argv = ["replay", str(path), "--jobs", "1"]
    for setting in SETTINGS:
        argv += ["--what-if", setting]
    assert main(argv) == 0
    assert seen == [("replaying settings", True, [(0, 3), (1, 3), (2, 3), (3, 3)])]
    capsys.readouterr()


def test_a_setting_given_twice_is_replayed_once(tmp_path, capsys):
    """--what-if A --what-if B --what-if ' A ' is two rows, A first (it had been three)."""
    argv = ["replay", str(replay_snapshot(tmp_path)), "--json", "--jobs", "1"]
    for setting in ("expandable_segments:True", "", " expandable_segments:True "):
        argv += ["--what-if", setting]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["settings"]
    assert [r["alloc_conf"] for r in rows] == ["expandable_segments:True", ""]

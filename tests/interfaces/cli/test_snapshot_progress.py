"""A bar on stderr while replay, tune and explain load and replay a snapshot: on a terminal only."""

from __future__ import annotations

import io
import sys

import pytest

from oomkit.core.snapshot import write_snapshot
from oomkit.core.trace import TraceEvent
from oomkit.interfaces.cli import main
from oomkit.interfaces.cli._progress import SnapshotProgress

ADDRESS = 0x7000_0000_0000


class Tty(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


@pytest.fixture
def snapshot_file(tmp_path):
    """A small valid snapshot whose name holds rich markup (shown as written)."""
    path = tmp_path / "[bold]run[red].pickle"
    actions = ("alloc", "free_requested", "free_completed")
    write_snapshot(
        path,
        [{"address": ADDRESS, "total_size": 2**21, "segment_type": "small",
          "blocks": [{"address": ADDRESS, "size": 2**21, "state": "inactive"}]}],
        [[TraceEvent(actions[i % 3], ADDRESS, 512) for i in range(300)]],
    )
    return path


NAME = "[bold]run[red].pickle"


@pytest.mark.parametrize(
    ("argv", "shown"),
    [
        # The bar's last state before it is removed, the file name as written.
        (["replay", "{file}", "--verify"], [f"{NAME}: replaying 300 events"]),
        (["tune", "{file}", "--jobs", "1"], [f"{NAME}: reading device 0's trace", "300/300"]),
        (["doctor", "{file}"], [f"{NAME}: reading device 0's trace"]),
        (["explain", "{file}"], [f"{NAME}: diagnosing (replaying the trace)"]),
        (
            ["diff", "{file}", "{other}"],
            [f"{NAME}: reading its memory over the run", "other.pickle: reading its memory"],
        ),
    ],
)
def test_a_terminal_shows_the_load_and_what_follows(
    argv, shown, snapshot_file, tmp_path, monkeypatch
):
    other = tmp_path / "other.pickle"
    other.write_bytes(snapshot_file.read_bytes())
    err = Tty()
    monkeypatch.setattr(sys, "stderr", err)
    main([a.format(file=snapshot_file, other=other) for a in argv])
    for text in shown:
        assert text in err.getvalue()


@pytest.mark.parametrize(
    "argv",
    [
        ["replay", "{file}", "--verify"],
        ["replay", "{file}", "--what-if", "expandable_segments:True", "--jobs", "1"],
        ["tune", "{file}", "--jobs", "1"],
        ["explain", "{file}"],
        ["doctor", "{file}"],
        ["diff", "{file}", "{file}"],
    ],
)
def test_nothing_is_drawn_in_a_pipe(argv, snapshot_file, capsys):
    main([a.format(file=snapshot_file) for a in argv])
    err = capsys.readouterr().err
    assert "reading" not in err and "replaying" not in err and "diagnosing" not in err


@pytest.mark.parametrize("command", ["replay", "tune", "explain", "doctor", "diff"])
def test_nothing_is_drawn_with_json_on_a_terminal(command, snapshot_file, monkeypatch):
    err = Tty()
    monkeypatch.setattr(sys, "stderr", err)
    extra = {"replay": ["--verify"], "tune": ["--jobs", "1"], "diff": [str(snapshot_file)]}
    main([command, str(snapshot_file), *extra.get(command, []), "--json"])
    assert "reading" not in err.getvalue() and "replaying" not in err.getvalue()


def test_snapshot_progress_words_each_phase_and_shortens_a_long_name():
    """The load's phases keep their amounts (bytes flagged for the file), a phase after it has
    none; a name over 32 characters keeps its start and end."""
    shown: list[tuple[str, int, int | None, bool]] = []
    name = "8630bcfe2d__results_medium_128_training_memory_snapshot.pickle"
    progress = SnapshotProgress(name, lambda *call: shown.append(call))
    assert progress.loading is not None
    progress.loading("reading the file", 10, 100)
    progress.loading("reading device 0's trace", 65_536, 70_000)
    progress.phase("replaying 70,000 events")
    short = "8630bcfe2d__res…_snapshot.pickle"
    assert len(short) == 32
    assert shown == [
        (f"{short}: reading the file", 10, 100, True),
        (f"{short}: reading device 0's trace", 65_536, 70_000, False),
        (f"{short}: replaying 70,000 events", 0, None, False),
    ]


def test_without_a_bar_nothing_is_called():
    progress = SnapshotProgress("s.pickle", None)
    assert progress.loading is None
    progress.phase("replaying 3 events")  # no bar: nothing to update, no error

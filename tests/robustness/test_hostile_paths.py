"""Paths that cannot be read or must not be written: exit 2, one line, no data lost (issue 36).

Outputs: an output that resolves to an input is refused before anything is written; so is a
directory, or a path in a directory that does not exist; a write that fails midway leaves the
old file (or none), never half of one. Inputs: a directory, a file without read permission, or
a read that fails with EIO is one line saying so.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oomkit._files import check_output_path, output_file, write_output
from oomkit.core.snapshot import load_snapshot
from oomkit.core.trace import TraceHeader, read_trace, write_trace
from oomkit.errors import InputFileError, OutputPathError
from oomkit.runtime._monitor_log import load_monitor_log

sys.path.insert(0, str(Path(__file__).parent))
from _cli_bounds import assert_refused, digest, run_oomkit  # noqa: E402
from _hostile_support import base_snapshot  # noqa: E402

FEW = settings(
    max_examples=6,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)

HEADER = {"oomkit_monitor": 1, "device": "NVIDIA H100 80GB HBM3", "capacity_bytes": 80 * 2**30}
RECORD = {
    "step": 1,
    "time_s": 0.5,
    "step_time_s": None,
    "allocated_bytes": 2**30,
    "reserved_bytes": 2**31,
    "active_bytes": 2**30,
    "inactive_split_bytes": 0,
    "peak_allocated_bytes": 2**30,
    "peak_reserved_bytes": 2**31,
    "num_alloc_retries": 0,
    "num_ooms": 0,
    "num_device_alloc": 3,
    "num_device_free": 0,
}


def _snapshot(folder: Path) -> Path:
    path = folder / "snap.pickle"
    path.write_bytes(pickle.dumps(base_snapshot()))
    return path


def _log(folder: Path, name: str = "run.jsonl") -> Path:
    path = folder / name
    path.write_text(json.dumps(HEADER) + "\n" + json.dumps(RECORD) + "\n")
    return path


# ------------------------------------------------------------------- output over an input


def _over_input_cases(folder: Path) -> list[tuple[list[str], Path]]:
    snap, log = _snapshot(folder), _log(folder)
    other = folder / "other.pickle"
    other.write_bytes(snap.read_bytes())
    return [
        (["explain", "snap.pickle", "--html", "snap.pickle"], snap),
        (["explain", "snap.pickle", "--html", "./snap.pickle"], snap),
        (["explain", "snap.pickle", "--html", str(snap)], snap),
        (["report", "run.jsonl", "--html", "run.jsonl"], log),
        (["report", "run.jsonl", "--png", "run.jsonl"], log),
        (["report", ".", "--html", "run.jsonl"], log),
        (["diff", "snap.pickle", "other.pickle", "--html", "other.pickle"], other),
    ]


def test_an_output_over_an_input_is_refused_and_the_input_kept(tmp_path):
    """--html/--png naming an input (as given, as ./name, absolute, or a file of an input
    directory): exit 2 before anything is written; the input is byte-for-byte unchanged."""
    for argv, victim in _over_input_cases(tmp_path):
        before = digest(victim)
        result = run_oomkit(argv, cwd=tmp_path)
        assert_refused(result, "is one of the inputs")
        assert digest(victim) == before, argv


def test_a_report_beside_the_logs_of_a_directory_is_written(tmp_path):
    """report DIR --html DIR/report.html: not an input (only the logs are), so it is written,
    and the logs are unchanged."""
    log = _log(tmp_path)
    before = digest(log)
    result = run_oomkit(["report", ".", "--html", "report.html"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "report.html").read_text().startswith("<!DOCTYPE html>")
    assert digest(log) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html", "run.jsonl"]


def test_an_output_through_a_hard_link_to_the_input_is_refused(tmp_path):
    """A hard link to the snapshot is the same file: refused too."""
    snap = _snapshot(tmp_path)
    os.link(snap, tmp_path / "alias.html")
    before = digest(snap)
    assert_refused(
        run_oomkit(["explain", "snap.pickle", "--html", "alias.html"], cwd=tmp_path),
        "is one of the inputs",
    )
    assert digest(snap) == before


@pytest.mark.parametrize(
    "argv",
    [
        ["explain", "snap.pickle", "--html", "{out}"],
        ["report", "run.jsonl", "--html", "{out}"],
        ["report", "run.jsonl", "--png", "{out}"],
        ["diff", "run.jsonl", "run.jsonl", "--html", "{out}"],
    ],
)
def test_a_missing_directory_or_a_directory_as_output_is_exit_2(tmp_path, argv):
    """Into a directory that does not exist, or onto a directory: exit 2, one line, nothing
    created."""
    _snapshot(tmp_path)
    _log(tmp_path)
    (tmp_path / "adir").mkdir()
    for out, words in (("missing/x.html", "does not exist"), ("adir", "is a directory")):
        result = run_oomkit([a.format(out=out) for a in argv], cwd=tmp_path)
        assert_refused(result, words)
    assert not (tmp_path / "missing").exists()
    assert list((tmp_path / "adir").iterdir()) == []


@FEW
@given(
    name=st.text(
        st.characters(blacklist_categories=("Cs",), blacklist_characters="/\0"),
        min_size=1,
        max_size=12,
    ).filter(lambda n: n not in (".", ".."))
)
def test_check_output_path_refuses_every_spelling_of_an_input(tmp_path_factory, name):
    """Whatever the file is called, the output path naming it (relative or absolute) is
    refused; another name in the same directory is accepted."""
    folder = tmp_path_factory.mktemp("out")
    source = folder / name
    source.write_bytes(b"data")
    for spelling in (source, folder / "." / name, source.resolve()):
        with pytest.raises(OutputPathError, match="is one of the inputs"):
            check_output_path(spelling, inputs=[source])
    assert check_output_path(folder / (name + ".html"), inputs=[source]) == folder / (
        name + ".html"
    )


def test_a_failed_write_leaves_the_old_file_and_no_partial_file(tmp_path):
    """An error while the output is being written: the old report stays, whole; no temporary
    file is left beside it."""
    out = tmp_path / "report.html"
    out.write_text("old report")
    with pytest.raises(RuntimeError, match="renderer failed"), output_file(out) as temp:
        temp.write_text("half a pa")
        raise RuntimeError("renderer failed")
    assert out.read_text() == "old report"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]
    write_output(out, "new report")
    assert out.read_text() == "new report"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]


def test_an_output_keeps_the_mode_a_plain_write_gives(tmp_path):
    """The renamed-in file is readable as a plain open() would make it (not mkstemp's 0600)."""
    out = write_output(tmp_path / "page.html", "x")
    umask = os.umask(0o022)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask


# ------------------------------------------------------------------- unreadable inputs


def _eio(*args, **kwargs):
    raise OSError(errno.EIO, "Input/output error")


def _denied(*args, **kwargs):
    raise PermissionError(errno.EACCES, "Permission denied")


@pytest.mark.parametrize(
    "failure, words", [(_eio, "could not read it"), (_denied, "no permission")]
)
def test_an_unreadable_input_is_one_error_for_every_reader(tmp_path, monkeypatch, failure, words):
    """EIO or no permission while opening a snapshot, a trace or a monitor log: InputFileError
    naming the file and what to do (the CLI prints it as one line, exit 2)."""
    import oomkit.core.snapshot.reader as snapshot_reader
    import oomkit.core.trace.io as trace_io

    snap = _snapshot(tmp_path)
    trace = tmp_path / "t.jsonl"
    write_trace(trace, [], TraceHeader())
    log = _log(tmp_path)
    monkeypatch.setattr(snapshot_reader, "open", failure, raising=False)
    monkeypatch.setattr(trace_io, "open", failure, raising=False)
    with pytest.raises(InputFileError, match=words):
        load_snapshot(snap)
    with pytest.raises(InputFileError, match=words):
        read_trace(trace)
    monkeypatch.setattr(Path, "read_text", failure)
    with pytest.raises(InputFileError, match=words):
        load_monitor_log(log)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files without read permission")
def test_a_file_without_read_permission_is_exit_2(tmp_path):
    """chmod 000: every command that reads it says so in one line."""
    snap = _snapshot(tmp_path)
    log = _log(tmp_path)
    snap.chmod(0)
    log.chmod(0)
    try:
        for argv in (
            ["explain", "snap.pickle"],
            ["replay", "snap.pickle"],
            ["report", "run.jsonl"],
        ):
            assert_refused(run_oomkit(argv, cwd=tmp_path), "no permission")
    finally:
        snap.chmod(0o644)
        log.chmod(0o644)


@pytest.mark.parametrize(
    "argv", [["explain", "adir"], ["tune", "adir"], ["simulate", "adir"], ["report", "empty"]]
)
def test_a_directory_as_input_is_exit_2(tmp_path, argv):
    """A directory where a file goes (or a directory with no monitor log): exit 2, no traceback."""
    (tmp_path / "adir").mkdir()
    (tmp_path / "adir" / "x.txt").write_text("x")
    (tmp_path / "empty").mkdir()
    result = run_oomkit(argv, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr

"""Inputs that exist but are no regular file: a FIFO, a device, a socket, a directory.

A FIFO's ``open`` for reading waits until a writer comes, forever on a FIFO nobody writes, and
``/dev/zero`` reads without end (a whole-file read of it was a ``MemoryError``): every reader and
every command refuses them before opening, with exit 2 from the CLI and an ``OomkitError`` from
Python, in bounded time. Should a reader open the FIFO anyway, the watchdog below opens its
write end and closes it at once (the reader gets end-of-file, so the test ends) and the test
fails on it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from oomkit._files import not_a_file_reason
from oomkit.errors import OomkitError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _cli_in_process import run_in_process  # noqa: E402

KINDS = ("fifo", "device", "socket", "directory")


@contextlib.contextmanager
def _special(kind: str, folder: Path) -> Iterator[Path]:
    if kind == "device":
        yield Path("/dev/null")  # a character device; /dev/zero would be the same, unbounded
        return
    path = folder / "in.x"
    if kind == "fifo":
        os.mkfifo(path)
        yield path
    elif kind == "directory":
        path.mkdir()
        (path / "inside.txt").write_text("x")
        yield path
    else:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
            server.bind(str(path))
            yield path


@contextlib.contextmanager
def _watchdog(path: Path) -> Iterator[list[bool]]:
    """Releases a reader blocked in ``open`` on the FIFO ``path``; ``[True]`` if one was."""
    opened: list[bool] = []
    done = threading.Event()

    def release() -> None:
        while not done.wait(0.02):
            try:
                fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as exc:  # ENXIO: no reader has it open
                if exc.errno != errno.ENXIO:
                    return
                continue
            opened.append(True)
            os.close(fd)  # the reader sees end-of-file

    thread = threading.Thread(target=release, daemon=True)
    if path.is_fifo():
        thread.start()
    try:
        yield opened
    finally:
        done.set()
        if thread.is_alive():
            thread.join(5)


def _readers() -> dict[str, Callable[[Path], object]]:
    import oomkit
    from oomkit.core.snapshot import load_snapshot
    from oomkit.core.trace import read_trace
    from oomkit.prediction.lengths import read_lengths
    from oomkit.prediction.models.trainer_args import read_trainer_args
    from oomkit.runtime._monitor_log import is_monitor_log, load_monitor_log
    from oomkit.scenario.files import read_scenario_data

    return {
        "load_snapshot": load_snapshot,
        "read_trace": read_trace,
        "load_monitor_log": load_monitor_log,
        "is_monitor_log": is_monitor_log,
        "read_scenario_data": read_scenario_data,
        "read_lengths": read_lengths,
        "read_trainer_args": lambda p: read_trainer_args(str(p)),
        "oomkit.explain": lambda p: oomkit.explain(p),
    }


READERS = tuple(_readers())

COMMANDS = (
    ("explain", "{}"),
    ("replay", "{}"),
    ("simulate", "{}"),
    ("tune", "{}"),
    ("doctor", "{}"),
    ("diff", "{}", "{}"),
    ("report", "{}"),
    ("predict", "gpt2-124m", "--config", "{}"),
    ("fit", "gpt2-124m", "--config", "{}"),
    ("predict", "gpt2-124m", "--lengths", "{}"),
    ("predict", "gpt2-124m", "--trainer-args", "{}"),
    ("experiment", "--configs", "{}", "--", sys.executable, "-c", "pass"),
)


def _words(kind: str) -> str:
    return "directory" if kind == "directory" else "is not a regular file"


@pytest.mark.parametrize("kind", KINDS)
def test_the_reason_names_what_the_path_is(tmp_path, kind):
    """``not_a_file_reason``: ``None`` for a file, the kind for anything else, without opening."""
    with _special(kind, tmp_path) as path, _watchdog(path) as opened:
        assert _words(kind) in (not_a_file_reason(path) or "")
    assert not opened
    (tmp_path / "file.txt").write_text("x")
    assert not_a_file_reason(tmp_path / "file.txt") is None
    assert not_a_file_reason(tmp_path / "missing") == "no such file"
    assert not_a_file_reason("a\x00b") == "no such file"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("reader", READERS)
def test_every_reader_refuses_before_opening(tmp_path, reader, kind):
    """Each Python reader of a user's file: an ``OomkitError`` naming the path and what it is."""
    read = _readers()[reader]
    with _special(kind, tmp_path) as path, _watchdog(path) as opened:
        with pytest.raises(OomkitError) as raised:
            read(path)
    assert not opened, f"{reader} opened the FIFO"
    assert str(path) in str(raised.value) and _words(kind) in str(raised.value)


@pytest.mark.parametrize("kind", ("fifo", "device", "directory"))
@pytest.mark.parametrize("argv", COMMANDS, ids=lambda argv: " ".join(argv[:3]))
def test_every_command_refuses_with_exit_2(tmp_path, argv, kind):
    """Each command that reads a user's file: exit 2, one message naming the path, no trace."""
    with _special(kind, tmp_path) as path, _watchdog(path) as opened:
        result = run_in_process([a.format(path) for a in argv], cwd=tmp_path)
    assert not opened, f"{argv[0]} opened the FIFO"
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and str(path) in result.stderr
    if kind != "directory":  # some commands read a directory of files instead
        assert "is not a regular file" in result.stderr, result.stderr

"""The files a user names: unreadable inputs said so; outputs never over an input, never torn.

:func:`input_file_error` turns the ``OSError`` of opening or reading an input (no permission, a
directory, EIO from a failing disk) into one message. Every user-named output goes through here:
:func:`check_output_path` refuses, before anything is computed or written, a path that is an input (``explain snap.pickle --html snap.pickle`` would
overwrite the snapshot), a directory, or one in a directory that does not exist; the write goes
to a temporary file beside the target that is renamed into place (``os.replace`` is atomic on
one file system), so a run that fails midway leaves the old file, or none, never a torn one.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from oomkit.errors import InputFileError, OomkitError, OutputPathError

__all__ = [
    "check_output_path",
    "input_file_error",
    "not_a_file_reason",
    "output_file",
    "refuse_special_file",
    "write_output",
]

_NOT_REGULAR = "is not a regular file (a device, pipe or socket)"
_DIRECTORY = "is a directory, not a file"

PathLike = str | os.PathLike[str]


def not_a_file_reason(path: PathLike) -> str | None:
    """Why an input ``path`` is not a file oomkit can read (``None`` when it is one): a
    directory, something that exists but is not a regular file (``/dev/null``, a pipe, a
    socket: read with ``seek`` and ``stat`` sizes, which they do not have), or nothing there."""
    try:
        file = Path(path)
        if file.is_file():
            return None
        if file.is_dir():
            return _DIRECTORY
        if file.exists():
            return _NOT_REGULAR
    except (OSError, ValueError):  # a name too long for the file system, a NUL byte
        pass
    return "no such file"


def refuse_special_file(
    path: PathLike, *, what: str = "file", error: type[OomkitError] = InputFileError
) -> None:
    """Raise ``error`` where ``path`` exists but is no regular file, before a reader opens it:
    a FIFO's ``open`` waits for a writer forever and ``/dev/zero`` never ends, so neither may
    reach a reader (bounded time and memory). A missing path is left to the reader's ``open``."""
    reason = not_a_file_reason(path)
    if reason == _DIRECTORY:
        raise error(f"{path}: cannot be read: {_directory_hint(what)}")
    if reason == _NOT_REGULAR:
        raise error(
            f"{path}: cannot be read: it {reason}; save what it holds to a file and pass that"
        )


def _directory_hint(what: str) -> str:
    return f"it is a directory; pass a {what} inside it"


def input_file_error(path: PathLike, exc: OSError, *, what: str = "file") -> InputFileError:
    """The error to raise when opening or reading the input ``path`` failed with ``exc``."""
    if isinstance(exc, IsADirectoryError) or Path(path).is_dir():
        hint = _directory_hint(what)
    elif isinstance(exc, PermissionError):
        hint = f"no permission to read it; check its permissions (chmod u+r {path})"
    elif isinstance(exc, FileNotFoundError):
        hint = "no such file; check the path"
    else:
        hint = (
            f"the system could not read it ({exc.strerror or exc}); the disk or file system may "
            "be failing: copy the file elsewhere and try again"
        )
    return InputFileError(f"{path}: cannot be read: {hint}")


def _same_file(a: Path, b: Path) -> bool:
    try:
        if a.resolve() == b.resolve():
            return True
        return a.exists() and b.exists() and os.path.samefile(a, b)  # hard links, bind mounts
    except (OSError, ValueError):
        return False


def _umask() -> int:
    current = os.umask(0o022)
    os.umask(current)
    return current


def check_output_path(path: PathLike, *, inputs: Iterable[PathLike] = (), flag: str = "") -> Path:
    """Refuse an output path that cannot (or must not) be written, before any work is done.

    Args:
        path: where the output goes.
        inputs: the files the command reads; the output may be none of them.
        flag: how the user named the path (``"--html"``), for the message.

    Returns:
        The path.

    Raises:
        OutputPathError: the path is an input, a directory, or in a missing directory.
    """
    out = Path(path)
    named = f"{flag} {out}" if flag else str(out)
    for given in inputs:
        source = Path(given)
        if _same_file(out, source):
            raise OutputPathError(
                f"{named} is one of the inputs of this command ({source}); writing there would destroy "
                "it. Choose another path, e.g. report.html"
            )
    if out.is_dir():
        raise OutputPathError(
            f"{named} is a directory; give a file path inside it, e.g. {out / 'report.html'}"
        )
    parent = out.parent
    if not parent.is_dir():
        raise OutputPathError(
            f"{named}: the directory {parent} does not exist; create it first (mkdir -p "
            f"{parent}) or choose another path"
        )
    return out


@contextlib.contextmanager
def output_file(
    path: PathLike, *, inputs: Iterable[PathLike] = (), flag: str = ""
) -> Iterator[Path]:
    """A temporary path beside ``path`` to write to; renamed onto ``path`` when the block ends
    without an error, removed when it raises.

    Raises:
        OutputPathError: as :func:`check_output_path`, or the write failed (no permission, disk
            full); the target is then unchanged.
    """
    # tempfile (with random) is imported when a file is written, not by every command that
    # imports this module to read one (issue 41 item 4: start-up).
    import tempfile

    out = check_output_path(path, inputs=inputs, flag=flag)
    named = f"{flag} {out}" if flag else str(out)
    try:
        handle, temp_name = tempfile.mkstemp(
            prefix=f".{out.name}.", suffix=".partial", dir=out.parent
        )
    except OSError as exc:
        raise OutputPathError(f"{named}: cannot be written ({exc.strerror or exc})") from None
    os.close(handle)
    temp = Path(temp_name)
    # mkstemp makes the file 0600; give it the mode a plain open() would (or the old file's).
    try:
        mode = out.stat().st_mode & 0o7777 if out.exists() else 0o666 & ~_umask()
        os.chmod(temp, mode)
    except OSError:
        pass
    try:
        yield temp
        os.replace(temp, out)
    except OSError as exc:
        raise OutputPathError(
            f"{named}: cannot be written ({exc.strerror or exc}); nothing was changed there"
        ) from None
    finally:
        with contextlib.suppress(OSError):
            temp.unlink()


def write_output(
    path: PathLike, data: str | bytes, *, inputs: Iterable[PathLike] = (), flag: str = ""
) -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` through :func:`output_file`, and return it."""
    with output_file(path, inputs=inputs, flag=flag) as temp:
        if isinstance(data, str):
            temp.write_text(data, encoding="utf-8")
        else:
            temp.write_bytes(data)
    return Path(path)

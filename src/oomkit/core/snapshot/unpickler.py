"""A pickle reader that builds plain data only: it refuses every global, so nothing can run.

PyTorch's ``_dump_snapshot`` pickles a tree of dict, list, tuple, str, int, float, bool and None.
None of those needs a global, so a pickle that names any global (``os.system``,
``builtins.eval``, a torch class) is not a memory snapshot and is refused before the global is
looked up. Persistent ids (``torch.save``'s tensor storages) are refused the same way.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from collections.abc import Callable
from typing import Any, BinaryIO

from oomkit.errors import SnapshotFormatError

__all__ = [
    "HOW_TO_RECORD",
    "ByteProgress",
    "ReadHook",
    "RestrictedUnpickler",
    "expansion_error",
    "expansion_limit",
    "load_plain_pickle",
    "looks_like_pickle",
]

# Called with (bytes read, file size) while a file is unpickled.
ByteProgress = Callable[[int, int], None]
# Called with the unpickler and the bytes read so far after each frame is read, while it builds
# the tree: it may look at (and take apart) what is complete, through ``unpickler.memo``
# (_drain.py's TraceDrain).
ReadHook = Callable[[pickle.Unpickler, int], None]

HOW_TO_RECORD = (
    "Produce a valid snapshot with: torch.cuda.memory._record_memory_history(); <run the code>; "
    'torch.cuda.memory._dump_snapshot("snap.pickle").'
)

# Start of a zip archive: what torch.save writes since PyTorch 1.6.
_ZIP_MAGIC = b"PK\x03\x04"

# How a pickle of a dict or list (a snapshot) opens, per protocol (Lib/pickletools.py opcodes):
# protocol 2 and later with PROTO (0x80); protocol 1 with EMPTY_DICT "}" or EMPTY_LIST "]" then
# BINPUT "q", MARK "(" or STOP "."; protocol 0 with MARK "(", DICT "d" or LIST "l", then PUT
# "p<n>\n" (pickle.py memoizes every container) or the first item's opcode. A text log that
# happens to start with "(d" or "(l" does not match the protocol 0 form.
_PICKLE_STARTS = (b"\x80", b"}q", b"]q", b"}(", b"](", b"}.", b"].")
_PROTOCOL_0_START = re.compile(rb"\((?:dp|lp)[0-9]+\n|\([dl][VSIFL(.]")

# The bound on a snapshot's expansion (issue 36): trace entries, segments, blocks and the frames
# of every stack read, per byte of pickle, with a floor for small files. PyTorch's files give at
# most 0.42 a byte (every shared snapshot: a frame in a stack is a memo reference of 2-5 bytes,
# and a stack list is shared by at most an alloc, its frees and its block), so only a file whose
# lists are the same list referred to over and over (a memo bomb: a few MB that expand to
# billions of entries) reaches it.
_EXPANSION_PER_BYTE = 4
_EXPANSION_FLOOR = 1_000_000


def looks_like_pickle(head: bytes) -> bool:
    """Whether a file starting with ``head`` (its first bytes) is a pickle of a dict or a list,
    in any protocol: such a file is read as a snapshot, never as text (issue 36: protocol 0 and
    1 snapshots were read as logs)."""
    return head.startswith(_PICKLE_STARTS) or _PROTOCOL_0_START.match(head) is not None


def expansion_limit(file_bytes: int) -> int:
    """The most entries (trace entries, segments, blocks, stack frames) a snapshot pickle of
    ``file_bytes`` may expand to before it is refused as a memo bomb."""
    return max(_EXPANSION_FLOOR, _EXPANSION_PER_BYTE * file_bytes)


def expansion_error(name: str, limit: int) -> SnapshotFormatError:
    """The refusal of a file that expands past ``limit`` entries (expansion_limit)."""
    return SnapshotFormatError(
        f"{name}: this file expands to more than {limit:,} entries (trace entries, segments, "
        f"blocks and stack frames, at most {_EXPANSION_PER_BYTE} a byte of the file): its lists "
        f"are the same lists referred to over and over (a pickle memo bomb), which PyTorch never "
        f"writes, so it was not read. {HOW_TO_RECORD}"
    )


class _RefusedGlobal(pickle.UnpicklingError):
    """Raised inside load() when the pickle names a global; turned into SnapshotFormatError."""


class RestrictedUnpickler(pickle.Unpickler):
    """An Unpickler that resolves no global and no persistent id (plain data only)."""

    def find_class(self, module: str, name: str) -> Any:
        raise _RefusedGlobal(f"the pickle names the global {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _RefusedGlobal(f"the pickle refers to an external object (persistent id {pid!r})")


class _CountingReader:
    """A binary file for the unpickler that reports how far it has read, frame by frame.

    Used only for framed pickles (protocol 4 and later, what ``_dump_snapshot`` writes): the C
    unpickler then reads a whole frame (up to 64 KiB) per ``read`` call, so the Python-level
    calls here are few, and each falls between two opcodes (``_Unpickler_ReadImpl`` in
    ``Modules/_pickle.c`` reads a frame whole). An unframed pickle is read an opcode at a time,
    and is not wrapped.
    """

    def __init__(
        self, stream: Any, total: int, progress: ByteProgress | None, hook: ReadHook | None
    ) -> None:
        self._stream = stream  # a buffered binary file (read, readinto, readline, tell)
        self._total = total
        self._progress = progress
        self._hook = hook
        self.unpickler: pickle.Unpickler | None = None

    def _after_read(self) -> None:
        done = self._stream.tell()
        if self._progress is not None:
            self._progress(done, self._total)
        if self._hook is not None and self.unpickler is not None:
            self._hook(self.unpickler, done)

    def read(self, size: int = -1) -> bytes:
        data = self._stream.read(size)
        self._after_read()
        return data

    def readinto(self, buffer: Any) -> int:
        count = self._stream.readinto(buffer)
        self._after_read()
        return count

    def readline(self, size: int = -1) -> bytes:
        return self._stream.readline(size)


def _framed(start: bytes) -> bool:
    """Whether a pickle starting with ``start`` uses frames: PROTO 4 or later (pickle.py)."""
    return len(start) >= 2 and start[0] == pickle.PROTO[0] and start[1] >= 4


def load_plain_pickle(
    source: bytes | BinaryIO,
    name: str,
    progress: ByteProgress | None = None,
    hook: ReadHook | None = None,
) -> Any:
    """Unpickle plain data, refusing globals; every failure becomes one SnapshotFormatError.

    Args:
        source: the pickle bytes, or a binary file positioned at its start.
        name: how to call the input in messages (a path, or ``"<bytes>"``).
        progress: called with (bytes read, file size) as a file (not bytes) with a framed
            pickle is read; not called otherwise.
        hook: called with the unpickler after each frame of a framed pickle (file or bytes)
            is read; a SnapshotFormatError it raises ends the load as it is.

    Returns:
        The unpickled tree of dicts, lists, tuples, strings and numbers.

    Raises:
        SnapshotFormatError: empty, truncated, corrupt, not a pickle, or naming a global.
    """
    stream: BinaryIO = io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source
    start = stream.read(8)
    stream.seek(0)
    if not start:
        raise SnapshotFormatError(
            f"{name}: the file is empty, not a memory snapshot. {HOW_TO_RECORD}"
        )
    if start.startswith(_ZIP_MAGIC):
        raise SnapshotFormatError(
            f"{name}: this is a zip archive (what torch.save writes), not a memory snapshot "
            f"pickle. {HOW_TO_RECORD}"
        )
    stripped = start.lstrip()
    if stripped[:1] in (b"{", b"[") or stripped[:1] == b'"':
        raise SnapshotFormatError(
            f"{name}: this looks like JSON text, not a memory snapshot pickle. {HOW_TO_RECORD}"
        )
    reader: Any = stream
    if _framed(start):
        if isinstance(source, (bytes, bytearray)):
            progress, total = None, len(source)
        else:
            try:
                total = os.fstat(stream.fileno()).st_size
            except (AttributeError, OSError, io.UnsupportedOperation):
                total = 0
        if total > 0 and (progress is not None or hook is not None):
            reader = _CountingReader(stream, total, progress, hook)
    unpickler = RestrictedUnpickler(reader)
    if isinstance(reader, _CountingReader):
        reader.unpickler = unpickler
    try:
        return unpickler.load()
    except SnapshotFormatError:
        raise
    except _RefusedGlobal as exc:
        raise SnapshotFormatError(
            f"{name}: refused to load: {exc}. A memory snapshot is plain data (dicts, lists, "
            f"numbers, strings) and never needs one, so this file is not a snapshot and may be "
            f"hostile; nothing in it was run. {HOW_TO_RECORD}"
        ) from None
    except EOFError:
        raise SnapshotFormatError(
            f"{name}: the pickle ends early: the file is truncated. Copy it again in full. "
            f"{HOW_TO_RECORD}"
        ) from None
    except RecursionError:
        raise SnapshotFormatError(
            f"{name}: the pickle is nested too deeply to be a memory snapshot. {HOW_TO_RECORD}"
        ) from None
    except MemoryError:
        raise SnapshotFormatError(
            f"{name}: the pickle asks for more memory than is available; it is corrupt or not "
            f"a memory snapshot. {HOW_TO_RECORD}"
        ) from None
    except Exception as exc:  # noqa: BLE001 - any decoding failure means "not a valid pickle"
        raise SnapshotFormatError(
            f"{name}: cannot be read as a memory snapshot: the file is truncated, corrupt or "
            f"not a pickle "
            f"({type(exc).__name__}: {exc}). {HOW_TO_RECORD}"
        ) from None
    finally:
        if isinstance(reader, _CountingReader):
            # The reader and the unpickler refer to each other: without this the cycle (the
            # cyclic GC is paused while a snapshot loads) would keep the unpickler's memo,
            # which holds every object it built, alive after the load.
            reader.unpickler = None

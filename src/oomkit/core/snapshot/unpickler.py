"""A pickle reader that builds plain data only: it refuses every global, so nothing can run.

PyTorch's ``_dump_snapshot`` pickles a tree of dict, list, tuple, str, int, float, bool and None.
None of those needs a global, so a pickle that names any global (``os.system``,
``builtins.eval``, a torch class) is not a memory snapshot and is refused before the global is
looked up. Persistent ids (``torch.save``'s tensor storages) are refused the same way.
"""

from __future__ import annotations

import io
import pickle
from typing import Any, BinaryIO

from oomkit.errors import SnapshotFormatError

__all__ = ["HOW_TO_RECORD", "RestrictedUnpickler", "load_plain_pickle"]

HOW_TO_RECORD = (
    "Produce a valid snapshot with: torch.cuda.memory._record_memory_history(); <run the code>; "
    'torch.cuda.memory._dump_snapshot("snap.pickle").'
)

# Start of a zip archive: what torch.save writes since PyTorch 1.6.
_ZIP_MAGIC = b"PK\x03\x04"


class _RefusedGlobal(pickle.UnpicklingError):
    """Raised inside load() when the pickle names a global; turned into SnapshotFormatError."""


class RestrictedUnpickler(pickle.Unpickler):
    """An Unpickler that resolves no global and no persistent id (plain data only)."""

    def find_class(self, module: str, name: str) -> Any:
        raise _RefusedGlobal(f"the pickle names the global {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _RefusedGlobal(f"the pickle refers to an external object (persistent id {pid!r})")


def load_plain_pickle(source: bytes | BinaryIO, name: str) -> Any:
    """Unpickle plain data, refusing globals; every failure becomes one SnapshotFormatError.

    Args:
        source: the pickle bytes, or a binary file positioned at its start.
        name: how to call the input in messages (a path, or ``"<bytes>"``).

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
    try:
        return RestrictedUnpickler(stream).load()
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

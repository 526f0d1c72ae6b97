"""Recordings kept on disk, keyed by everything that changes them (``oomkit predict``'s cache).

Recording a step imports torch (about 1 s) and, through ``torch._disable_dynamo``'s wrappers,
``torch._dynamo`` (about 1 s more), then runs the step on meta tensors; replaying the recording
through the simulated allocator needs none of that. A second prediction of the same step on the
same installation records the same events, so the recording is kept here and replayed.

What changes a recording, all of it in the key (``recording_key``): the request (the caller puts
the whole scenario in ``material``), oomkit's version and a digest of its own source files (an
edit in a checkout invalidates every entry: ``oomkit_source_digest``), the versions of torch and
of the libraries a step may build with (``package_versions``, read from their metadata without
importing them), the Python version and platform, and the environment variables the recorder or
torch read (``recorder_environment``: cuBLAS and cuDNN workspace settings, ``TORCH_*``...).
Which requests may be cached at all is the caller's rule (``oomkit.scenario.recording_reuse``):
never one that runs the user's code.

An entry is an oomkit trace file (``oomkit.core.trace.write_trace``: JSON lines, gzip) whose
header carries the recording's other fields and the caller's context, with the key and
``CACHE_FORMAT_VERSION``. It is written to a temporary file and renamed into place, so a reader
sees a whole entry or none. Reading checks everything: an entry that is truncated, corrupt, of
another format or version, or another key's, is treated as absent (and rewritten by the next
miss); it is never trusted and never raises.

Where: ``$OOMKIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/oomkit``, else ``~/.cache/oomkit``; the
entries live in its ``recordings`` folder, at most ``MAX_ENTRIES`` of them (the least recently
used removed first). ``OOMKIT_NO_CACHE=1`` turns the cache off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oomkit.core.trace import TraceEvent, TraceHeader, read_trace, write_trace
from oomkit.errors import OomkitError

__all__ = [
    "CACHE_FORMAT_VERSION",
    "CachedRecording",
    "KEYED_PACKAGES",
    "MAX_ENTRIES",
    "cache_directory",
    "cache_disabled",
    "load_recording",
    "oomkit_source_digest",
    "package_versions",
    "plain_data",
    "plain_value",
    "recorder_environment",
    "recording_key",
    "source_tree_digest",
    "store_recording",
]

# The entry format's version: bump it on any change to what an entry holds or means; an entry of
# another version is a miss (and is rewritten).
CACHE_FORMAT_VERSION = 1
# The trace header's ``source`` of a cache entry: a trace file of any other source is foreign.
_SOURCE = "oomkit-recording-cache"
# Libraries a preset or --hf step may build with (transformers, peft for LoRA, bitsandbytes and
# torchao for quantization and float8, accelerate for the HF Trainer's pieces, triton for kernels
# torch picks): their versions are in every key, used or not (an unused one only costs a miss).
KEYED_PACKAGES = (
    "torch",
    "transformers",
    "peft",
    "torchao",
    "bitsandbytes",
    "accelerate",
    "triton",
)
# Environment variables that the recorder or torch read while a step records: the cuBLAS and
# cuDNN workspace settings (prediction/tracing/emulations/cublas.py and cudnn_workspace.py:
# CUBLAS_WORKSPACE_CONFIG, CUBLASLT_WORKSPACE_SIZE, TORCH_CUBLASLT_UNIFIED_WORKSPACE,
# CUDNN_CONV_WSCAP_DBG), torch's own switches (TORCH_*, PYTORCH_*), CUDA and NCCL settings, the
# Hugging Face libraries' (HF_*, TRANSFORMERS_*) and oomkit's own. Every variable with one of
# these prefixes is in the key, so a setting not listed in those files is covered too.
_ENVIRONMENT_PREFIXES = (
    "CUBLAS",
    "CUDNN",
    "CUDA",
    "NCCL",
    "NVIDIA",
    "TORCH",
    "PYTORCH",
    "HF_",
    "TRANSFORMERS",
    "PEFT",
    "BNB",
    "OOMKIT",
)
# oomkit's own variables that choose where the cache is or whether it is used: not the recording's.
_CACHE_VARIABLES = frozenset({"OOMKIT_CACHE_DIR", "OOMKIT_NO_CACHE"})
# Entries refused before reading: a recording of this many bytes on disk is damage (a 70B
# model's step records a few hundred thousand events, a few tens of MB before compression).
_MAX_ENTRY_BYTES = 1 << 30
# The most entries kept: storing one more removes the least recently used (a hit marks its entry
# used). A GPT-2 step's entry is about 40 kB, so the folder stays within some tens of MB.
MAX_ENTRIES = 256
# A temporary file older than this is a writer's that died before renaming it: removed.
_STALE_TEMPORARY_S = 3600.0


@dataclass(frozen=True)
class CachedRecording:
    """A recording read back from the cache: what ``predict_recording`` replays.

    The fields are ``oomkit.prediction.tracing.TraceRecording``'s that a replay and its report
    read (a cached recording is replayed as a fresh one is), plus ``context``: the caller's
    plain data about the request (what was recorded, in words and as a workload; the defaults
    chosen), which a hit needs without building the step.
    """

    events: tuple[TraceEvent, ...]
    step_starts: tuple[int, ...] = ()
    warnings: tuple[str, ...] = ()
    bytes_by_category: Mapping[str, int] = field(default_factory=dict)
    kernel_choices: Mapping[str, int] = field(default_factory=dict)
    assumptions: Mapping[str, str] = field(default_factory=dict)
    collective_ids: frozenset[int] | None = None
    timing_note: str | None = None
    context: Mapping[str, Any] = field(default_factory=dict)
    # A recording whose step set a memory fraction is not kept (scenario/recording_reuse.py).
    memory_fraction: float | None = None

    @property
    def steps(self) -> int:
        """How many steps were recorded."""
        return len(self.step_starts)


def cache_disabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``OOMKIT_NO_CACHE`` turns the cache off (``1``, ``true``, ``yes``, ``on``)."""
    env = os.environ if environ is None else environ
    return env.get("OOMKIT_NO_CACHE", "").strip().lower() in ("1", "true", "yes", "on")


def cache_directory(environ: Mapping[str, str] | None = None) -> Path:
    """The folder of cached recordings: ``recordings`` in ``$OOMKIT_CACHE_DIR``, else in
    ``$XDG_CACHE_HOME/oomkit`` (the XDG base directory specification's user cache), else in
    ``~/.cache/oomkit``."""
    env = os.environ if environ is None else environ
    root = env.get("OOMKIT_CACHE_DIR") or ""
    if not root:
        xdg = env.get("XDG_CACHE_HOME") or ""
        # XDG base directory spec: a relative XDG_CACHE_HOME is invalid and is ignored.
        base = Path(xdg) if os.path.isabs(xdg) else Path(os.path.expanduser("~")) / ".cache"
        return base / "oomkit" / "recordings"
    return Path(os.path.expanduser(root)) / "recordings"


@functools.lru_cache(maxsize=1)
def oomkit_source_digest() -> str:
    """``source_tree_digest`` of oomkit's own package: an edit to any of its Python files, in a
    checkout or an install, changes every key."""
    return source_tree_digest(Path(__file__).resolve().parent.parent)


def source_tree_digest(root: Path) -> str:
    """SHA-256 of every ``.py`` file under ``root``: their relative paths and bytes, in path
    order (a file added, removed, renamed or edited changes it)."""
    digest = hashlib.sha256()
    for relative in sorted(_source_files(root)):
        digest.update(relative.encode("utf-8", "surrogateescape") + b"\0")
        with open(root / relative, "rb") as source:
            digest.update(hashlib.sha256(source.read()).digest())
    return digest.hexdigest()


def _source_files(root: Path) -> Iterator[str]:
    """Every ``.py`` file under ``root``, as a ``/``-separated path relative to it."""
    pending = [""]
    while pending:
        folder = pending.pop()
        with os.scandir(root / folder if folder else root) as entries:
            for entry in entries:
                if entry.name == "__pycache__":
                    continue
                relative = f"{folder}/{entry.name}" if folder else entry.name
                if entry.is_dir(follow_symlinks=False):
                    pending.append(relative)
                elif entry.name.endswith(".py"):
                    yield relative


def package_versions(names: Sequence[str] = KEYED_PACKAGES) -> dict[str, str | None]:
    """Each package's installed version, from its metadata without importing it; ``None``
    where it is not installed."""
    from importlib import metadata

    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def recorder_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment variables a recording may depend on (see ``_ENVIRONMENT_PREFIXES``),
    sorted by name; the cache's own settings left out."""
    env = os.environ if environ is None else environ
    return {
        name: env[name]
        for name in sorted(env)
        if name.startswith(_ENVIRONMENT_PREFIXES) and name not in _CACHE_VARIABLES
    }


def recording_key(material: Mapping[str, Any]) -> str:
    """The key of a recording: SHA-256 of ``material`` as canonical JSON (keys sorted, no
    spaces), with the format version, oomkit's version and source digest, the keyed packages'
    versions and Python's version and platform added.

    Args:
        material: the caller's part of the key (the whole request, the files it reads), as
            JSON data.

    Raises:
        TypeError: ``material`` is not JSON data.
    """
    from oomkit._version import __version__

    whole = {
        "cache_format": CACHE_FORMAT_VERSION,
        "oomkit": __version__,
        "oomkit_source_sha256": oomkit_source_digest(),
        "packages": package_versions(),
        "python": sys.version,
        "platform": sys.platform,
        "material": material,
    }
    text = json.dumps(whole, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _entry_path(directory: Path, key: str) -> Path:
    return directory / f"{key}.trace.gz"


def load_recording(key: str, directory: Path | None = None) -> CachedRecording | None:
    """The cached recording of ``key``, or ``None``: none is cached, or the entry is damaged,
    truncated, of another format version or another key's (it is then ignored, and the next
    ``store_recording`` of the key replaces it). Never raises."""
    if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
        return None
    path = _entry_path(cache_directory() if directory is None else directory, key)
    try:
        if path.stat().st_size > _MAX_ENTRY_BYTES:
            return None
    except OSError:
        return None
    recording = _load_entry(path, key)
    if recording is not None:
        with contextlib.suppress(OSError):
            os.utime(path)  # used now: the last to be pruned
    return recording


def store_recording(
    key: str, recording: CachedRecording, directory: Path | None = None
) -> bool:
    """Keep ``recording`` as ``key``'s entry, atomically (a temporary file in the same folder,
    renamed into place). The entry is read back and compared with ``recording`` before it is
    renamed: one that would not read back equal (a field that is not plain data) is not kept.

    Returns:
        Whether it was kept; ``False`` when the folder cannot be written (read-only, full) or
        the recording does not read back equal. Never raises for those.
    """
    folder = cache_directory() if directory is None else directory
    try:
        header = _header_of(recording, key)
    except (TypeError, ValueError):
        return False  # a field that is not plain data: not cached
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=folder, prefix=".entry-", suffix=".tmp.gz")
    except OSError:
        return False
    os.close(handle)
    try:
        write_trace(temporary, recording.events, header)
        if _load_entry(Path(temporary), key) != recording:
            return False
        os.replace(temporary, _entry_path(folder, key))
        temporary = ""
        _prune(folder, MAX_ENTRIES)
        return True
    except (OSError, TypeError, ValueError, OomkitError):
        return False
    finally:
        if temporary:
            with contextlib.suppress(OSError):
                os.unlink(temporary)


def _prune(folder: Path, max_entries: int) -> None:
    """Remove the least recently used entries beyond ``max_entries``, and temporary files that
    a writer left (older than an hour). Files it cannot remove are left; never raises."""
    now = time.time()
    entries: list[tuple[float, str]] = []
    try:
        with os.scandir(folder) as scan:
            for item in scan:
                name = item.name
                try:
                    modified = item.stat(follow_symlinks=False).st_mtime
                except OSError:
                    continue
                if name.endswith(".trace.gz") and not name.startswith("."):
                    entries.append((modified, name))
                elif name.startswith(".entry-") and now - modified > _STALE_TEMPORARY_S:
                    with contextlib.suppress(OSError):
                        os.unlink(folder / name)
    except OSError:
        return
    entries.sort()
    for _, name in entries[: max(0, len(entries) - max_entries)]:
        with contextlib.suppress(OSError):
            os.unlink(folder / name)


def _load_entry(path: Path, key: str) -> CachedRecording | None:
    """The entry at ``path`` if it is ``key``'s, whole and of this format; else ``None``."""
    try:
        header, events = read_trace(path)
        try:
            recording = _from_header(header, key)
            read = tuple(events) if recording is not None else ()
        finally:
            close = getattr(events, "close", None)
            if close is not None:
                close()
        return None if recording is None else _with_events(recording, read)
    except (OomkitError, OSError, ValueError, TypeError, KeyError, EOFError, zlib.error):
        # Damage of any kind (TraceFormatError is an OomkitError; a truncated gzip an EOFError;
        # a header field of the wrong type a TypeError or KeyError): a miss.
        return None
    except RecursionError:  # a header nested past Python's limit
        return None


# --------------------------------------------------------------------------- the entry's header


def _header_of(recording: CachedRecording, key: str) -> TraceHeader:
    """The trace header of an entry: the key, the format version and every field but events."""
    collective = recording.collective_ids
    metadata = {
        "cache_format": CACHE_FORMAT_VERSION,
        "key": key,
        "step_starts": list(recording.step_starts),
        "warnings": list(recording.warnings),
        "bytes_by_category": dict(recording.bytes_by_category),
        "kernel_choices": dict(recording.kernel_choices),
        "assumptions": dict(recording.assumptions),
        "collective_ids": None if collective is None else sorted(collective),
        "timing_note": recording.timing_note,
        "context": plain_data(recording.context),
    }
    # Refuses NaN and anything that is not JSON data now, before a file is made.
    json.dumps(metadata, allow_nan=False)
    return TraceHeader(source=_SOURCE, metadata=metadata)


def _from_header(header: TraceHeader, key: str) -> CachedRecording | None:
    """The recording's fields from an entry's header (events empty); ``None`` when the header
    is not this key's entry of this format. Raises TypeError/KeyError/ValueError on damage."""
    meta = header.metadata
    if header.source != _SOURCE or not isinstance(meta, Mapping):
        return None
    if meta.get("cache_format") != CACHE_FORMAT_VERSION or meta.get("key") != key:
        return None
    collective = meta["collective_ids"]
    timing = meta["timing_note"]
    context = plain_value(meta["context"])
    if not isinstance(context, dict):
        raise TypeError("context is not a mapping")
    return CachedRecording(
        events=(),
        step_starts=tuple(_ints(meta["step_starts"])),
        warnings=tuple(_strings(meta["warnings"])),
        bytes_by_category=_int_map(meta["bytes_by_category"]),
        kernel_choices=_int_map(meta["kernel_choices"]),
        assumptions=_str_map(meta["assumptions"]),
        collective_ids=None if collective is None else frozenset(_ints(collective)),
        timing_note=None if timing is None else _string(timing),
        context=context,
    )


def _with_events(recording: CachedRecording, events: tuple[TraceEvent, ...]) -> CachedRecording:
    """The recording with its events, checked against its step boundaries."""
    starts = recording.step_starts
    if any(not 0 <= s <= len(events) for s in starts) or list(starts) != sorted(starts):
        raise ValueError("step boundaries outside the events")
    return dataclasses.replace(recording, events=events)


def _ints(value: Any) -> list[int]:
    if not isinstance(value, list) or any(type(v) is not int for v in value):
        raise TypeError("expected a list of integers")
    return value


def _string(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError("expected a string")
    return value


def _strings(value: Any) -> list[str]:
    if not isinstance(value, list):
        raise TypeError("expected a list of strings")
    return [_string(v) for v in value]


def _int_map(value: Any) -> dict[str, int]:
    if not isinstance(value, dict) or any(type(v) is not int for v in value.values()):
        raise TypeError("expected a mapping of integers")
    return dict(value)


def _str_map(value: Any) -> dict[str, str]:
    if not isinstance(value, dict) or any(not isinstance(v, str) for v in value.values()):
        raise TypeError("expected a mapping of strings")
    return dict(value)


# ----------------------------------------------------------------- plain data, types kept exactly


def plain_data(value: Any) -> Any:
    """``value`` as JSON that ``plain_value`` turns back into an equal value of the same types:
    ``None``, ``bool``, ``int``, finite ``float`` and ``str`` as themselves; a list, a tuple and
    a mapping with string keys tagged (``{"list": [...]}``, ``{"tuple": [...]}``,
    ``{"dict": {...}}``), so a tuple does not come back a list.

    Raises:
        TypeError: anything else (an object, a mapping with other keys).
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"tuple": [plain_data(v) for v in value]}
    if isinstance(value, list):
        return {"list": [plain_data(v) for v in value]}
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        return {"dict": {k: plain_data(v) for k, v in value.items()}}
    raise TypeError(f"not plain data: {type(value).__name__}")


def plain_value(data: Any) -> Any:
    """The value ``plain_data`` wrote. Raises TypeError on anything it does not write."""
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, dict) and len(data) == 1:
        (tag, inner), = data.items()
        if tag == "tuple" and isinstance(inner, list):
            return tuple(plain_value(v) for v in inner)
        if tag == "list" and isinstance(inner, list):
            return [plain_value(v) for v in inner]
        if tag == "dict" and isinstance(inner, dict):
            return {k: plain_value(v) for k, v in inner.items()}
    raise TypeError("not a value plain_data writes")

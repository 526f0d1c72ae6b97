"""Streaming reader and writer of oomkit trace files (JSON Lines, gzip when the name ends in .gz).

Layout, one JSON value per line (``TRACE_FORMAT_VERSION`` = 1):

1. the header: ``{"format": "oomkit-trace", "version": 1, "source": ..., "device": ...,
   "torch_version": ..., "allocator_settings": ..., "capacity_bytes": ..., "metadata": {...}}``;
2. any number of event lines, with compact keys and defaults left out so that a million-event
   file stays small and fast to parse: ``{"a": action, "p": address, "s": size, "st": stream,
   "t": time_us, "f": stack_id, "g": [[tag, value], ...]}`` (``st`` absent = 0, ``t`` absent =
   None, ``f`` absent = no frames, ``g`` absent = no tags);
3. stack lines ``{"stack": id, "frames": [[filename, line, name], ...]}``, each written once just
   before the first event that uses it, so a repeated stack costs one small integer per event on
   disk and one shared tuple in memory;
4. the end line ``{"end": number_of_events}``; a file without it was truncated.

A reader accepts every version up to its own and refuses newer ones, naming the file and line.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from oomkit._files import input_file_error, refuse_special_file
from oomkit.core.trace.events import TRACE_FORMAT_VERSION, Frame, TraceEvent, TraceHeader
from oomkit.errors import TraceFormatError

__all__ = ["MAX_LINE_CHARS", "TRACE_FORMAT_NAME", "read_trace", "write_trace"]

TRACE_FORMAT_NAME = "oomkit-trace"

_GZIP_MAGIC = b"\x1f\x8b"
# Device addresses and sizes are 64-bit (CUdeviceptr, size_t: CUDACachingAllocator.h
# TraceEntry); a larger number is damage, and would overflow the simulator's arithmetic.
_U64 = 1 << 64
# gzip level 6 (zlib's default): level 9 writes traces about 3x slower for a few % less size.
_GZIP_LEVEL = 6
_HOW_TO_WRITE = "Write trace files with oomkit.core.trace.write_trace()."
# Bound on the writer's identity cache of frame tuples (see write_trace); it only saves hashing.
_STACK_ID_CACHE_MAX = 1 << 16
# The longest line a reader accepts, in characters. write_trace's longest lines are stack lines
# (~100 characters a frame), so 16 Mi characters is ~100,000 frames; a longer line is damage or
# a decompression bomb (a gzip of one endless line), refused before it is held in memory.
MAX_LINE_CHARS = 1 << 24

_encode = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, check_circular=False).encode


def write_trace(
    path: str | os.PathLike[str], events: Iterable[TraceEvent], header: TraceHeader
) -> int:
    """Write events to a trace file, streaming: ``events`` may be a generator of any length.

    Args:
        path: the file to create or overwrite; gzip-compressed when the name ends in ``.gz``.
        events: the events, oldest first. Consumed once.
        header: what the trace came from. The file records ``TRACE_FORMAT_VERSION`` whatever
            ``header.format_version`` says, since that is the format actually written.

    Returns:
        The number of events written.

    Raises:
        TypeError: ``header.metadata`` or an event tag is not JSON-serialisable.
        OSError: the file cannot be written.
    """
    path = Path(path)
    header_obj = {
        "format": TRACE_FORMAT_NAME,
        "version": TRACE_FORMAT_VERSION,
        "source": header.source,
        "device": header.device,
        "torch_version": header.torch_version,
        "allocator_settings": header.allocator_settings,
        "capacity_bytes": header.capacity_bytes,
        "metadata": dict(header.metadata),
    }
    try:
        header_line = _encode(header_obj)
    except TypeError as exc:
        raise TypeError(
            f"TraceHeader.metadata must hold only JSON values (str, int, float, bool, None, "
            f"lists, dicts): {exc}"
        ) from exc
    stack_ids: dict[tuple[Frame, ...], int] = {}
    # id(frames) -> (frames, stack id): events from one source usually share the same tuple
    # object, and this skips hashing every Frame of it. Holding `frames` keeps the id valid.
    by_identity: dict[int, tuple[tuple[Frame, ...], int]] = {}
    action_json: dict[str, str] = {}
    tags_json: dict[tuple[tuple[str, str], ...], str] = {}
    count = 0
    with _open_for_writing(path) as out:
        write = out.write
        write(header_line + "\n")
        for ev in events:
            # Lines are assembled by hand (ints and cached JSON strings): several times faster
            # than json-encoding a dict per event. Types are checked so the file stays readable.
            action = action_json.get(ev.action)
            if action is None:
                if type(ev.action) is not str:
                    raise TypeError(f"TraceEvent.action must be a str; got {ev.action!r}")
                action = action_json[ev.action] = _encode(ev.action)
            address, size, stream_id, time_us = ev.address, ev.size, ev.stream, ev.time_us
            if (
                type(address) is not int
                or type(size) is not int
                or type(stream_id) is not int
                or (time_us is not None and type(time_us) is not int)
            ):
                raise TypeError(
                    "TraceEvent address, size, stream and time_us must be int (time_us may be "
                    f"None); got event {count}: {ev!r}"
                )
            line = '{"a":' + action + ',"p":' + str(address) + ',"s":' + str(size)
            if stream_id:
                line += ',"st":' + str(stream_id)
            if time_us is not None:
                line += ',"t":' + str(time_us)
            frames = ev.frames
            if frames:
                hit = by_identity.get(id(frames))
                if hit is not None and hit[0] is frames:
                    stack_id = hit[1]
                else:
                    found = stack_ids.get(frames)
                    if found is None:
                        found = len(stack_ids)
                        stack_ids[frames] = found
                        rows = [[fr.filename, fr.line, fr.name] for fr in frames]
                        write(_encode({"stack": found, "frames": rows}) + "\n")
                    stack_id = found
                    if len(by_identity) >= _STACK_ID_CACHE_MAX:
                        by_identity.clear()
                    by_identity[id(frames)] = (frames, stack_id)
                line += ',"f":' + str(stack_id)
            tags = ev.tags
            if tags:
                tags_text = tags_json.get(tags)
                if tags_text is None:
                    tags_text = tags_json[tags] = _encode_tags(tags)
                line += ',"g":' + tags_text
            write(line + "}\n")
            count += 1
        write(_encode({"end": count}) + "\n")
    return count


def read_trace(path: str | os.PathLike[str]) -> tuple[TraceHeader, Iterator[TraceEvent]]:
    """Open a trace file: read its header now, and its events lazily.

    The events are parsed one line at a time as the iterator is consumed, so a multi-GB trace
    never sits in memory whole. Equal stacks share one ``tuple[Frame, ...]`` and equal frames
    one ``Frame``. The file stays open until the iterator is exhausted or closed
    (``events.close()``).

    Args:
        path: an oomkit trace file, plain or gzip-compressed (detected from its first bytes).

    Returns:
        The header and an iterator of the events, oldest first.

    Raises:
        TraceFormatError: at once when the file is empty, not an oomkit trace, or of a newer
            format version; while iterating, at the first corrupt line or when the file turns
            out truncated. The message names the file and line.
        OSError: the file cannot be opened.
    """
    path = Path(path)
    refuse_special_file(path, what="trace file")
    try:
        stream = _open_for_reading(path)
    except OSError as exc:
        raise input_file_error(path, exc, what="trace file") from None
    try:
        first = stream.readline(MAX_LINE_CHARS + 1)
        _check_length(path, 1, first)
        header = _parse_header(path, first)
    except TraceFormatError:
        stream.close()
        raise
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as exc:
        stream.close()
        raise _format_error(path, 1, f"cannot be read ({exc})", _not_a_trace_hint()) from exc
    return header, _iter_events(path, stream)


# ---------------------------------------------------------------------------- internals


def _encode_tags(tags: tuple[tuple[str, str], ...]) -> str:
    if not all(
        isinstance(tag, tuple)
        and len(tag) == 2
        and isinstance(tag[0], str)
        and isinstance(tag[1], str)
        for tag in tags
    ):
        raise TypeError(f"TraceEvent.tags must be (str, str) pairs; got {tags!r}")
    return _encode(tags)


def _open_for_writing(path: Path) -> IO[str]:
    if path.name.endswith(".gz"):
        # mtime=0: the same events give byte-identical files.
        raw = gzip.GzipFile(path, mode="wb", compresslevel=_GZIP_LEVEL, mtime=0)
        return io.TextIOWrapper(raw, encoding="utf-8", newline="\n")
    return open(path, "w", encoding="utf-8", newline="\n")


def _open_for_reading(path: Path) -> IO[str]:
    with open(path, "rb") as sniff:
        magic = sniff.read(2)
    binary = gzip.open(path, "rb") if magic == _GZIP_MAGIC else open(path, "rb")
    return io.TextIOWrapper(binary, encoding="utf-8", newline="\n")


def _check_length(path: Path, lineno: int, line: str) -> None:
    if len(line) > MAX_LINE_CHARS:
        raise _format_error(
            path,
            lineno,
            f"is longer than {MAX_LINE_CHARS:,} characters, more than any line write_trace "
            "writes: the file is damaged or a decompression bomb",
            "Write the trace again. " + _HOW_TO_WRITE,
        )


def _not_a_trace_hint() -> str:
    return (
        'An oomkit trace starts with a line {"format": "oomkit-trace", "version": ...}. '
        + _HOW_TO_WRITE
    )


def _format_error(path: Path, line: int, what: str, todo: str) -> TraceFormatError:
    return TraceFormatError(f"{path}: line {line}: {what}. {todo}")


def _parse_header(path: Path, line: str) -> TraceHeader:
    if not line:
        raise _format_error(path, 1, "the file is empty, not an oomkit trace", _HOW_TO_WRITE)
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError):
        raise _format_error(
            path, 1, "is not JSON, so this is not an oomkit trace file", _not_a_trace_hint()
        ) from None
    if not isinstance(obj, dict) or obj.get("format") != TRACE_FORMAT_NAME:
        raise _format_error(
            path,
            1,
            "has no oomkit-trace header, so this is not an oomkit trace file",
            _not_a_trace_hint(),
        )
    version = obj.get("version")
    if type(version) is not int or version < 1:
        raise _format_error(
            path,
            1,
            f"the header's version {version!r} is not a positive integer",
            "The file is corrupt; write it again. " + _HOW_TO_WRITE,
        )
    if version > TRACE_FORMAT_VERSION:
        raise _format_error(
            path,
            1,
            f"trace format version {version} was written by a newer oomkit "
            f"(this one reads versions up to {TRACE_FORMAT_VERSION})",
            "Upgrade oomkit (pip install -U oomkit) to read it.",
        )
    fields = {
        "source": (str,),
        "device": (int,),
        "torch_version": (str, type(None)),
        "allocator_settings": (str, type(None)),
        "capacity_bytes": (int, type(None)),
        "metadata": (dict,),
    }
    defaults = TraceHeader()
    values: dict[str, Any] = {}
    for name, types in fields.items():
        value = obj.get(name, getattr(defaults, name))
        if not isinstance(value, types) or isinstance(value, bool):
            raise _format_error(
                path,
                1,
                f"the header's {name!r} is {value!r}, of the wrong type",
                "The file is corrupt; write it again. " + _HOW_TO_WRITE,
            )
        values[name] = value
    capacity = values["capacity_bytes"]
    # c10/core/Device.h DeviceIndex is at most int16_t; a capacity is a 64-bit byte count.
    if not 0 <= values["device"] < 1 << 15 or (capacity is not None and not 0 < capacity < _U64):
        raise _format_error(
            path,
            1,
            f"the header's device {_preview(str(values['device']))} or capacity_bytes "
            f"{_preview(str(capacity))} is out of range (a device index 0 to 32767, a capacity "
            "of 1 byte to 2**64 - 1)",
            "The file is corrupt; write it again. " + _HOW_TO_WRITE,
        )
    return TraceHeader(format_version=version, **values)


def _iter_events(path: Path, stream: IO[str]) -> Iterator[TraceEvent]:
    """Parse event lines lazily; the hot loop of every trace replay, so kept flat."""
    # JSONDecoder.scan_once skips json.loads' type checks and whitespace regex: about twice as
    # fast per line, which dominates reading a million-event trace.
    scan = json.JSONDecoder().scan_once  # type: ignore[attr-defined]
    make_event = TraceEvent
    stacks: dict[int, tuple[Frame, ...]] = {}
    frame_pool: dict[tuple[str, int, str], Frame] = {}
    tag_pool: dict[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]] = {}
    checked_tags: set[tuple[tuple[str, str], ...]] = set()
    lineno = 1
    count = 0
    end_count: int | None = None
    corrupt = "The file is corrupt; write it again. " + _HOW_TO_WRITE
    readline = stream.readline
    try:
        with stream:
            # readline with a limit (not `for line in stream`): a line never grows past
            # MAX_LINE_CHARS in memory, however far a gzip bomb would expand it.
            while line := readline(MAX_LINE_CHARS + 1):
                lineno += 1
                if len(line) > MAX_LINE_CHARS:
                    _check_length(path, lineno, line)
                if end_count is not None:
                    raise _format_error(path, lineno, "data follows the end-of-trace line", corrupt)
                try:
                    obj, end = scan(line, 0)
                    if end != len(line) and not line[end:].isspace():
                        raise ValueError("extra data after the JSON value")
                    action = obj["a"]
                except (ValueError, StopIteration, RecursionError):
                    raise _format_error(
                        path, lineno, f"is not valid JSON ({_preview(line)})", corrupt
                    ) from None
                except (KeyError, TypeError):
                    if isinstance(obj, dict) and "stack" in obj:
                        stack_id, frames = _parse_stack(path, lineno, obj, frame_pool, corrupt)
                        stacks[stack_id] = frames
                        continue
                    if isinstance(obj, dict) and "end" in obj:
                        end_count = obj["end"]
                        if end_count != count or type(end_count) is not int:
                            raise _format_error(
                                path,
                                lineno,
                                f"the end line says {end_count!r} events but {count} were read",
                                corrupt,
                            ) from None
                        continue
                    raise _format_error(
                        path,
                        lineno,
                        f"is not an event, stack or end line ({_preview(line)})",
                        corrupt,
                    ) from None
                try:
                    address = obj["p"]
                    size = obj["s"]
                    stream_id = obj.get("st", 0)
                    time_us = obj.get("t")
                    stack_id = obj.get("f")
                    frames = stacks[stack_id] if stack_id is not None else ()
                    tags = obj.get("g")
                    if tags:
                        key = tuple(map(tuple, tags))
                        tags = tag_pool.setdefault(key, key)
                    else:
                        tags = ()
                except KeyError as exc:
                    raise _format_error(
                        path, lineno, f"the event lacks {exc} or names an unknown stack", corrupt
                    ) from None
                except TypeError:
                    raise _format_error(
                        path,
                        lineno,
                        f"the event has a malformed field ({_preview(line)})",
                        corrupt,
                    ) from None
                if (
                    type(action) is not str
                    or type(address) is not int
                    or type(size) is not int
                    or type(stream_id) is not int
                    or (time_us is not None and type(time_us) is not int)
                ):
                    raise _format_error(
                        path,
                        lineno,
                        f"an event field has the wrong type ({_preview(line)})",
                        corrupt,
                    )
                if not (0 <= address < _U64 and 0 <= size < _U64 and -_U64 < stream_id < _U64) or (
                    time_us is not None and not -_U64 < time_us < _U64
                ):
                    raise _format_error(
                        path,
                        lineno,
                        f"an event's address, size, stream or time is outside 64 bits "
                        f"({_preview(line)})",
                        corrupt,
                    )
                if tags and tags not in checked_tags:
                    if not all(
                        len(t) == 2 and type(t[0]) is str and type(t[1]) is str for t in tags
                    ):
                        raise _format_error(
                            path,
                            lineno,
                            f"the event's tags are not [name, value] strings ({_preview(line)})",
                            corrupt,
                        )
                    checked_tags.add(tags)
                count += 1
                yield make_event(action, address, size, stream_id, time_us, frames, tags)
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as exc:
        raise _format_error(
            path,
            lineno + 1,
            f"cannot be read: the file is truncated or corrupt ({exc})",
            "Write the trace again. " + _HOW_TO_WRITE,
        ) from exc
    if end_count is None:
        raise _format_error(
            path,
            lineno,
            f"the file ends after {count} events without its end-of-trace line, so it was "
            "truncated (or its writer stopped early)",
            "Write the trace again. " + _HOW_TO_WRITE,
        )


def _parse_stack(
    path: Path,
    lineno: int,
    obj: dict[str, Any],
    frame_pool: dict[tuple[str, int, str], Frame],
    corrupt: str,
) -> tuple[int, tuple[Frame, ...]]:
    stack_id = obj["stack"]
    rows = obj.get("frames")
    if type(stack_id) is not int or not isinstance(rows, list):
        raise _format_error(path, lineno, "a stack line is malformed", corrupt)
    frames = []
    for row in rows:
        if (
            not isinstance(row, list)
            or len(row) != 3
            or type(row[0]) is not str
            or type(row[1]) is not int
            or type(row[2]) is not str
        ):
            raise _format_error(
                path, lineno, f"a stack line has a malformed frame {row!r}", corrupt
            )
        key = (row[0], row[1], row[2])
        frame = frame_pool.get(key)
        if frame is None:
            frame = frame_pool[key] = Frame(*key)
        frames.append(frame)
    return stack_id, tuple(frames)


def _preview(line: str, limit: int = 60) -> str:
    text = line.rstrip("\n")
    return repr(text if len(text) <= limit else text[:limit] + "...")

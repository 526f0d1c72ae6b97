"""``load_snapshot``: read any generation of PyTorch memory snapshot into normalised records.

Generations handled (ref §11.2, Appendix A):

- a bare list of segments (``torch.cuda.memory_snapshot()``; ``_snapshot()`` up to 1.13);
- ≈ 2.0 dicts whose blocks carry ``history: [{addr, real_size, frames}]`` and no ``address``;
- dicts with ``device_traces`` (entries with or without ``time_us``), ``allocator_settings``,
  ``external_annotations`` and ``user_metadata``, several devices and streams.

Missing fields get the values older PyTorch implied: block addresses from the segment address
plus the sizes of the blocks before it (blocks tile their segment in address order), a missing
``requested_size`` is the size, a missing stream is 0.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any, NoReturn

from oomkit._files import input_file_error, refuse_special_file
from oomkit.core.snapshot._consistency import trace_contradiction
from oomkit.core.snapshot._drain import TraceDrain
from oomkit.core.snapshot._entry_fields import entry_tags, extras_problem
from oomkit.core.snapshot._validate import (
    layout_problem,
    pool_id_problem,
    settings_problem,
    show,
    trace_problem,
)
from oomkit.core.snapshot.model import Snapshot, SnapshotBlock, SnapshotSegment
from oomkit.core.snapshot.unpickler import (
    HOW_TO_RECORD,
    expansion_error,
    expansion_limit,
    load_plain_pickle,
    looks_like_pickle,
)
from oomkit.core.trace import Frame, TraceEvent, new_trace_event
from oomkit.errors import SnapshotFormatError

__all__ = [
    "READING_FILE",
    "LoadProgress",
    "load_snapshot",
    "looks_like_pickle",
    "snapshot_from_data",
]

# Called with (what is being read, done, total) while a snapshot loads: READING_FILE in bytes,
# then "reading device N's trace" in entries (those not read while the file was: TraceDrain).
LoadProgress = Callable[[str, int, int], None]
READING_FILE = "reading the file"
_PROGRESS_ENTRIES = 1 << 16  # trace entries between two progress calls

# CUDACachingAllocator.cpp kSmallBuffer: small-pool segments are exactly 2 MiB, and no large-pool
# segment is (allocation_size gives 20 MiB or a 2 MiB multiple >= 10 MiB, §2.4, §15.1).
_SMALL_SEGMENT_BYTES = 2 * 2**20

_STATES = {
    "active_allocated": "active_allocated",
    "active_pending_free": "active_pending_free",
    # the docstring's spelling (ref §11.2); PyTorch emits active_pending_free
    "active_awaiting_free": "active_pending_free",
    "inactive": "inactive",
}

_REQUIRED = object()
_ABSENT = object()

# Stacks looked up by the identity of their frame dicts, at most (each holds its dicts alive;
# files whose frame dicts are not shared fill it and then read every stack by value).
_STACK_ID_CACHE_MAX = 20_000


def load_snapshot(
    source: str | os.PathLike[str] | bytes | bytearray, *, progress: LoadProgress | None = None
) -> Snapshot:
    """Read a PyTorch memory snapshot written by ``torch.cuda.memory._dump_snapshot``.

    The pickle is read with an unpickler that refuses every global: a hostile file is refused.

    Args:
        source: the path of the pickle, or its bytes.
        progress: called with (what, done, total) as the load goes on (for a progress bar):
            ``READING_FILE`` in bytes (a file with a framed pickle, as PyTorch writes),
            then ``"reading device N's trace"`` in entries, every 65,536 entries and at the end
            (from where it stands: a framed pickle's first large trace is read with the file).

    Returns:
        The normalised snapshot; ``format_generation`` says which layout the file had.

    Raises:
        SnapshotFormatError: the file is empty, truncated, corrupt, not a pickle, names a
            global, expands to more entries than its size allows (``expansion_limit``), or
            holds something other than a memory snapshot.
        InputFileError: no permission, a directory, EIO, or no regular file (a FIFO...).
    """
    # The cyclic GC finds nothing to collect in a tree of plain data being built, but with
    # millions of new dicts its full passes walk everything built so far, over and over:
    # paused while reading (a 5M-event file loads several times faster).
    paused = gc.isenabled()
    gc.disable()
    try:
        if isinstance(source, (bytes, bytearray)):
            name, label = "<bytes>", None
            normaliser = _Normaliser(name, True, progress, expansion_limit(len(source)))
            drain = TraceDrain(normaliser.read_entries)
            data = load_plain_pickle(bytes(source), name, hook=drain)
        else:
            path = Path(source)
            name = label = str(path)
            refuse_special_file(path, what="snapshot")
            try:
                opened = open(path, "rb")  # noqa: SIM115 - closed by the with below
            except OSError as exc:
                raise input_file_error(path, exc, what="snapshot") from None
            with opened as stream:
                limit = expansion_limit(os.fstat(stream.fileno()).st_size)
                # The tree is this function's own: the drain reads each trace entry as the
                # file is read and empties it, and the normaliser frees the rest once read.
                normaliser = _Normaliser(name, True, progress, limit)
                drain = TraceDrain(normaliser.read_entries)
                in_bytes = None if progress is None else partial(progress, READING_FILE)
                data = load_plain_pickle(stream, name, in_bytes, drain)
        normaliser.streamed = drain.read
        return normaliser.snapshot(data, label)
    finally:
        if paused:
            gc.enable()


def snapshot_from_data(data: Any, *, name: str = "<data>", source: str | None = None) -> Snapshot:
    """Normalise an already unpickled snapshot (``torch.cuda.memory._snapshot()``'s value).

    Args:
        data: the dict (or, for old files, the list of segments).
        name: how to call the input in messages.
        source: recorded as ``Snapshot.source``.

    Raises:
        SnapshotFormatError: ``data`` is not a memory snapshot.
    """
    return _Normaliser(name).snapshot(data, source)


class _Normaliser:
    """One pass over the unpickled tree; interns frames so repeated stacks are shared."""

    def __init__(
        self,
        name: str,
        consume: bool = False,
        progress: LoadProgress | None = None,
        max_entries: int | None = None,
    ) -> None:
        self.name = name
        # Whether the unpickled tree is ours to take apart while it is read (load_snapshot).
        self.consume = consume
        self.progress = progress
        # The expansion bound (expansion_limit; none for data given as is), and what has been
        # counted against it.
        self.max_entries = max_entries
        self._entries_left: float = max_entries if max_entries is not None else float("inf")
        # Trace lists read (in part) while the file was unpickled: TraceDrain.read.
        self.streamed: dict[int, tuple[list, list[TraceEvent]]] = {}
        self.trace_keys: set[str] = set()
        self._frames: dict[tuple[str, int, str], Frame] = {}
        self._stacks: dict[tuple[tuple[str, int, str], ...], tuple[Frame, ...]] = {}
        self._stacks_by_ids: dict[tuple[int, ...], tuple[tuple[Any, ...], tuple[Frame, ...]]] = {}
        self.warnings: list[str] = []
        self._inferred_noted = False
        self.keys_seen: set[str] = set()

    def fail(self, what: str) -> SnapshotFormatError:
        return SnapshotFormatError(
            f"{self.name}: {what}, so this is not a valid memory snapshot. {HOW_TO_RECORD}"
        )

    def expand(self, count: int) -> None:
        """Count ``count`` more entries against the expansion bound; raise past it."""
        self._entries_left -= count
        if self._entries_left < 0:
            raise expansion_error(self.name, self.max_entries or 0)

    # ---------------------------------------------------------------------------- top level

    def snapshot(self, data: Any, source: str | None) -> Snapshot:
        if isinstance(data, list):
            segments_raw, top = data, None
        elif isinstance(data, dict) and isinstance(data.get("segments"), list):
            segments_raw, top = data["segments"], data
            self.note("top", data)
        elif isinstance(data, dict):
            keys = ", ".join(sorted(_key_text(k) for k in list(data)[:20]))[:200] or "none"
            raise self.fail(f"the pickle holds a dict without a 'segments' list (keys: {keys})")
        else:
            raise self.fail(
                f"the pickle holds a {type(data).__name__}, not a dict or list of segments"
            )

        raw_traces = top.get("device_traces") if top is not None else None
        self.expand_up_front(segments_raw, raw_traces)
        has_history = False
        segments = []
        for index, raw in enumerate(segments_raw):
            segment, used_history = self.segment(index, raw)
            has_history = has_history or used_history
            segments.append(segment)

        traces: dict[int, tuple[TraceEvent, ...]] = {}
        settings = annotations = user_metadata = None
        if top is not None:
            if raw_traces is not None:
                if not isinstance(raw_traces, list):
                    raise self.fail("'device_traces' is not a list")
                for device, entries in enumerate(raw_traces):
                    traces[device] = self.checked_trace(device, self.trace(device, entries))
                self.keys_seen.update(f"trace:{key}" for key in self.trace_keys)
            settings = top.get("allocator_settings")
            if settings is not None and not isinstance(settings, dict):
                raise self.fail("'allocator_settings' is not a dict")
            problem = None if settings is None else settings_problem(settings)
            if problem is not None:
                raise self.fail(problem)
            self.note("settings", settings or {})
            annotations = top.get("external_annotations")
            if annotations is not None and not isinstance(annotations, list):
                raise self.fail("'external_annotations' is not a list")
            user_metadata = top.get("user_metadata")
            if user_metadata is not None and not isinstance(user_metadata, dict):
                user_metadata = {"value": user_metadata}

        problem = layout_problem(segments)
        if problem is not None:
            raise self.fail(problem)
        other_actions: set[str] = set()  # the check notes them: Snapshot.other_actions
        for device, events in traces.items():
            contradiction = trace_contradiction(device, events, segments, other_actions)
            if contradiction is not None:
                raise SnapshotFormatError(f"{self.name}: {contradiction}")
        return Snapshot(
            segments=tuple(segments),
            device_traces=traces,
            allocator_settings=settings,
            external_annotations=tuple(a for a in annotations or () if isinstance(a, Mapping)),
            user_metadata=user_metadata,
            format_generation=_generation(top, has_history),
            source=source,
            keys_seen=frozenset(self.keys_seen),
            warnings=tuple(self.warnings),
            other_actions=frozenset(other_actions),
        )

    def expand_up_front(self, segments_raw: list, raw_traces: Any) -> None:
        """Count the segments, blocks and trace entries before reading any (each list's length
        is known): a memo bomb of entries fails at once."""
        count = len(segments_raw)
        for raw in segments_raw:
            blocks = raw.get("blocks") if type(raw) is dict else None
            count += len(blocks) if type(blocks) is list else 0
        if type(raw_traces) is list:
            streamed = self.streamed
            for entries in raw_traces:
                count += 1
                if type(entries) is list:
                    done = streamed.get(id(entries))
                    count += len(entries) + (len(done[1]) if done is not None else 0)
        self.expand(count)

    # ---------------------------------------------------------------------------- segments

    def segment(self, index: int, raw: Any) -> tuple[SnapshotSegment, bool]:
        where = f"segment {index}"
        if not isinstance(raw, dict):
            raise self.fail(f"{where} is a {type(raw).__name__}, not a dict")
        self.note("segment", raw)
        address = self.int_field(raw, "address", where)
        total_size = self.int_field(raw, "total_size", where)
        raw_blocks = raw.get("blocks", [])
        if not isinstance(raw_blocks, list):
            raise self.fail(f"{where}: 'blocks' is not a list")
        blocks = []
        used_history = False
        # Blocks tile their segment in address order (ref §3.1), so an absent address is the
        # segment address plus the sizes of the blocks before it (as _memory_viz computes it).
        next_address = address
        for b_index, b in enumerate(raw_blocks):
            block, had_history = self.block(b, next_address, f"{where} block {b_index}")
            used_history = used_history or had_history
            if "address" not in b and not self._inferred_noted:
                self._inferred_noted = True
                self.warnings.append(
                    "block addresses were not recorded (older PyTorch); inferred from each "
                    "segment's address plus the sizes of the blocks before them"
                )
            blocks.append(block)
            next_address = block.address + block.size
        active = [b for b in blocks if b.state != "inactive"]
        segment_type = raw.get("segment_type")
        if segment_type not in ("small", "large"):
            segment_type = "small" if total_size == _SMALL_SEGMENT_BYTES else "large"
        pool_id = raw.get("segment_pool_id")
        if pool_id is None:
            pool_id = (0, 0)
        problem = pool_id_problem(pool_id, where, "segment_pool_id")
        if problem is not None:
            raise self.fail(problem)
        is_expandable = raw.get("is_expandable", False)
        if is_expandable is None:
            is_expandable = False
        if type(is_expandable) is not bool:
            # PyTorch records a bool; bool('no') would be True, a confident wrong answer.
            raise self.fail(f"{where}: 'is_expandable' is {show(is_expandable)}, not True/False")
        return (
            SnapshotSegment(
                device=self.int_field(raw, "device", where, 0),
                address=address,
                total_size=total_size,
                stream=self.int_field(raw, "stream", where, 0),
                segment_type=segment_type,
                allocated_size=self.int_field(
                    raw,
                    "allocated_size",
                    where,
                    sum(b.size for b in blocks if b.state == "active_allocated"),
                ),
                active_size=self.int_field(raw, "active_size", where, sum(b.size for b in active)),
                requested_size=self.int_field(
                    raw, "requested_size", where, sum(b.requested_size for b in active)
                ),
                is_expandable=is_expandable,
                blocks=tuple(blocks),
                frames=self.frames(raw.get("frames")),
                pool_id=(int(pool_id[0]), int(pool_id[1])),
            ),
            used_history,
        )

    def block(self, raw: Any, implied_address: int, where: str) -> tuple[SnapshotBlock, bool]:
        if not isinstance(raw, dict):
            raise self.fail(f"{where} is a {type(raw).__name__}, not a dict")
        self.note("block", raw)
        size = self.int_field(raw, "size", where)
        history = raw.get("history")
        frames: tuple[Frame, ...] = ()
        requested = raw.get("requested_size")
        if isinstance(history, list) and history and isinstance(history[0], dict):
            # ≈2.0 layout: _memory_viz._block_extra_legacy reads history[0] for the frames and
            # real_size of the block's allocation.
            frames = self.frames(history[0].get("frames"))
            if requested is None:
                requested = history[0].get("real_size")
        else:
            frames = self.frames(raw.get("frames"))
        if requested is None:
            requested = size
        if type(requested) is not int:
            raise self.fail(f"{where}: 'requested_size' is {show(requested)}, not an int")
        state = raw.get("state")
        if state is None and "allocated" in raw:
            # Before `state` existed, blocks said allocated / active as booleans.
            if raw.get("allocated"):
                state = "active_allocated"
            elif raw.get("active"):
                state = "active_pending_free"
            else:
                state = "inactive"
        if type(state) is not str or state not in _STATES:
            raise self.fail(f"{where}: unknown block state {show(state)}")
        return (
            SnapshotBlock(
                address=self.int_field(raw, "address", where, implied_address),
                size=size,
                requested_size=requested,
                state=_STATES[state],
                frames=frames,
            ),
            history is not None,
        )

    # ---------------------------------------------------------------------------- traces

    def trace(self, device: int, entries: Any) -> tuple[TraceEvent, ...]:
        if not isinstance(entries, list):
            raise self.fail(f"device_traces[{device}] is not a list")
        # What TraceDrain read while the file was unpickled comes first; entries holds the rest.
        done = self.streamed.pop(id(entries), None)
        events: list[TraceEvent] = done[1] if done is not None else []
        report = self.progress
        what = f"reading device {device}'s trace"
        total = len(events) + len(entries)
        for start in range(0, len(entries), _PROGRESS_ENTRIES):
            if report is not None:
                report(what, len(events), total)
            stop = min(start + _PROGRESS_ENTRIES, len(entries))
            read = self.read_entries(entries, stop, events, device, start)
            if read < stop - start:
                self._bad_entry(device, len(events), entries[start + read])
        if report is not None:
            report(what, total, total)
        return tuple(events)

    def read_entries(
        self,
        entries: list,
        stop: int,
        events: list[TraceEvent],
        device: int | None = None,
        start: int = 0,
    ) -> int:
        """Read ``entries[start:stop]`` into records appended to ``events``.

        Returns how many were read: all, or those before the first malformed entry (its index
        in the trace is then ``len(events)``). Frees each entry read when the tree is this
        reader's own; with no ``device`` (TraceDrain: the unpickler's memo holds every entry)
        empties it: the dict, and its stack list down to its frames (``_drain.read_stack``).
        """
        append = events.append
        note_keys = self.trace_keys.update
        frames_of = self.frames
        consume = self.consume and device is not None
        empty = self.consume and device is None
        new_event = new_trace_event
        for index in range(start, stop):
            raw = entries[index]
            if type(raw) is not dict:
                return index - start
            note_keys(raw)
            action: Any = raw.get("action")
            # An oom entry records device_free in place of addr (ref §11.2).
            address = raw.get("addr", _ABSENT)
            if address is _ABSENT:
                address = raw.get("device_free")
            size = raw.get("size")
            stream = raw.get("stream")
            # An absent (or None) number reads as 0, as int_field does.
            if address is None:
                address = 0
            if size is None:
                size = 0
            if stream is None:
                stream = 0
            time_us = raw.get("time_us")
            if (
                type(action) is not str
                or type(address) is not int
                or type(size) is not int
                or type(stream) is not int
                or (time_us is not None and type(time_us) is not int)
            ):
                return index - start
            tags: tuple[tuple[str, str], ...] = ()
            if "compile_context" in raw or "user_metadata" in raw or "pool_id" in raw:
                problem = extras_problem(raw, device, len(events))
                if problem is not None:
                    if device is None:  # TraceDrain: the normaliser reads it, and says so
                        return index - start
                    raise self.fail(problem)
                tags = entry_tags(raw)
            frames = raw.get("frames")
            stack = frames_of(frames) if frames else ()
            append(new_event(action, address, size, stream, time_us, stack, tags))
            if consume:
                # load_snapshot's own tree: drop each raw entry once read, so the raw trace and
                # its records are never both held in full (issue 19 item 3).
                entries[index] = None
            elif empty:
                if frames and type(frames) is list:
                    frames[:] = (stack,)
                raw.clear()
        return stop - start

    def checked_trace(self, device: int, events: tuple[TraceEvent, ...]) -> tuple[TraceEvent, ...]:
        """Refuse negative or absurd sizes and addresses (actions and the order of each block's
        entries are checked once the segments are read: ``trace_contradiction``)."""
        problem = trace_problem(device, events)
        if problem is not None:
            raise self.fail(problem)
        return events

    def _bad_entry(self, device: int, index: int, raw: Any) -> NoReturn:
        """Raise the message for the first malformed field of trace entry ``index``."""
        where = f"device_traces[{device}][{index}]"
        if type(raw) is not dict:
            raise self.fail(f"{where} is a {type(raw).__name__}, not a dict")
        if not isinstance(raw.get("action"), str):
            raise self.fail(f"{where} has no 'action' string")
        time_us = raw.get("time_us")
        if time_us is not None and type(time_us) is not int:
            raise self.fail(f"{where}: 'time_us' is {show(time_us)}, not an int")
        address_key = "device_free" if "addr" not in raw and "device_free" in raw else "addr"
        for key in (address_key, "size", "stream"):
            self.int_field(raw, key, where, 0)
        raise self.fail(f"{where} is malformed")

    # ---------------------------------------------------------------------------- helpers

    def note(self, kind: str, raw: dict) -> None:
        """Record which keys the file uses (for infer_torch_version)."""
        seen = self.keys_seen
        for key in raw:
            if type(key) is str:  # PyTorch's keys are; str() of another key may never end
                seen.add(f"{kind}:{key}")

    def int_field(self, raw: dict, key: str, where: str, default: Any = _REQUIRED) -> int:
        value = raw.get(key)
        if value is None:
            if default is _REQUIRED:
                raise self.fail(f"{where} has no {key!r}")
            return default
        if type(value) is not int:
            raise self.fail(f"{where}: {key!r} is {show(value)}, not an int")
        return value

    def frames(self, raw: Any) -> tuple[Frame, ...]:
        if not raw or not isinstance(raw, list):
            return ()
        # expand(len(raw)), inline: this runs once per entry.
        self._entries_left -= len(raw)
        if self._entries_left < 0:
            self.expand(0)
        first = raw[0]
        if type(first) is tuple and (not first or type(first[0]) is Frame):
            return first  # read while the file was unpickled (_drain.read_stack), inline
        # PyTorch pickles each distinct frame dict once and refers to it from every stack (a
        # real 19,136-event file: 607,330 frame references, 629 frame dicts), so a stack of the
        # same dict objects is the same stack: look it up by their ids first. The cache keeps
        # the dicts alive, so an id cannot be reused by another object while it is cached.
        by_ids = self._stacks_by_ids
        ids = tuple(map(id, raw))
        hit = by_ids.get(ids)
        if hit is not None:
            return hit[1]
        stack = self._read_frames(raw)
        if len(by_ids) < _STACK_ID_CACHE_MAX:
            by_ids[ids] = (tuple(raw), stack)
        return stack

    def _read_frames(self, raw: list) -> tuple[Frame, ...]:
        keys: list[tuple[str, int, str]] = []
        append = keys.append
        for f in raw:
            if type(f) is not dict and not isinstance(f, dict):
                continue
            filename = f.get("filename")
            line = f.get("line", 0)
            name = f.get("name")
            # PyTorch records str names and int lines; anything else is shown as unknown
            # (str() of a shared nested list, a memo bomb, may never finish).
            if type(filename) is not str:
                filename = _as_text(filename)
            if type(line) is not int:
                line = 0
            if type(name) is not str:
                name = _as_text(name)
            append((filename, line, name))
        # Stacks repeat (every step allocates from the same places): intern whole stacks by
        # their plain-tuple key, so a repeated stack costs one lookup and no Frame hashing.
        key = tuple(keys)
        stack = self._stacks.get(key)
        if stack is None:
            pool = self._frames
            out = []
            for k in keys:
                frame = pool.get(k)
                if frame is None:
                    frame = pool[k] = Frame(*k)
                out.append(frame)
            stack = self._stacks[key] = tuple(out)
        return stack


def _key_text(key: Any) -> str:
    return key if type(key) is str else show(key)


def _as_text(value: Any) -> str:
    # PyTorch records frame names as str; str() of anything else (a shared nested list) may
    # never finish, so it is shown as unknown.
    return value if type(value) is str else "??"


def _generation(top: dict | None, has_history: bool) -> str:
    if top is None:
        return "list-of-segments"
    if has_history:
        return "segments-with-history"
    if "device_traces" not in top:
        return "segments-dict"
    generation = "device-traces"
    if top.get("allocator_settings") is not None:
        generation += "+settings"
    if "external_annotations" in top:
        generation += "+annotations"
    return generation

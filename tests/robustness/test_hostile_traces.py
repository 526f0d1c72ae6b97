"""Hostile oomkit trace files for `simulate`: gzip bombs, nesting, damage: exit 2, bounded."""

from __future__ import annotations

import gzip
import json
import random
import sys
from pathlib import Path

import pytest

from oomkit.core.trace import TraceEvent, TraceHeader, read_trace, write_trace
from oomkit.core.trace.io import MAX_LINE_CHARS
from oomkit.errors import TraceFormatError
from oomkit.interfaces.cli import main

sys.path.insert(0, str(Path(__file__).parent))
from _hostile_support import MiB, assert_within_bounds, run_bounded  # noqa: E402

HEADER = json.dumps({"format": "oomkit-trace", "version": 1, "source": "synthetic"}) + "\n"
BOMB_BYTES = 64 * MiB  # what each bomb expands to (4x the line bound); files of ~64 KiB


def _bomb(path: Path, prefix: bytes, filler: bytes) -> Path:
    """A gzip file of ``prefix`` then BOMB_BYTES of ``filler`` with no newline, written in chunks."""
    chunk = filler * (MiB // len(filler))
    with gzip.open(path, "wb", compresslevel=6) as out:
        out.write(prefix)
        for _ in range(BOMB_BYTES // len(chunk)):
            out.write(chunk)
    assert path.stat().st_size < 2 * MiB
    return path


BOMBS = {
    "zeros_as_header": (b"", b"\0"),
    "spaces_in_header": (b'{"format": "oomkit-trace", ', b" "),
    "digits_in_event": (HEADER.encode() + b'{"a":"alloc","p":1,"s":', b"9"),
    "brackets_in_event": (HEADER.encode(), b"["),
    "string_in_stack": (HEADER.encode() + b'{"stack":0,"frames":[["', b"a"),
}


def _consume(path: Path) -> int:
    header, events = read_trace(path)
    return sum(1 for _ in events)


@pytest.mark.parametrize("name", sorted(BOMBS))
def test_gzip_bomb_is_refused_within_bounds(tmp_path, name, capsys):
    """A 64 MiB line behind a ~64 KiB gzip: TraceFormatError after at most 16 Mi characters."""
    prefix, filler = BOMBS[name]
    path = _bomb(tmp_path / f"{name}.jsonl.gz", prefix, filler)
    api = run_bounded(lambda: _consume(path))
    assert_within_bounds(api)
    assert isinstance(api.error, TraceFormatError), api.error
    assert f"longer than {MAX_LINE_CHARS:,} characters" in str(api.error)
    cli = run_bounded(lambda: main(["simulate", str(path)]))
    assert_within_bounds(cli)
    assert cli.value == 2
    assert "decompression bomb" in capsys.readouterr().err


def test_many_valid_lines_are_streamed_in_bounded_memory(tmp_path):
    """50,000 events (a large, valid trace): read one at a time, memory stays small."""
    path = tmp_path / "big.jsonl.gz"
    events = (TraceEvent("alloc", 512 * i, 512) for i in range(50_000))
    write_trace(path, events, TraceHeader(format_version=1, source="synthetic"))
    result = run_bounded(lambda: _consume(path))
    assert_within_bounds(result, memory_bytes=8 * MiB)
    assert result.value == 50_000


def _lines(*lines: str) -> str:
    return HEADER + "".join(line + "\n" for line in lines)


END = '{"end":1}'
EVENT = '{"a":"alloc","p":1,"s":512}'
BROKEN = {
    "empty": ("", "the file is empty"),
    "binary": (random.Random(7).randbytes(4096).decode("latin-1"), "oomkit-trace"),
    "not_json_header": ("hello\n", "is not JSON"),
    "other_json_header": ('{"format": "other"}\n', "has no oomkit-trace header"),
    "newer_version": ('{"format": "oomkit-trace", "version": 99}\n', "written by a newer oomkit"),
    "version_string": ('{"format": "oomkit-trace", "version": "1"}\n', "not a positive integer"),
    "deeply_nested_header": ("[" * 200_000 + "\n", "is not JSON"),
    "deeply_nested_event": (_lines("[" * 200_000), "is not valid JSON"),
    "truncated": (_lines(EVENT), "without its end-of-trace line"),
    "negative_count_end": (_lines(EVENT, '{"end":-1}'), "the end line says -1 events"),
    "data_after_end": (_lines(EVENT, END, EVENT), "data follows the end-of-trace line"),
    "size_is_string": (_lines('{"a":"alloc","p":1,"s":"512"}', END), "wrong type"),
    "size_is_float": (_lines('{"a":"alloc","p":1,"s":512.0}', END), "wrong type"),
    "huge_int_digits": (_lines('{"a":"alloc","p":1,"s":' + "9" * 5000 + "}", END), "is not valid JSON"),
    "unknown_stack": (_lines('{"a":"alloc","p":1,"s":512,"f":7}', END), "names an unknown stack"),
    "malformed_frame": (_lines('{"stack":0,"frames":[[1,2,3]]}', END), "malformed frame"),
    "tags_not_pairs": (_lines('{"a":"alloc","p":1,"s":512,"g":[7]}', END), "malformed field"),
    "crlf_then_garbage": (HEADER.replace("\n", "\r\n") + "garbage\r\n", "is not valid JSON"),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_trace_is_exit_2(tmp_path, name, capsys):
    """Damaged, foreign or crafted trace files: TraceFormatError naming the line; exit 2."""
    text, words = BROKEN[name]
    path = tmp_path / f"{name}.jsonl"
    path.write_bytes(text.encode("latin-1") if name == "binary" else text.encode())
    api = run_bounded(lambda: _consume(path))
    assert_within_bounds(api)
    assert isinstance(api.error, TraceFormatError), api.error
    assert words in str(api.error)
    cli = run_bounded(lambda: main(["simulate", str(path)]))
    assert_within_bounds(cli)
    assert cli.value == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"oomkit: error: {path}: line ")


@pytest.mark.parametrize("cut", [10, 30, 60, 100, -30, -5])
def test_gzip_cut_short_is_exit_2(tmp_path, cut, capsys):
    """A .gz file copied in part: a TraceFormatError (truncated or corrupt), exit 2."""
    whole = tmp_path / "whole.jsonl.gz"
    write_trace(
        whole,
        (TraceEvent("alloc", 512 * i, 512) for i in range(2000)),
        TraceHeader(format_version=1, source="synthetic"),
    )
    data = whole.read_bytes()
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(data[:cut])
    result = run_bounded(lambda: main(["simulate", str(path)]))
    assert_within_bounds(result)
    assert result.value == 2
    assert "oomkit: error:" in capsys.readouterr().err


def test_negative_sizes_in_a_trace_are_refused(tmp_path, capsys):
    """An alloc of -512 bytes: the simulator refuses it (exit 2), it does not run backwards."""
    path = tmp_path / "neg.jsonl"
    path.write_text(_lines('{"a":"alloc","p":1,"s":-512}', END))
    result = run_bounded(lambda: main(["simulate", str(path)]))
    assert_within_bounds(result)
    assert result.value == 2
    assert "oomkit: error:" in capsys.readouterr().err

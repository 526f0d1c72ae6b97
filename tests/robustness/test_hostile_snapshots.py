"""Broken and crafted snapshot files: a clear error (exit 2) or the right answer, within bounds."""

from __future__ import annotations

import gzip
import json
import pickle
import random
import struct
import sys
from pathlib import Path

import pytest

from oomkit.core.replay import replay_snapshot
from oomkit.core.snapshot import load_snapshot
from oomkit.errors import SnapshotFormatError
from oomkit.interfaces.cli import main

sys.path.insert(0, str(Path(__file__).parent))
from _hostile_support import (  # noqa: E402
    BASE_ADDRESS,
    MiB,
    assert_within_bounds,
    base_snapshot,
    run_bounded,
)

MARK = "@@HOSTILE@@"
DEPTH = 100_000  # nesting levels, far past Python's recursion limit
DAG_LEVELS = 64  # [a, a] 64 times: 2**64 leaves if walked as a tree


def _splice(data, raw: bytes) -> bytes:
    """Pickle ``data`` (protocol 2) with the string MARK replaced by the opcodes ``raw``."""
    encoded = MARK.encode()
    op = b"X" + struct.pack("<I", len(encoded)) + encoded
    out = pickle.dumps(data, protocol=2)
    assert out.count(op) == 1
    return out.replace(op, raw)


def _deep_list() -> bytes:
    # DEPTH empty lists, then DEPTH-1 APPENDs: each nests the top list into the one below.
    return b"]" * DEPTH + b"a" * (DEPTH - 1)


def _dag(kind: str) -> bytes:
    """A shared nested list (memo bomb): ~12 bytes a level on disk, 2**64 leaves as a tree.

    Memo slot 99999 (LONG_BINPUT / LONG_BINGET), which the surrounding pickle does not use.
    """
    assert kind == "list"
    put, get = b"r" + struct.pack("<I", 99_999), b"j" + struct.pack("<I", 99_999)
    out = b"]X\x01\x00\x00\x00xa" + put + b"0"  # ["x"] into the memo, off the stack
    for _ in range(DAG_LEVELS):
        out += b"](" + get + get + b"e" + put + b"0"  # [previous, previous]
    return out + get


def _with(path: tuple, raw: bytes) -> bytes:
    """The base snapshot with the value at ``path`` replaced by the opcodes ``raw``."""
    data = base_snapshot()
    target = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = MARK
    return _splice(data, raw)


FILENAME = ("segments", 0, "blocks", 0, "frames", 0, "filename")
FUNCTION = ("device_traces", 0, 1, "frames", 0, "name")
TAG = ("device_traces", 0, 1, "user_metadata")
POOL = ("device_traces", 0, 1, "pool_id")
SEG_POOL = ("segments", 0, "segment_pool_id")
METADATA = ("user_metadata",)

# Inputs that must load and replay with the right answer: the base snapshot's figures.
ANSWERED = {
    "deep_list_as_filename": (FILENAME, "deep"),
    "deep_list_as_function": (FUNCTION, "deep"),
    "deep_list_as_metadata": (METADATA, "deep"),
    "memo_bomb_as_filename": (FILENAME, "dag"),
    "memo_bomb_as_function": (FUNCTION, "dag"),
    "memo_bomb_as_metadata": (METADATA, "dag"),
}

# Inputs that must be refused with these words.
REFUSED = {
    "deep_list_as_segments": (("segments",), "deep", "segment 0 is a list, not a dict"),
    "deep_list_as_size": (("segments", 0, "total_size"), "deep", "'total_size' is [[[[...]]]], not an int"),
    "memo_bomb_as_address": (("segments", 0, "address"), "dag", "'address' is [[[[...], [...]], "),
    "memo_bomb_as_state": (("segments", 0, "blocks", 0, "state"), "dag", "unknown block state [["),
    "memo_bomb_as_time": (("device_traces", 0, 1, "time_us"), "dag", "'time_us' is [[[["),
    "memo_bomb_as_requested": (("segments", 0, "blocks", 0, "requested_size"), "dag", "'requested_size' is [[[["),
    # PyTorch records these as strings and pairs of ints (issue 36: not read as "unknown").
    "deep_list_as_tag": (TAG, "deep", "'user_metadata' is [[[[...]]]]; PyTorch records a string"),
    "memo_bomb_as_tag": (TAG, "dag", "'user_metadata' is [[[[...], [...]], "),
    "deep_list_as_pool_id": (POOL, "deep", "'pool_id' is [[[[...]]]]; PyTorch records a pool id"),
    "memo_bomb_as_pool_id": (POOL, "dag", "'pool_id' is [[[[...], [...]], "),
    "memo_bomb_as_segment_pool_id": (SEG_POOL, "dag", "'segment_pool_id' is [[[[...], [...]], "),
    "deep_list_as_compile_context": (
        ("device_traces", 0, 1, "compile_context"),
        "deep",
        "'compile_context' is [[[[...]]]]; PyTorch records a string",
    ),
}


def _raw(kind: str) -> bytes:
    return _deep_list() if kind == "deep" else _dag("list")


def _expect_base_answer(snapshot) -> None:
    result = replay_snapshot(snapshot, verify=True)
    assert (result.peak_reserved_bytes, result.peak_allocated_bytes) == (20 * MiB, 9 * MiB)
    assert (result.segment_events_recorded, result.segment_events_matched) == (1, 1)
    assert result.allocs_checked == 2 and result.reproduced


@pytest.mark.parametrize("name", sorted(ANSWERED))
def test_deep_and_shared_values_still_give_the_right_answer(name):
    """Deep nesting and memo bombs where only plain values belong: shown as '??', replay exact."""
    path, kind = ANSWERED[name]
    data = _with(path, _raw(kind))
    result = run_bounded(lambda: _expect_base_answer(load_snapshot(data)))
    assert_within_bounds(result)
    assert result.error is None, result.error


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_deep_and_shared_values_where_numbers_belong_are_refused(name):
    """A nested list as an address, size, state or time: SnapshotFormatError, shown bounded."""
    path, kind, words = REFUSED[name]
    data = _with(path, _raw(kind))
    result = run_bounded(lambda: load_snapshot(data))
    assert_within_bounds(result)
    assert isinstance(result.error, SnapshotFormatError), result.error
    assert words in str(result.error)
    assert len(str(result.error)) < 1000


def _valid_bytes() -> bytes:
    return pickle.dumps(base_snapshot(), protocol=pickle.HIGHEST_PROTOCOL)


CUTS = [1, 2, 10, 50, 100, 200, 300, 400, 500, 600, -200, -50, -10, -2, -1]


@pytest.mark.parametrize("cut", CUTS)
def test_truncated_snapshot_is_refused(tmp_path, cut):
    """A snapshot cut short anywhere: SnapshotFormatError (truncated or corrupt), never a crash."""
    data = _valid_bytes()
    assert len(data) > 700
    result = run_bounded(lambda: load_snapshot(data[:cut]))
    assert_within_bounds(result)
    assert isinstance(result.error, SnapshotFormatError), result.error
    assert "truncated" in str(result.error)


def _random_bytes(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


GARBAGE = {
    "empty": (b"", "the file is empty"),
    "one_zero_byte": (b"\0", "cannot be read as a memory snapshot"),
    "random_1k": (_random_bytes(1, 1024), "cannot be read as a memory snapshot"),
    "random_1m": (_random_bytes(2, MiB), "cannot be read as a memory snapshot"),
    "zip_archive": (b"PK\x03\x04" + _random_bytes(3, 100), "zip archive (what torch.save writes)"),
    "json_text": (json.dumps({"segments": []}).encode(), "looks like JSON text"),
    "gzipped_snapshot": (gzip.compress(_valid_bytes()), "cannot be read as a memory snapshot"),
    "text_log": (b"RuntimeError: CUDA out of memory.\n", "cannot be read as a memory snapshot"),
    "pickled_int": (pickle.dumps(7), "holds a int"),
    "pickled_string": (pickle.dumps("segments"), "holds a str"),
    "dict_without_segments": (pickle.dumps({"device_traces": []}), "without a 'segments' list"),
    "huge_declared_string": (
        b"\x80\x04\x8d" + struct.pack("<Q", 2**62) + b"abc.",
        "asks for more memory than is available",
    ),
    "huge_declared_frame": (
        b"\x80\x04\x95" + struct.pack("<Q", 2**62) + b"N.",
        "asks for more memory than is available",
    ),
}


@pytest.mark.parametrize("name", sorted(GARBAGE))
def test_not_a_snapshot_is_refused(tmp_path, name, capsys):
    """Empty, binary, zip, JSON, gzip, text, other pickles: exit 2 with what it is and what to do."""
    data, words = GARBAGE[name]
    path = tmp_path / f"{name}.pickle"
    path.write_bytes(data)
    api = run_bounded(lambda: load_snapshot(path))
    assert_within_bounds(api)
    assert isinstance(api.error, SnapshotFormatError), api.error
    assert words in str(api.error) and "_dump_snapshot" in str(api.error)
    cli = run_bounded(lambda: main(["replay", str(path)]))
    assert_within_bounds(cli)
    assert cli.value == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"oomkit: error: {path}: ")


def _edit(change) -> dict:
    data = base_snapshot()
    change(data)
    return data


def _block(data, i=0):
    return data["segments"][0]["blocks"][i]


def _entry(data, i):
    return data["device_traces"][0][i]


A = BASE_ADDRESS
INVALID = {
    "negative_block_size": (lambda d: _block(d).update(size=-5), "block 0 has size -5"),
    "zero_block_size": (lambda d: _block(d).update(size=0), "block 0 has size 0"),
    "negative_total_size": (
        lambda d: d["segments"][0].update(total_size=-20 * MiB),
        f"total_size {-20 * MiB}",
    ),
    "negative_requested": (lambda d: _block(d).update(requested_size=-1), "requested_size -1 < 0"),
    "negative_address": (
        lambda d: d["segments"][0].update(address=-A) or _block(d).update(address=-A),
        "outside the 64-bit address space",
    ),
    "address_past_2_64": (
        lambda d: d["segments"][0].update(address=2**64) or _block(d).update(address=2**64),
        "outside the 64-bit address space",
    ),
    "negative_device": (lambda d: d["segments"][0].update(device=-1), "on device -1"),
    "overlapping_blocks": (lambda d: _block(d, 1).update(address=A + 4 * MiB), "blocks overlap"),
    "block_past_segment_end": (lambda d: _block(d, 1).update(size=16 * MiB), "runs past the segment"),
    "overlapping_segments": (
        lambda d: d["segments"].append(
            {
                "device": 0,
                "address": A + 10 * MiB,
                "total_size": 20 * MiB,
                "stream": 0,
                "blocks": [{"address": A + 10 * MiB, "size": 20 * MiB, "state": "inactive"}],
            }
        ),
        "segments 0 and 1 overlap",
    ),
    "negative_trace_size": (lambda d: _entry(d, 2).update(size=-4), "has size -4"),
    "negative_trace_address": (lambda d: _entry(d, 2).update(addr=-1), "address -1"),
    "size_is_a_float": (lambda d: _entry(d, 2).update(size=4.0), "'size' is 4.0, not an int"),
    "size_is_a_bool": (lambda d: _block(d).update(size=True), "'size' is True, not an int"),
    "state_unknown": (lambda d: _block(d).update(state="zombie"), "unknown block state 'zombie'"),
    "action_not_a_string": (lambda d: _entry(d, 2).update(action=3), "has no 'action' string"),
}


@pytest.mark.parametrize("name", sorted(INVALID))
def test_impossible_memory_is_refused(tmp_path, name, capsys):
    """Negative sizes, overlapping blocks or segments, wrong types: exit 2 naming the rule."""
    change, words = INVALID[name]
    path = tmp_path / "bad.pickle"
    path.write_bytes(pickle.dumps(_edit(change)))
    api = run_bounded(lambda: load_snapshot(path))
    assert_within_bounds(api)
    assert isinstance(api.error, SnapshotFormatError), api.error
    assert words in str(api.error)
    for command in (["replay", "--verify"], ["explain"]):
        cli = run_bounded(lambda c=command: main([c[0], str(path), *c[1:]]))
        assert_within_bounds(cli)
        assert cli.value == 2
        assert words in capsys.readouterr().err


def test_the_base_snapshot_is_answered_exactly():
    """The valid snapshot every hostile case starts from: 20 MiB reserved, 9 MiB peak allocated."""
    result = run_bounded(lambda: _expect_base_answer(load_snapshot(_valid_bytes())))
    assert_within_bounds(result)
    assert result.error is None, result.error

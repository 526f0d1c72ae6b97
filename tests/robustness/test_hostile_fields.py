"""Wrong types and absurd numbers in trace files and monitor logs: exit 2 naming the line and
the field, never a traceback, a wrong figure or invalid JSON (issue 36)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oomkit.core.trace import TraceEvent, TraceHeader, read_trace, write_trace
from oomkit.errors import MonitorLogError, TraceFormatError
from oomkit.runtime._monitor_log import load_monitor_log

sys.path.insert(0, str(Path(__file__).parent))
from _cli_bounds import (  # noqa: E402
    MONITOR_LOG_COMMANDS,
    TRACE_COMMANDS,
    refused_by_every_command,
    run_oomkit,
)
from _hostile_support import assert_within_bounds, run_bounded  # noqa: E402

FEW = settings(
    max_examples=10,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)

# What JSON can hold where a number goes, other than a number in range: strings, lists,
# objects, booleans, Infinity / NaN (Python's json writes and reads them), negative and
# 400-digit numbers.
NOT_A_COUNT = st.one_of(
    st.text(max_size=6),
    st.lists(st.integers(0, 9), max_size=3),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
    st.booleans(),
    st.sampled_from([math.inf, -math.inf, math.nan, 1.5]),
    st.integers(-(2**70), -1),
    st.integers(2**64, 10**400),
)
NOT_SECONDS = st.one_of(
    st.text(max_size=6),
    st.lists(st.integers(0, 9), max_size=3),
    st.sampled_from([math.inf, -math.inf, math.nan, -1.0]),
)


# ------------------------------------------------------------------- monitor logs

HEADER = {"oomkit_monitor": 1, "device": "NVIDIA A100-SXM4-80GB", "capacity_bytes": 80 * 2**30}
RECORD = {
    "step": 1,
    "time_s": 0.5,
    "step_time_s": 0.25,
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
    "rank": 0,
}
RECORD_COUNTS = [k for k, v in RECORD.items() if type(v) is int and k != "rank"]


def _write_log(path: Path, header: dict, records: list[dict]) -> Path:
    lines = [json.dumps(header)] + [json.dumps(r) for r in records]
    # Two records after the damaged one: the damage is never the last line, which the reader
    # treats as a run killed mid-write.
    path.write_text("\n".join([*lines, json.dumps(RECORD), json.dumps(RECORD)]) + "\n")
    return path


def _log_error(path: Path) -> str:
    result = run_bounded(lambda: load_monitor_log(path))
    assert_within_bounds(result)
    assert isinstance(result.error, MonitorLogError), result.error
    return str(result.error)


@FEW
@given(field=st.sampled_from(RECORD_COUNTS), value=NOT_A_COUNT)
def test_a_record_count_that_is_not_a_count_is_refused(tmp_path_factory, field, value):
    """A byte count or counter holding a string, a list, Infinity, a negative or 400-digit
    number: MonitorLogError naming the file, line 2 and the field."""
    path = _write_log(
        tmp_path_factory.mktemp("log") / "run.jsonl", HEADER, [{**RECORD, field: value}]
    )
    text = _log_error(path)
    assert f"{path}:2: {field!r} is " in text and "a whole number" in text
    assert len(text) < 600


@FEW
@given(field=st.sampled_from(["time_s", "step_time_s"]), value=NOT_SECONDS)
def test_a_time_that_is_not_finite_seconds_is_refused(tmp_path_factory, field, value):
    """Infinity, NaN, a string or a negative time: refused naming the field."""
    path = _write_log(
        tmp_path_factory.mktemp("log") / "run.jsonl", HEADER, [{**RECORD, field: value}]
    )
    assert f"{field!r} is " in _log_error(path)


@FEW
@given(
    field=st.sampled_from(["device", "rank", "capacity_bytes"]),
    value=st.one_of(
        st.lists(st.integers(), max_size=2),
        st.dictionaries(st.text(max_size=2), st.integers(), max_size=1),
        st.sampled_from([math.inf, -3]),
    ),
)
def test_a_header_field_of_the_wrong_type_is_refused(tmp_path_factory, field, value):
    """A device name that is a list or a number, a rank or capacity that is not a count: line 1."""
    path = _write_log(
        tmp_path_factory.mktemp("log") / "run.jsonl", {**HEADER, field: value}, [RECORD]
    )
    assert f"{path}:1 (header): {field!r} is " in _log_error(path)


def test_a_gathered_summary_with_a_string_count_is_refused(tmp_path):
    """The ranks line appended by Monitor.gather() is checked as the records are."""
    summary = {"rank": 1, "device": "x", "peak_reserved_bytes": "lots"}
    path = _write_log(tmp_path / "run.jsonl", HEADER, [RECORD, {"oomkit_ranks": [summary]}])
    assert "'peak_reserved_bytes' is \"lots\"" in _log_error(path)


LOG_CASES = {
    "string_bytes": ({**RECORD, "reserved_bytes": "2GiB"}, HEADER, "'reserved_bytes' is \"2GiB\""),
    "list_rank": ({**RECORD, "rank": [0, 1]}, HEADER, "'rank' is [0, 1]"),
    "infinity_peak": (
        {**RECORD, "peak_reserved_bytes": math.inf},
        HEADER,
        "'peak_reserved_bytes' is Infinity",
    ),
    "huge_count": ({**RECORD, "num_ooms": 10**400}, HEADER, "'num_ooms' is a 1329-bit number"),
    "list_device": (RECORD, {**HEADER, "device": ["H100"]}, "'device' is [\"H100\"]"),
}


@pytest.mark.parametrize("name", sorted(LOG_CASES))
def test_every_log_command_exits_2_naming_the_line_and_field(tmp_path, name):
    """report, report --json and diff: exit 2, one line naming the field, the log unchanged;
    never a report (and never invalid JSON from report --json)."""
    record, header, words = LOG_CASES[name]
    path = _write_log(tmp_path / "run.jsonl", header, [record])
    refused_by_every_command(path, MONITOR_LOG_COMMANDS, words, "run.jsonl:")


def test_report_json_is_valid_json_for_every_log_it_accepts(tmp_path):
    """A log the reader accepts gives JSON that a strict parser reads (no Infinity, no NaN)."""
    _write_log(tmp_path / "run.jsonl", HEADER, [RECORD])
    result = run_oomkit(["report", "--json", "run.jsonl"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr

    def strict(token: str) -> float:
        raise ValueError(f"not JSON: {token}")

    data = json.loads(result.stdout, parse_constant=strict)
    assert data["ranks"][0]["peak_reserved_bytes"] == 2**31


# ------------------------------------------------------------------- trace files

EVENT_FIELDS = {"p": "address", "s": "size", "st": "stream", "t": "time"}


def _trace(path: Path, line_edit: dict | None = None, header_edit: dict | None = None) -> Path:
    events = [
        TraceEvent("alloc", 4096, 1024, time_us=1),
        TraceEvent("free_requested", 4096, 1024, time_us=2),
        TraceEvent("free_completed", 4096, 1024, time_us=3),
    ]
    write_trace(path, events, TraceHeader(capacity_bytes=2**30))
    lines = path.read_text().splitlines()
    if header_edit is not None:
        lines[0] = json.dumps({**json.loads(lines[0]), **header_edit})
    if line_edit is not None:
        lines[2] = json.dumps({**json.loads(lines[2]), **line_edit})
    path.write_text("\n".join(lines) + "\n")
    return path


def _trace_error(path: Path) -> str:
    def read() -> int:
        return sum(1 for _ in read_trace(path)[1])

    result = run_bounded(read)
    assert_within_bounds(result)
    assert isinstance(result.error, TraceFormatError), result.error
    return str(result.error)


@FEW
@given(
    key=st.sampled_from(sorted(EVENT_FIELDS)),
    value=st.one_of(
        NOT_A_COUNT.filter(lambda v: not (type(v) is int and v < 0)),
        st.integers(-(2**80), -(2**64)),
    ),
)
def test_an_event_field_out_of_type_or_range_is_refused_at_its_line(tmp_path_factory, key, value):
    """A string, list, Infinity or a number past 64 bits as an event's address, size, stream
    or time: TraceFormatError at line 3, the line shown short."""
    path = _trace(tmp_path_factory.mktemp("trace") / "t.jsonl", line_edit={key: value})
    text = _trace_error(path)
    assert f"{path}: line 3: " in text
    assert len(text) < 600


@FEW
@given(
    tags=st.one_of(
        st.just([[1, 2]]),
        st.just([["only-one"]]),
        st.just("ab"),
        st.lists(st.lists(st.text(max_size=2), min_size=3, max_size=3), min_size=1, max_size=2),
    )
)
def test_tags_that_are_not_string_pairs_are_refused(tmp_path_factory, tags):
    """An event's tags must be [name, value] strings."""
    path = _trace(tmp_path_factory.mktemp("trace") / "t.jsonl", line_edit={"g": tags})
    assert f"{path}: line 3: " in _trace_error(path)


@pytest.mark.parametrize(
    "edit",
    [{"device": -1}, {"device": 2**40}, {"capacity_bytes": 0}, {"capacity_bytes": 2**70}],
)
def test_a_header_out_of_range_is_refused(tmp_path, edit):
    """A negative or 40-bit device index, a zero or 70-bit capacity: line 1."""
    path = _trace(tmp_path / "t.jsonl", header_edit=edit)
    assert f"{path}: line 1: " in _trace_error(path)


TRACE_CASES = {
    "string_size": ({"s": "1024"}, "line 3"),
    "list_address": ({"p": [4096]}, "line 3"),
    "infinite_time": ({"t": math.inf}, "line 3"),
    "size_past_2_64": ({"s": 2**64}, "outside 64 bits"),
    "400_digit_size": ({"s": 10**400}, "line 3"),
}


@pytest.mark.parametrize("name", sorted(TRACE_CASES))
def test_every_trace_command_exits_2_naming_the_line(tmp_path, name):
    """simulate and tune: exit 2, one line naming the line, the trace unchanged."""
    edit, words = TRACE_CASES[name]
    path = _trace(tmp_path / "t.jsonl", line_edit=edit)
    refused_by_every_command(path, TRACE_COMMANDS, words, "t.jsonl")

"""Text from files is printed as written, snapshots in every pickle protocol are snapshots, and
small numeric inputs are refused as PyTorch refuses them (issue 36)."""

from __future__ import annotations

import json
import pickle
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oomkit.core.allocator import AllocatorConfig
from oomkit.core.snapshot import looks_like_pickle
from oomkit.errors import ConfigError, OomkitError

sys.path.insert(0, str(Path(__file__).parent))
from _cli_bounds import SNAPSHOT_COMMANDS, CliResult, digest  # noqa: E402
from _cli_in_process import run_in_process  # noqa: E402
from _hostile_support import base_snapshot  # noqa: E402


def run_oomkit(argv: Sequence[str], *, cwd: Path) -> CliResult:
    """``oomkit *argv`` run in this process in ``cwd`` with ``_cli_bounds.run_oomkit``'s
    environment (``COLUMNS=100``, ``NO_COLOR=1``, stdin empty): these tests are about what is
    printed, not the process boundary, which costs an interpreter start and oomkit's imports."""
    return run_in_process(argv, cwd=cwd, environ={"COLUMNS": "100", "NO_COLOR": "1"})

FEW = settings(
    max_examples=2,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
# What a terminal acts on: C0 controls but newline, DEL, C1 controls (ESC sequences retitle
# the window, clear the screen, ring the bell).
RAW_CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")

HOSTILE_PIECES = [
    "\x1b]0;pwned\x07",
    "\x1b[2J",
    "\x1b[31m",
    "\x9b1m",
    "\r",
    "\x07",
    "[/bogus]",
    "[bold red]",
    "[link=https://x]",
    ":smile:",
    "plain",
]
hostile_text = st.lists(st.sampled_from(HOSTILE_PIECES), min_size=1, max_size=4).map("".join)


def _assert_printed_safely(result) -> None:
    shown = f"{result.argv} rc={result.returncode}\n{result.stderr[-1500:]}"
    assert result.returncode in (0, 1), shown
    assert "Traceback" not in result.stderr and "MarkupError" not in result.stderr, shown
    assert not RAW_CONTROL.search(result.stdout), shown
    assert not RAW_CONTROL.search(result.stderr), shown


def _snapshot_named(text: str) -> dict:
    data = base_snapshot()
    for entry in data["device_traces"][0]:
        for frame in entry.get("frames", ()):
            frame["name"] = text
            frame["filename"] = f"/src/{text}.py"
    for block in data["segments"][0]["blocks"]:
        for frame in block.get("frames", ()):
            frame["name"] = text
    return data


@FEW
@given(text=hostile_text)
def test_frame_names_from_a_snapshot_reach_no_terminal_and_no_markup(tmp_path_factory, text):
    """Escape sequences and rich markup in frame names and files: every snapshot command
    prints them as text (controls as \\xNN), never acting on them or raising MarkupError."""
    folder = tmp_path_factory.mktemp("snap")
    path = folder / "snap.pickle"
    path.write_bytes(pickle.dumps(_snapshot_named(text)))
    before = digest(path)
    for command in SNAPSHOT_COMMANDS:
        _assert_printed_safely(run_oomkit([c.format(path.name) for c in command], cwd=folder))
    assert digest(path) == before


def test_a_frame_name_with_markup_is_printed_literally(tmp_path):
    """explain shows the site `[/bogus][bold]step` exactly so, and ESC as \\x1b."""
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(_snapshot_named("[/bogus][bold]st\x1bep")))
    result = run_oomkit(["explain", "snap.pickle"], cwd=tmp_path)
    _assert_printed_safely(result)
    assert "[/bogus][bold]st\\x1bep" in result.stdout


# A traceback around a shortage with a fragmented cache on an A100 80GB: both the allocator
# setting's and the workload's remedy quote the script the traceback names.
_TRACEBACK = """Traceback (most recent call last):
  File "/home/{text}/train.py", line 3, in <module>
    {text}
  File "/usr/lib/python3.11/site-packages/transformers/trainer.py", line 2241, in train
    return inner_training_loop(
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.91 GiB. GPU 0 has a total \
capacity of 79.25 GiB of which 2.14 GiB is free. Including non-PyTorch memory, this process has \
77.10 GiB memory in use. Of the allocated memory 71.21 GiB is allocated by PyTorch, and 5.37 GiB \
is reserved by PyTorch but unallocated.
""".replace("\\\n", "")


@settings(max_examples=25, deadline=None)
@given(text=hostile_text)
def test_a_script_path_a_traceback_names_is_printed_as_written_in_the_remedies(text):
    """explain TEXT whose traceback names a script, and a source line, holding escapes and
    markup: the remedies' commands quote the path as written (ESC as \\x1b), nothing reaches
    the terminal raw, nothing is styled; a path a carriage return splits names no script."""
    import shlex
    import tempfile

    from oomkit.interfaces.reports._untrusted import controls_shown

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "oom.log").write_text(_TRACEBACK.format(text=text), newline="")
        result = run_oomkit(["explain", "oom.log"], cwd=Path(folder))
    _assert_printed_safely(result)
    quoted = controls_shown(shlex.quote(f"/home/{text}/train.py"))
    if "\r" not in text:
        assert f"python {quoted}\n" in result.stdout, result.stdout
        assert f"oomkit predict {quoted} --gpu a100-80gb -- ARGS" in result.stdout


@FEW
@given(text=hostile_text)
def test_a_device_name_from_a_monitor_log_is_printed_as_written(tmp_path_factory, text):
    """report and diff of a log whose device name holds escapes and markup: printed as text."""
    folder = tmp_path_factory.mktemp("log")
    header = {"oomkit_monitor": 1, "device": text, "capacity_bytes": 2**30}
    record = {
        "step": 1,
        "time_s": 0.1,
        "step_time_s": None,
        "allocated_bytes": 1,
        "reserved_bytes": 2,
        "active_bytes": 1,
        "inactive_split_bytes": 0,
        "peak_allocated_bytes": 1,
        "peak_reserved_bytes": 2,
        "num_alloc_retries": 0,
        "num_ooms": 0,
        "num_device_alloc": 1,
        "num_device_free": 0,
    }
    (folder / "a.jsonl").write_text(json.dumps(header) + "\n" + json.dumps(record) + "\n")
    for argv in (["report", "a.jsonl"], ["diff", "a.jsonl", "a.jsonl"]):
        _assert_printed_safely(run_oomkit(argv, cwd=folder))


def test_a_device_name_is_drawn_as_written_in_the_png(tmp_path):
    """report --png of a device named '$\\frac{$' with an ESC: matplotlib is not asked to
    parse it as mathtext (it would raise); the PNG is written."""
    pytest.importorskip("matplotlib")
    header = {"oomkit_monitor": 1, "device": "$\\frac{$\x1b[2J", "capacity_bytes": 2**30}
    record = {
        "step": 1,
        "time_s": 0.1,
        "step_time_s": None,
        "allocated_bytes": 1,
        "reserved_bytes": 2,
        "active_bytes": 1,
        "inactive_split_bytes": 0,
        "peak_allocated_bytes": 1,
        "peak_reserved_bytes": 2,
        "num_alloc_retries": 0,
        "num_ooms": 0,
        "num_device_alloc": 1,
        "num_device_free": 0,
    }
    (tmp_path / "a.jsonl").write_text(json.dumps(header) + "\n" + json.dumps(record) + "\n")
    result = run_oomkit(["report", "a.jsonl", "--png", "a.png"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-800:]
    assert "Traceback" not in result.stderr
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name", ["run[v2].pickle", "run[bold]x[bogus].pickle", "a\x1b[2Jb.pickle"])
def test_a_file_name_is_printed_as_written(tmp_path, name):
    """replay, tune, doctor and diff print the file's name as it is ([v2] kept, ESC as \\x1b)."""
    path = tmp_path / name
    path.write_bytes(pickle.dumps(base_snapshot()))
    shown = name.replace("\x1b", "\\x1b")
    for argv in (["replay", name], ["tune", name], ["doctor", name], ["diff", name, name]):
        result = run_oomkit(argv, cwd=tmp_path)
        _assert_printed_safely(result)
        assert shown in result.stdout, (argv, result.stdout[:400])


def test_an_error_message_shows_control_characters_escaped():
    """Every OomkitError's text has its control characters as \\xNN (it quotes file data)."""
    error = OomkitError("frame \x1b]0;x\x07 in a.py\nnext line\ttab")
    assert str(error) == "frame \\x1b]0;x\\x07 in a.py\nnext line\ttab"


# ------------------------------------------------------------------- pickle protocols


def _answers_for_protocol(folder: Path, protocol: int) -> list:
    """replay --json and explain --json of the base snapshot pickled with ``protocol``."""
    folder.mkdir()
    (folder / "snap.pickle").write_bytes(pickle.dumps(base_snapshot(), protocol=protocol))
    return [
        run_oomkit(argv, cwd=folder)
        for argv in (["replay", "--json", "snap.pickle"], ["explain", "--json", "snap.pickle"])
    ]


@pytest.fixture(scope="module")
def highest_protocol_answers(tmp_path_factory):
    """The answers for the protocol PyTorch writes, run once for the module: each protocol's
    test compares with them (they were run again by each)."""
    folder = tmp_path_factory.mktemp("highest")
    return _answers_for_protocol(folder / f"p{pickle.HIGHEST_PROTOCOL}", pickle.HIGHEST_PROTOCOL)


@pytest.mark.parametrize("protocol", [0, 1, 2])
def test_a_snapshot_in_any_pickle_protocol_is_a_snapshot(
    tmp_path, protocol, highest_protocol_answers
):
    """Protocols 0 and 1 (text-like pickles) are read as snapshots, with the same answers as
    the protocol PyTorch writes (never 'no CUDA out-of-memory message found')."""
    answers = {
        protocol: _answers_for_protocol(tmp_path / f"p{protocol}", protocol),
        pickle.HIGHEST_PROTOCOL: highest_protocol_answers,
    }
    for got, want in zip(answers[protocol], answers[pickle.HIGHEST_PROTOCOL], strict=True):
        assert got.returncode == want.returncode == 0, got.stderr
        assert json.loads(got.stdout) == json.loads(want.stdout)
    assert json.loads(answers[protocol][0].stdout)["peak_reserved_bytes"] == 20 * 2**20


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    protocol=st.integers(0, pickle.HIGHEST_PROTOCOL),
    data=st.one_of(
        st.dictionaries(st.text(max_size=3), st.integers(), max_size=3),
        st.lists(st.integers(), max_size=3),
    ),
)
def test_looks_like_pickle_knows_every_protocol(protocol, data):
    """A dict or list pickled with any protocol opens like a pickle."""
    assert looks_like_pickle(pickle.dumps(data, protocol=protocol)[:8])


@pytest.mark.parametrize(
    "text", [b"(lpips) loss 0.3", b"(d) done", b"RuntimeError: CUDA", b'{"a": 1}', b"[rank0]:", b""]
)
def test_text_is_not_taken_for_a_pickle(text):
    """Logs, JSON and text that start like protocol 0's MARK are still text."""
    assert not looks_like_pickle(text[:8])


# ------------------------------------------------------------------- numbers PyTorch refuses

# Unicode decimal digits other than ASCII: full-width, Arabic-Indic, Devanagari, Bengali.
OTHER_DIGITS = ["０１２３４５６７８９", "٠١٢٣٤٥٦٧٨٩", "०१२३४५६७८९", "০১২৩৪৫৬৭৮৯"]


@settings(max_examples=20, deadline=None, derandomize=True)
@given(
    digits=st.sampled_from(OTHER_DIGITS),
    value=st.integers(21, 100_000),
    key=st.sampled_from(["max_split_size_mb", "garbage_collection_threshold"]),
)
def test_non_ascii_digits_are_refused_as_stoull_refuses_them(digits, value, key):
    """'max_split_size_mb:１２８': PyTorch's stoull reads no digit (C locale), so it throws;
    oomkit refuses it too instead of reading 128."""
    text = "".join(digits[int(c)] for c in str(value))
    if key == "garbage_collection_threshold":
        text = digits[0] + "." + text
    with pytest.raises(ConfigError, match="is not"):
        AllocatorConfig.parse(f"{key}:{text}")


def test_full_width_digits_in_a_what_if_setting_are_exit_2(tmp_path):
    """replay --what-if with a full-width number: exit 2 naming the value."""
    (tmp_path / "snap.pickle").write_bytes(pickle.dumps(base_snapshot()))
    result = run_oomkit(
        ["replay", "snap.pickle", "--what-if", "max_split_size_mb:１２８"], cwd=tmp_path
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "１２８" in result.stderr


@pytest.mark.parametrize("steps", ["0", "-1", "10000000000000000000000", "1e3"])
def test_demo_refuses_steps_outside_its_range(tmp_path, steps):
    """demo --steps 0 / -1 / absurd / not a whole number: exit 2 naming --steps."""
    result = run_oomkit(["demo", "--steps", steps, "--json"], cwd=tmp_path)
    assert result.returncode == 2, result.stdout[:200]
    assert "Traceback" not in result.stderr and "--steps" in result.stderr

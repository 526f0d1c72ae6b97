"""``oomkit mcp`` under an agent's bad arguments: a tool error each time, and the server lives on.

Before: a call whose command line argparse refused (``replay`` of a missing file) raised
``SystemExit`` inside the server's task group and ended the server; arguments were not checked
against the tool's schema (``replay {}`` was a ``KeyError``); a value could be read as an option
(``{"snapshot": "--help"}``), and ``explain`` of ``-`` would read the protocol's own stdin.
"""

from __future__ import annotations

import io
import json
import os
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oomkit.interfaces.cli.mcp import TOOLS, call_tool

pytest.importorskip("mcp")

SRC = str(Path(__file__).resolve().parents[3] / "src")
# Names the tools know, and values an agent might send: option-like words, stdin's "-",
# wrong types, and paths that are no file.
KEYS = sorted({"input", "snapshot", "source", "a", "b", "gpu", "capacity", "what_if", "verify",
               "measure", "context_overhead", "model", "step", "target", "x", "alloc_conf"})
WORDS = st.sampled_from(["-", "--help", "--json", "-h", "--gpu", "--", ".", "/dev/null",
                         "missing.pickle", "h100", "24GiB", "\x1b[31m", ""])
VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | WORDS | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(WORDS, inner, max_size=2),
    max_leaves=6,
)


class _NoStdin(io.StringIO):
    def read(self, *args, **kwargs):  # the MCP stream: a tool must never read it
        raise AssertionError("a tool read stdin")

    readline = read


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tool=st.sampled_from([t.name for t in TOOLS if t.name not in ("predict", "fit")]),
    arguments=st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=4),
)
def test_any_arguments_are_an_answer_or_one_line(tool, arguments):
    """Whatever the arguments: no exception, no stdin, and a refusal is one ``oomkit`` line."""
    with tempfile.TemporaryDirectory() as empty, pytest.MonkeyPatch.context() as patch:
        patch.chdir(empty)
        patch.setattr(sys, "stdin", _NoStdin())
        code, out, err = call_tool(tool, arguments)
    if code == 2:
        assert out == "" and err.count("\n") == 1 and err.startswith("oomkit"), err
        assert "usage:" not in err and "Traceback" not in err
    else:
        assert code in (0, 1) and json.loads(out)  # the command's JSON


@pytest.mark.parametrize(
    ("tool", "arguments", "message"),
    [
        ("replay", {}, "oomkit: error: replay: snapshot: Field required\n"),
        ("doctor", {"snapshot": 5}, "oomkit: error: doctor: snapshot: Input should be a valid string\n"),
        ("gpus", {"x": 1}, "oomkit: error: gpus: x: Extra inputs are not permitted\n"),
        ("explain", {"input": "-"},
         "oomkit: error: explain: input: give the OOM text itself or a file's path; '-' (stdin) "
         "is the MCP stream\n"),
    ],
)
def test_arguments_off_the_schema_are_named(tool, arguments, message):
    """Checked against the tool's schema before any command line is built."""
    assert call_tool(tool, arguments) == (2, "", message)


@pytest.mark.parametrize("value", ["--help", "-h", "--json"])
def test_a_value_is_never_an_option(tmp_path, value):
    """``{"snapshot": "--help"}`` names a file called --help; it does not print replay's help."""
    code, out, err = call_tool("replay", {"snapshot": value})
    assert (code, out) == (2, "")
    assert err.startswith(f"oomkit replay: error: argument SNAPSHOT: {value}: no such file")
    code, out, err = call_tool("tune", {"source": str(tmp_path), "gpu": value})
    assert code == 2 and "usage:" not in err


async def _session_calls(calls):
    import anyio
    from mcp.client.session import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    params = StdioServerParameters(command=sys.executable, args=["-m", "oomkit", "mcp"],
                                   env={**os.environ, "PYTHONPATH": SRC})
    results = []
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        for name, arguments in calls:
            with anyio.fail_after(60):  # a dead server leaves the client waiting
                results.append(await session.call_tool(name, arguments))
    return results


def test_the_server_lives_through_refused_calls():
    """Over stdio with the SDK's client: each bad call is a tool error, then gpus still answers."""
    import anyio

    calls = [("replay", {"snapshot": "missing.pickle"}), ("replay", {}),
             ("explain", {"input": "-"}), ("diff", {"a": "--help", "b": "x"}), ("gpus", {})]
    results = anyio.run(_session_calls, calls)
    assert [r.is_error for r in results] == [True, True, True, True, False]
    assert "missing.pickle: no such file" in results[0].content[0].text
    assert json.loads(results[-1].content[0].text)["gpus"][0]["name"]


def test_doctor_checks_a_setting_an_agent_gives():
    """doctor's alloc_conf is checked as `oomkit doctor --alloc-conf` checks it: a value torch
    rejects is an error finding (exit 1, the JSON said); one it takes is exit 0."""
    code, out, _ = call_tool("doctor", {"alloc_conf": "expandable_segments:Tru"})
    report = json.loads(out)
    assert (code, report["source"], report["worst"]) == (1, "--alloc-conf", "error")
    code, out, _ = call_tool("doctor", {"alloc_conf": "max_split_size_mb:256"})
    report = json.loads(out)
    assert (code, report["config"]["max_split_size_bytes"]) == (0, 256 * 2**20)

"""One meaning of --gpu everywhere (issue 33 item 4): the device, as predict resolves it (its total
less the CUDA context); --capacity the allocator's own limit, nothing subtracted."""

from __future__ import annotations

import importlib.util
import json
import tempfile
from pathlib import Path

import pytest
from _replay_snapshot import MiB, replay_snapshot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oomkit.core.trace import TraceEvent, TraceHeader, write_trace
from oomkit.interfaces.cli import main
from oomkit.interfaces.cli.mcp import call_tool

GiB = 2**30
# The keys a command's --json gives the device (predict's names).
DEVICE_KEYS = ("gpu", "capacity_bytes", "context_overhead_bytes", "usable_bytes", "cuda_context")
# The smallest request the large pool serves with a segment of its own rounded size
# (CUDACachingAllocator.cpp get_allocation_size: kMinLargeAlloc = 10 MiB, rounded to kRoundLarge
# = 2 MiB above it).
_MIN_LARGE_ALLOC_BYTES = 10 * MiB
_ROUND_LARGE_BYTES = 2 * MiB


def _trace(directory: Path, events: list[TraceEvent]) -> Path:
    path = directory / "t.jsonl"
    write_trace(path, events, TraceHeader(format_version=1, source="synthetic"))
    return path


def _json(capsys, argv: list[str]) -> tuple[int, dict]:
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def _without_device(out: dict) -> dict:
    return {key: value for key, value in out.items() if key not in DEVICE_KEYS}


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="predict needs torch")
@pytest.mark.parametrize("gpu", ["rtx4090", "24GiB"])
def test_predict_and_replay_give_a_gpu_the_same_allocator_limit(tmp_path, capsys, gpu):
    """The same --gpu: the same total, CUDA context (figure and source) and usable bytes in
    predict's --json and replay's."""
    code, predicted = _json(capsys, ["predict", "gpt2-124m", "--batch", "1", "--seq", "32",
                                     "--gpu", gpu, "--no-remedies"])
    assert code == 0
    code, replayed = _json(capsys, ["replay", str(replay_snapshot(tmp_path)), "--gpu", gpu])
    assert code == 0
    for key in ("capacity_bytes", "context_overhead_bytes", "usable_bytes"):
        assert replayed[key] == predicted[key], key
    assert replayed["usable_bytes"] == predicted["target"]["usable_bytes"]
    assert replayed["cuda_context"] == predicted["target"]["cuda_context"]
    assert replayed["gpu"] == predicted["target"]["gpu"] == predicted["gpu"]["name"]
    assert replayed["context_overhead_bytes"] == {"rtx4090": 430 * MiB, "24GiB": 400 * MiB}[gpu]


@pytest.mark.parametrize("command", ["replay", "simulate", "tune", "demo"])
def test_gpu_and_capacity_together_exit_2(tmp_path, capsys, command):
    """--gpu and --capacity both name the device: exit 2, one line saying to choose one."""
    source = {
        "replay": [str(replay_snapshot(tmp_path))],
        "simulate": [str(_trace(tmp_path, [TraceEvent("alloc", 1, MiB)]))],
        "tune": [str(_trace(tmp_path, [TraceEvent("alloc", 1, MiB)]))],
        "demo": [],
    }[command]
    assert main([command, *source, "--gpu", "rtx4090", "--capacity", "24GiB"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.strip().splitlines()
    assert line.startswith(
        "oomkit: error: --gpu 'rtx4090' and --capacity '24GiB' both set the device: choose one."
    )


@pytest.mark.parametrize("command", ["replay", "simulate", "tune", "demo"])
def test_context_overhead_without_gpu_exits_2(tmp_path, capsys, command):
    """--context-overhead is the --gpu device's: alone, or with --capacity, it exits 2."""
    source = {
        "replay": [str(replay_snapshot(tmp_path))],
        "simulate": [str(_trace(tmp_path, [TraceEvent("alloc", 1, MiB)]))],
        "tune": [str(_trace(tmp_path, [TraceEvent("alloc", 1, MiB)]))],
        "demo": [],
    }[command]
    assert main([command, *source, "--capacity", "24GiB", "--context-overhead", "1GiB"]) == 2
    assert "--context-overhead is the memory outside PyTorch on the --gpu device" in (
        capsys.readouterr().err
    )


def test_context_overhead_0_with_a_size_is_the_capacity(tmp_path, capsys):
    """`--gpu 24GiB --context-overhead 0` is `--capacity 24GiB`: the old raw total, for
    replay (what-if and --what-if), simulate, tune and demo."""
    snapshot = str(replay_snapshot(tmp_path))
    trace = str(_trace(tmp_path, [TraceEvent("alloc", 1, 30 * MiB)]))
    for argv in (
        ["replay", snapshot],
        ["replay", snapshot, "--what-if", "", "--what-if", "expandable_segments:True"],
        ["simulate", trace],
        ["tune", trace],
        ["demo", "--steps", "2"],
    ):
        _, raw = _json(capsys, [*argv, "--gpu", "24GiB", "--context-overhead", "0"])
        _, limit = _json(capsys, [*argv, "--capacity", "24GiB"])
        assert _without_device(raw) == _without_device(limit), argv
        assert raw["usable_bytes"] == limit["usable_bytes"] == raw["capacity_bytes"] == 24 * GiB
        assert (raw["gpu"], raw["context_overhead_bytes"]) == ("custom 24.00 GiB", 0)
        assert raw["cuda_context"] == "0 B outside PyTorch, given by the caller"
        assert (limit["gpu"], limit["context_overhead_bytes"], limit["cuda_context"]) == (
            None, 0, None
        )


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    segments=st.integers(_MIN_LARGE_ALLOC_BYTES // _ROUND_LARGE_BYTES, 2**19),
    short=st.booleans(),
)
def test_capacity_limits_the_allocator_to_exactly_that_many_bytes(capsys, segments, short):
    """`--capacity S`: a request of R bytes (its own R-byte segment) and then a 512-byte one (a
    2 MiB small segment) both fit when S = R + 2 MiB, and the second runs out when S is one
    byte less; the JSON says S is what the allocator may reserve. `--gpu S --context-overhead
    0` replays the same."""
    request = segments * _ROUND_LARGE_BYTES
    capacity = request + _ROUND_LARGE_BYTES - (1 if short else 0)
    with tempfile.TemporaryDirectory() as directory:
        trace = str(_trace(Path(directory), [TraceEvent("alloc", 1, request),
                                             TraceEvent("alloc", 2, 512)]))
        code, out = _json(capsys, ["simulate", trace, "--capacity", str(capacity)])
        assert (code, out["oom"]) == ((1, True) if short else (0, False))
        assert out["usable_bytes"] == out["capacity_bytes"] == capacity
        assert out["oom_event_index"] == (1 if short else None)
        assert out["peak_reserved_bytes"] == request + (0 if short else _ROUND_LARGE_BYTES)
        _, raw = _json(capsys, ["simulate", trace, "--gpu", f"{capacity}B",
                                "--context-overhead", "0"])
        assert _without_device(raw) == _without_device(out)


def test_mcp_replay_takes_the_device_as_the_cli(tmp_path):
    """The MCP replay tool's gpu is the device, capacity the allocator's limit, as the flags."""
    snapshot = str(replay_snapshot(tmp_path))
    code, out, _ = call_tool("replay", {"snapshot": snapshot, "gpu": "rtx4090"})
    assert code == 0
    assert json.loads(out)["usable_bytes"] == 25_756_696_576 - 430 * MiB
    code, out, _ = call_tool("replay", {"snapshot": snapshot, "capacity": "320MiB"})
    assert (code, json.loads(out)["usable_bytes"]) == (1, 320 * MiB)
    code, out, err = call_tool("tune", {"source": snapshot, "gpu": "rtx4090", "capacity": "1GiB"})
    assert code == 2 and "choose one" in err


@settings(max_examples=200, deadline=None)
@given(text=st.one_of(st.text(max_size=20), st.from_regex(r"-?\d{1,25}(\.\d{1,3})?\s?[KMGTPE]?i?B?",
                                                          fullmatch=True)))
def test_capacity_is_a_size_or_a_config_error(text):
    """Whatever the text, --capacity gives its exact size (from 1 MiB, or with a unit), or a
    ConfigError naming --capacity: never another exception, never zero."""
    from oomkit.errors import ConfigError
    from oomkit.interfaces.cli._common import capacity_bytes
    from oomkit.units import parse_bytes

    try:
        size = capacity_bytes(text)
    except ConfigError as exc:
        assert "--capacity" in str(exc) or "the allocator's limit must be above zero" in str(exc)
        return
    assert size == parse_bytes(text) > 0


@pytest.mark.parametrize(
    ("overhead", "said"),
    [
        ("24", "'24' has no unit, so it would mean 24 bytes"),
        ("30GiB", "context_overhead_bytes must be >= 0 and below the total (24.00 GiB)"),
        ("-1GiB", "--context-overhead"),
    ],
)
def test_a_bad_context_overhead_exits_2(capsys, overhead, said):
    """A context without a unit, one not below the device's total, or a negative one: exit 2
    (argparse's usage error for what is no size, oomkit's one line for the rest)."""
    argv = ["demo", "--steps", "1", "--gpu", "24GiB", f"--context-overhead={overhead}"]
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err

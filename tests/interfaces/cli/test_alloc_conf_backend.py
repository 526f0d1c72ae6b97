"""backend:cudaMallocAsync is refused (exit 2, what is wrong and what to do) wherever a setting is read."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from oomkit.core.trace import TraceEvent, TraceHeader, write_trace
from oomkit.interfaces.cli import main

sys.path.insert(0, str(Path(__file__).parents[2] / "diagnose"))
from cases.oom_cases import GiB, MiB, Recorder  # noqa: E402


def _trace(tmp_path: Path, settings: str = "") -> Path:
    path = tmp_path / "t.jsonl"
    write_trace(
        path,
        [TraceEvent("alloc", 1, 5 * MiB), TraceEvent("free_requested", 1, 5 * MiB)],
        TraceHeader(format_version=1, source="synthetic", allocator_settings=settings),
    )
    return path


def _snapshot(tmp_path: Path) -> Path:
    recorder = Recorder(capacity_bytes=GiB, outside_bytes=0)
    recorder.alloc(300 * MiB)
    return recorder.write(tmp_path / "s.pickle")


def _refused(capsys) -> str:
    err = capsys.readouterr().err
    assert "backend:cudaMallocAsync, which oomkit does not simulate" in err
    assert "Remove backend:cudaMallocAsync" in err
    return err


def test_simulate_refuses_cudamallocasync_flag(tmp_path, capsys):
    """simulate --alloc-conf backend:cudaMallocAsync: exit 2 with the reason, no replay."""
    assert main(["simulate", str(_trace(tmp_path)), "--alloc-conf", "backend:cudaMallocAsync"]) == 2
    _refused(capsys)


def test_simulate_refuses_cudamallocasync_in_the_trace_header(tmp_path, capsys):
    """A trace recorded under cudaMallocAsync is not replayed as the native allocator."""
    assert main(["simulate", str(_trace(tmp_path, "backend:cudaMallocAsync"))]) == 2
    _refused(capsys)


def test_replay_what_if_refuses_cudamallocasync(tmp_path, capsys):
    """replay --alloc-conf backend:cudaMallocAsync: exit 2."""
    snap = _snapshot(tmp_path)
    assert main(["replay", str(snap), "--alloc-conf", "backend:cudaMallocAsync"]) == 2
    _refused(capsys)


@pytest.mark.parametrize("setting", ["backend:native", "backend:native,max_split_size_mb:128"])
def test_backend_native_is_simulated(tmp_path, capsys, setting):
    """backend:native is accepted (it is the default): the replay runs, 20 MiB reserved."""
    assert main(["simulate", str(_trace(tmp_path)), "--alloc-conf", setting, "--json"]) == 0
    assert '"peak_reserved_bytes": 20971520' in capsys.readouterr().out


def test_api_refuses_cudamallocasync():
    """oomkit.simulate-level API: simulate_events with a cudaMallocAsync record is an OomkitError."""
    from oomkit.core.allocator import AllocatorConfig
    from oomkit.core.replay import simulate_events
    from oomkit.errors import OomkitError

    with pytest.raises(OomkitError, match="does not simulate"):
        simulate_events([TraceEvent("alloc", 1, 10)], AllocatorConfig(backend="cudaMallocAsync"))


@pytest.mark.parametrize("command", ["predict", "fit"])
def test_predict_and_fit_refuse_cudamallocasync_before_any_work(capsys, command):
    """predict/fit --alloc-conf backend:cudaMallocAsync: exit 2 before a model is built."""
    assert main([command, "gpt2-124m", "--alloc-conf", "backend:cudaMallocAsync"]) == 2
    _refused(capsys)


def test_target_refuses_cudamallocasync():
    """Target.resolve (what oomkit.predict(alloc_conf=...) builds) raises ConfigError."""
    from oomkit.core.target import Target
    from oomkit.errors import ConfigError

    with pytest.raises(ConfigError, match="does not simulate"):
        Target.resolve("h100", alloc_conf="backend:cudaMallocAsync")
    assert Target.resolve("h100", alloc_conf="backend:native").allocator_config.backend == "native"

"""oomkit.Monitor on the simulated device: exact bytes per step, peaks per step, counters, the log."""

from __future__ import annotations

import json
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from oomkit.errors import MonitorLogError  # noqa: E402
from oomkit.runtime._nvml import BackgroundSampler  # noqa: E402
from oomkit.runtime.monitor import (  # noqa: E402
    Monitor,
    StepRecord,
    load_monitor_log,
    read_monitor_log,
    summarize,
)

MiB = 2**20


def _clock(start: float = 0.0, tick: float = 0.5):
    """A fake clock: start, start + tick, start + 2 tick, ..."""
    state = {"t": start - tick}

    def now() -> float:
        state["t"] += tick
        return state["t"]

    return now


def _train_setup():
    """Linear(1024, 1024) without bias (4 MiB weight), SGD, a 2 MiB input batch."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(512, 1024)
    return model, opt, x


def _train_step(model, opt, x) -> None:
    loss = model(x).square().sum()
    loss.backward()
    opt.step()
    opt.zero_grad()


def test_training_loop_exact_bytes_per_step(simulated_device):
    """Weight 4 MiB + batch 2 MiB stay; a step peaks at 14 MiB + 1 KiB in a 20 MiB + 2 MiB cache."""
    device = simulated_device("64MiB")
    model, opt, x = _train_setup()
    device.track(model, x)
    with Monitor(get_time=_clock()) as monitor:
        for _ in range(2):
            _train_step(model, opt, x)
            monitor.step()
        monitor.step()  # a step that allocates nothing: its peaks fall back to the levels
    first, second, idle = monitor.records
    for r in (first, second):
        assert r.allocated_bytes == r.active_bytes == 6 * MiB
        # out, out**2, their gradients and the 4 MiB weight gradient on top of the 6 MiB;
        # the 1 KiB: the 512-byte loss scalar and its gradient in the small pool.
        assert r.peak_allocated_bytes == 14 * MiB + 1024
        # One 20 MiB large-pool segment (kLargeBuffer for requests < 10 MiB) + one 2 MiB small one.
        assert r.reserved_bytes == r.peak_reserved_bytes == 22 * MiB
        assert r.inactive_split_bytes == 14 * MiB  # the free tail of the split 20 MiB segment
        assert r.largest_free_block_bytes == 14 * MiB
        assert (r.num_device_alloc, r.num_device_free) == (2, 0)
        assert (r.num_alloc_retries, r.num_ooms) == (0, 0)
        assert r.device_used_bytes is None and r.rank is None
    assert idle.peak_allocated_bytes == 6 * MiB
    assert idle.peak_reserved_bytes == 22 * MiB
    assert [r.step for r in monitor.records] == [1, 2, 3]
    assert [r.time_s for r in monitor.records] == [0.5, 1.0, 1.5]
    assert [r.step_time_s for r in monitor.records] == [None, 0.5, 0.5]


def test_empty_cache_shows_in_reserved_and_device_free_count(simulated_device):
    """After empty_cache the 2 MiB small segment and the 20 MiB one (unused) go back: 2 frees."""
    device = simulated_device("64MiB")
    model, opt, x = _train_setup()
    device.track(model, x)
    with Monitor() as monitor:
        _train_step(model, opt, x)
        monitor.step()
        del model, opt, x
        device.empty_cache()
        record = monitor.step()
    assert (record.allocated_bytes, record.reserved_bytes) == (0, 0)
    assert (record.num_device_alloc, record.num_device_free) == (2, 2)
    assert record.peak_reserved_bytes == 22 * MiB  # the reset happened before the frees


def test_retry_and_oom_counters(simulated_device):
    """24 MiB device: a 16 MiB request over a cached 12 MiB segment retries once; 40 MiB OOMs."""
    device = simulated_device("24MiB")
    with Monitor() as monitor:
        a = torch.empty(12 * MiB, dtype=torch.uint8)
        del a
        b = torch.empty(16 * MiB, dtype=torch.uint8)
        first = monitor.step()
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(40 * MiB, dtype=torch.uint8)
        second = monitor.step()
        del b
    assert (first.num_alloc_retries, first.num_ooms) == (1, 0)
    # 12 MiB segment allocated, then freed on the retry, then the 16 MiB one.
    assert (first.num_device_alloc, first.num_device_free) == (2, 1)
    assert first.peak_reserved_bytes == 16 * MiB and first.reserved_bytes == 16 * MiB
    assert (second.num_alloc_retries, second.num_ooms) == (2, 1)
    assert device.oom_count == 1


def test_every_records_each_nth_step_with_mean_step_time(simulated_device):
    """every=3: records at steps 0, 3, 6; step time is the mean over the 3 steps between."""
    simulated_device("64MiB")
    times = iter([0.0, 1.0, 4.0, 10.0])
    with Monitor(every=3, get_time=lambda: next(times)) as monitor:
        returned = [monitor.step() for _ in range(7)]
    assert [r is None for r in returned] == [False, True, True, False, True, True, False]
    assert [r.step for r in monitor.records] == [1, 4, 7]
    assert [r.step_time_s for r in monitor.records] == [None, 1.0, 2.0]


def test_every_must_be_positive():
    """every=0 is refused with an example."""
    with pytest.raises(ValueError, match="every=10"):
        Monitor(every=0)


def test_auto_step_counts_optimizer_steps_of_the_first_optimizer(simulated_device):
    """auto_step: each opt.step() records once; a second optimizer does not double-count."""
    simulated_device("64MiB")
    model, opt, x = _train_setup()
    other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(4))], lr=0.1)
    with Monitor(auto_step=True) as monitor:
        for _ in range(3):
            _train_step(model, opt, x)
            other.step()
    opt.step()  # after the with block: the hook is gone
    assert [r.step for r in monitor.records] == [1, 2, 3]


def test_sink_gets_every_record_and_a_failing_sink_is_dropped_once(simulated_device, caplog):
    """The sink sees each record; one that raises is logged once and not called again."""
    simulated_device("64MiB")
    seen = []
    with Monitor(sink=seen.append) as monitor:
        monitor.step()
        monitor.step()
    assert seen == monitor.records and len(seen) == 2

    calls = []

    def broken(record):
        calls.append(record.step)
        raise RuntimeError("terminal closed")

    with caplog.at_level(logging.WARNING, logger="oomkit.runtime.monitor"):
        with Monitor(sink=broken) as monitor:
            monitor.step()
            monitor.step()
    assert calls == [1]  # the first step, counted from 1
    assert len(monitor.records) == 2
    assert monitor.unavailable == ["the live display failed (RuntimeError: terminal closed)"]
    assert len([r for r in caplog.records if "live display" in r.getMessage()]) == 1


def test_jsonl_round_trip(simulated_device, tmp_path):
    """The log holds the header then one line per record, and reads back equal."""
    device = simulated_device("64MiB", alloc_conf="expandable_segments:True")
    model, opt, x = _train_setup()
    path = tmp_path / "logs" / "mem_{rank}.jsonl"
    with Monitor(log_path=path, get_time=_clock()) as monitor:
        for _ in range(3):
            _train_step(model, opt, x)
            monitor.step()
    assert monitor.log_path == tmp_path / "logs" / "mem_0.jsonl"
    lines = monitor.log_path.read_text().splitlines()
    assert len(lines) == 4
    header, records = read_monitor_log(monitor.log_path)
    assert header["oomkit_monitor"] == 1
    assert header["device"] == device.name == "simulated custom 64.00 MiB"
    assert header["capacity_bytes"] == 64 * MiB
    assert header["rank"] is None
    assert header["alloc_conf"] == "expandable_segments:True"
    assert isinstance(header["started_unix_s"], float)
    assert records == monitor.records


def test_truncated_last_line_is_dropped(simulated_device, tmp_path):
    """A run killed mid-write: the half line is dropped, the complete records are kept."""
    simulated_device("64MiB")
    path = tmp_path / "mem.jsonl"
    with Monitor(log_path=path) as monitor:
        for _ in range(3):
            monitor.step()
    text = path.read_text()
    path.write_text(text[: len(text) - 25])
    log = load_monitor_log(path)
    assert log.truncated
    assert list(log.records) == monitor.records[:2]


def test_damaged_middle_line_and_non_log_are_errors(tmp_path):
    """A damaged line before the last, or a file without the header, raises MonitorLogError."""
    path = tmp_path / "mem.jsonl"
    path.write_text('{"oomkit_monitor": 1, "device": "x"}\n{"step": \n{}\n')
    with pytest.raises(MonitorLogError, match=r"mem.jsonl:2: damaged line"):
        load_monitor_log(path)
    path.write_text('{"hello": 1}\n')
    with pytest.raises(MonitorLogError, match="not an oomkit monitor log"):
        load_monitor_log(path)


def test_device_used_from_a_provider_read_in_the_background(simulated_device):
    """A device_used provider is read off-thread; each record holds the latest read value."""
    simulated_device("64MiB")
    values = iter([100, 200, 300, 400])
    with Monitor(device_used=lambda: next(values)) as monitor:
        first = monitor.step()  # the value read at start
        monitor._sampler.flush()
        second = monitor.step()
        monitor._sampler.flush()
    assert (first.device_used_bytes, second.device_used_bytes) == (100, 200)


def test_failing_provider_is_reported_once(simulated_device, caplog):
    """A provider that raises at start: None in every record, one warning."""
    simulated_device("64MiB")

    def broken() -> int:
        raise OSError("driver gone")

    with caplog.at_level(logging.WARNING, logger="oomkit.runtime.monitor"):
        with Monitor(device_used=broken) as monitor:
            records = [monitor.step() for _ in range(3)]
    assert [r.device_used_bytes for r in records] == [None, None, None]
    assert monitor.unavailable == ["device-level used memory: OSError: driver gone"]
    assert len(caplog.records) == 1


def test_background_sampler_stops_on_error():
    """A read that fails later sets error and latest to None; requests then do nothing."""
    calls = iter([5, ValueError("boom")])

    def read() -> int:
        value = next(calls)
        if isinstance(value, Exception):
            raise value
        return value

    sampler = BackgroundSampler(read)
    assert sampler.latest == 5
    sampler.request()
    sampler.flush()
    assert sampler.latest is None and sampler.error == "ValueError: boom"
    sampler.request()
    sampler.close()


def test_step_without_with_starts_the_monitor(simulated_device):
    """step() before start() starts it; close() twice is fine."""
    simulated_device("64MiB")
    monitor = Monitor()
    assert monitor.step().step == 1
    monitor.close()
    monitor.close()


_counts = st.integers(min_value=0, max_value=2**40)


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.tuples(_counts, _counts, _counts, st.one_of(st.none(), _counts)), min_size=1, max_size=8
    )
)
def test_summary_is_the_worst_of_the_records(levels):
    """summarize: peaks are the max over records, counters come from the last record."""
    records = [
        StepRecord(
            step=i,
            time_s=float(i),
            step_time_s=None if i == 0 else 1.0,
            allocated_bytes=a,
            reserved_bytes=r,
            active_bytes=a,
            inactive_split_bytes=s,
            peak_allocated_bytes=a,
            peak_reserved_bytes=r,
            num_alloc_retries=i,
            num_ooms=0,
            num_device_alloc=i,
            num_device_free=0,
            device_used_bytes=u,
        )
        for i, (a, r, s, u) in enumerate(levels)
    ]
    summary = summarize({"device": "d", "rank": 3}, records)
    assert summary.peak_allocated_bytes == max(x[0] for x in levels)
    assert summary.peak_reserved_bytes == max(x[1] for x in levels)
    assert summary.max_inactive_split_bytes == max(x[2] for x in levels)
    used = [x[3] for x in levels if x[3] is not None]
    assert summary.max_device_used_bytes == (max(used) if used else None)
    assert summary.num_alloc_retries == len(levels) - 1
    assert summary.rank == 3 and summary.steps == len(levels)
    assert summary.mean_step_time_s == (1.0 if len(levels) > 1 else None)
    assert [StepRecord.from_json(json.loads(json.dumps(r.to_json()))) for r in records] == records


def _leaky_loop(monitor, model, opt, x, steps, kept):
    for _ in range(steps):
        out = model(x)  # SITE: the leaked storage is allocated here
        out.square().mean().backward()
        opt.step()
        opt.zero_grad()
        kept.append(out.detach())  # each step's 256 KiB output is kept (shares its storage)
        monitor.step()


def test_findings_name_the_leaking_line(simulated_device):
    """Outputs kept in a list: a leak of 256 KiB per step, attributed to where they were made."""
    import inspect

    simulated_device("64MiB", record_history=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(256, 256)
    kept: list = []
    with Monitor() as monitor:
        _leaky_loop(monitor, model, opt, x, 14, kept)
    (leak,) = [f for f in monitor.findings if type(f).__name__ == "LeakFinding"]
    assert leak.growth_bytes_per_step == 256 * 1024
    lines, start = inspect.getsourcelines(_leaky_loop)
    leak_line = start + next(i for i, text in enumerate(lines) if "# SITE" in text)
    assert (leak.sites[0].line, leak.sites[0].function) == (leak_line, "_leaky_loop")
    with Monitor(detect_leaks=False) as quiet:
        _leaky_loop(quiet, model, opt, x, 14, kept)
    assert [type(f).__name__ for f in quiet.findings if type(f).__name__ == "LeakFinding"] == []


def test_clean_loop_has_no_leak_finding(simulated_device):
    """The same loop without keeping outputs: no leak."""
    simulated_device("64MiB", record_history=True)
    model, opt, x = _train_setup()
    with Monitor() as monitor:
        for _ in range(14):
            _train_step(model, opt, x)
            monitor.step()
    assert [type(f).__name__ for f in monitor.findings if type(f).__name__ == "LeakFinding"] == []


class _FakeNvml:
    """A stand-in for the pynvml module: device 0 uses 5 GiB, then 6 GiB."""

    def __init__(self) -> None:
        self.used = iter([5 * 2**30, 5 * 2**30, 6 * 2**30])
        self.shutdowns = 0

    def nvmlInit(self):  # noqa: N802 - pynvml's names
        pass

    def nvmlDeviceGetHandleByIndex(self, index):  # noqa: N802
        return ("handle", index)

    def nvmlDeviceGetHandleByUUID(self, uuid):  # noqa: N802
        raise AssertionError("no UUID without CUDA")

    def nvmlDeviceGetMemoryInfo(self, handle):  # noqa: N802
        from types import SimpleNamespace

        return SimpleNamespace(used=next(self.used))

    def nvmlShutdown(self):  # noqa: N802
        self.shutdowns += 1


def _fake_cuda_device():
    """A TorchCudaDevice whose torch.cuda answers from a dict (no GPU needed)."""
    from types import SimpleNamespace

    from oomkit.runtime.device import TorchCudaDevice

    stats = {"allocated_bytes.all.current": 3 * MiB, "reserved_bytes.all.current": 4 * MiB}
    device = TorchCudaDevice.__new__(TorchCudaDevice)
    device.index, device.name = 0, "cuda:0"
    device._torch = SimpleNamespace(
        cuda=SimpleNamespace(
            memory_stats=lambda i: stats,
            reset_peak_memory_stats=lambda i: None,
            mem_get_info=lambda i: (0, 80 * 2**30),
        )
    )
    return device


def test_auto_reads_nvml_for_a_cuda_device(monkeypatch):
    """device_used="auto" on a CUDA device opens NVML (by index here) and closes it at the end."""
    import sys

    nvml = _FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    with Monitor(device=_fake_cuda_device()) as monitor:
        first = monitor.step()
        monitor._sampler.flush()
        second = monitor.step()
    assert (first.allocated_bytes, first.reserved_bytes) == (3 * MiB, 4 * MiB)
    assert (first.device_used_bytes, second.device_used_bytes) == (5 * 2**30, 6 * 2**30)
    assert nvml.shutdowns == 1 and monitor.unavailable == []


def test_auto_without_nvidia_ml_py_says_so_once(monkeypatch, caplog):
    """No pynvml: device_used_bytes is None and the reason is recorded once, at INFO level."""
    import sys

    monkeypatch.setitem(sys.modules, "pynvml", None)
    with caplog.at_level(logging.INFO, logger="oomkit.runtime.monitor"):
        with Monitor(device=_fake_cuda_device()) as monitor:
            records = [monitor.step() for _ in range(3)]
    assert [r.device_used_bytes for r in records] == [None, None, None]
    assert monitor.unavailable == [
        "device-level used memory: nvidia-ml-py is not installed (pip install nvidia-ml-py)"
    ]
    assert [r.levelname for r in caplog.records] == ["INFO"]
    assert monitor.header["unavailable"] == monitor.unavailable


def test_gather_without_distributed_is_this_process(simulated_device, tmp_path):
    """No process group: gather() returns [own summary] and writes nothing to the log."""
    simulated_device("64MiB")
    with Monitor(log_path=tmp_path / "m.jsonl") as monitor:
        monitor.step()
        (summary,) = monitor.gather()
    assert summary == monitor.summary() and summary.rank is None and summary.steps == 1
    assert load_monitor_log(tmp_path / "m.jsonl").rank_summaries == ()

"""Tests for oomkit.runtime.experiment: trials of a script per allocator setting."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import oomkit.runtime.experiment as experiment
from oomkit.errors import OomkitError
from oomkit.runtime.experiment import (
    Trial,
    parse_configs,
    recommend,
    run_experiment,
    run_trial,
    summarize_log,
    visible_gpus,
)
from oomkit.runtime.monitor import StepRecord

MiB = 2**20

# Each step frees a buffer 2 MiB smaller than the next one needs: under the default setting
# every request gets a new segment (20, 22, ... 30 MiB, plus the 2 MiB small-pool segment of the
# parameter: 152 MiB reserved after 6 steps); expandable_segments:True grows one segment instead.
# First it writes NAME.start ({"gpu": CUDA_VISIBLE_DEVICES}) into argv[1], NAME the setting's key
# ("baseline" without one): the GPU each trial saw (no allocation; the peaks do not change).
FRAGMENTING = """
import json, os, sys, time
import torch
name = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").split(":")[0] or "baseline"
with open(os.path.join(sys.argv[1], name + ".start"), "w") as out:
    json.dump({"gpu": os.environ.get("CUDA_VISIBLE_DEVICES")}, out)
p = torch.nn.Parameter(torch.zeros(256))
opt = torch.optim.SGD([p], lr=0.1)
for i in range(100):
    x = torch.empty((20 + 2 * i) * 2**20, dtype=torch.uint8)
    del x
    p.grad = torch.ones(256)
    time.sleep(0.03)
    opt.step()
"""
DEFAULT_PEAK_RESERVED = 159383552  # 152 MiB: the simulator's reserved_bytes.all.peak
EXPANDABLE_PEAK_RESERVED = 44040192  # 42 MiB

# 1 MiB per step until step 3 asks for 2 GiB of a 1 GiB device.
OOM_AT_STEP_3 = """
import torch
p = torch.nn.Parameter(torch.zeros(256))
opt = torch.optim.SGD([p], lr=0.1)
for i in range(10):
    x = torch.empty(2**31 if i == 3 else 2**20, dtype=torch.uint8)
    p.grad = torch.ones(256)
    opt.step()
"""

CRASH_AT_STEP_2 = """
import torch
p = torch.nn.Parameter(torch.zeros(256))
opt = torch.optim.SGD([p], lr=0.1)
for i in range(10):
    if i == 2:
        raise ValueError("boom at step 2")
    p.grad = torch.ones(256)
    opt.step()
"""

ENDS_AFTER_3_STEPS = """
import torch
p = torch.nn.Parameter(torch.zeros(256))
opt = torch.optim.SGD([p], lr=0.1)
for i in range(3):
    p.grad = torch.ones(256)
    opt.step()
"""

# One step, then a child process of its own and a sleep that never ends.
HANGS = """
import subprocess, sys, time
import torch
p = torch.nn.Parameter(torch.zeros(256))
opt = torch.optim.SGD([p], lr=0.1)
p.grad = torch.ones(256)
opt.step()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(120)
"""


@pytest.fixture
def sim_env(monkeypatch):
    """The environment of a trial on a simulated 1 GiB GPU, without allocator settings."""
    monkeypatch.setenv("OOMKIT_RUN_SIMULATED_GPU", "1GiB")
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    return dict(os.environ)


def _script(tmp_path: Path, text: str, name: str = "train.py") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _record(step, *, step_time_s, reserved, allocated, inactive_split, peak_reserved=0):
    return StepRecord(
        step=step,
        time_s=float(step),
        step_time_s=step_time_s,
        allocated_bytes=allocated,
        reserved_bytes=reserved,
        active_bytes=allocated,
        inactive_split_bytes=inactive_split,
        peak_allocated_bytes=allocated,
        peak_reserved_bytes=peak_reserved,
        num_alloc_retries=step,
        num_ooms=0,
        num_device_alloc=10 + step,
        num_device_free=0,
    )


def _trial(conf, peak, steps_per_s, *, status="completed", baseline=False):
    return Trial(
        alloc_conf=conf,
        baseline=baseline,
        status=status,
        steps=5,
        peak_reserved_bytes=peak,
        steps_per_s=steps_per_s,
    )


# ------------------------------------------------------------------ pure parts


def test_parse_configs_skips_comments_and_blanks():
    """One setting per line; `#` comments (whole or trailing) and blank lines are dropped."""
    text = "# candidates\nexpandable_segments:True\n\n  max_split_size_mb:128  # small\ndefault\n"
    assert parse_configs(text) == ["expandable_segments:True", "max_split_size_mb:128", ""]


def test_summarize_log_peak_fragmentation_and_throughput():
    """Peak is the max over records; fragmentation the worst split share; steps/s skips step 0."""
    records = [
        _record(
            0,
            step_time_s=None,
            reserved=100 * MiB,
            allocated=60 * MiB,
            inactive_split=10 * MiB,
            peak_reserved=120 * MiB,
        ),
        _record(
            1,
            step_time_s=0.5,
            reserved=100 * MiB,
            allocated=80 * MiB,
            inactive_split=15 * MiB,
            peak_reserved=110 * MiB,
        ),
        _record(
            2,
            step_time_s=0.25,
            reserved=90 * MiB,
            allocated=50 * MiB,
            inactive_split=4 * MiB,
            peak_reserved=95 * MiB,
        ),
    ]
    summary = summarize_log(records)
    assert summary["steps"] == 3
    assert summary["peak_reserved_bytes"] == 120 * MiB
    assert summary["peak_allocated_bytes"] == 80 * MiB
    assert summary["max_inactive_split_bytes"] == 15 * MiB
    assert summary["fragmentation"] == 0.75  # 15 MiB of the 20 MiB unallocated at step 1
    assert summary["steps_per_s"] == 2 / 0.75
    assert summary["alloc_retries"] == 2
    assert summary["device_allocs"] == 12


def test_summarize_log_without_records():
    """A child that died before its first step has no measurements."""
    assert summarize_log([]) == {"steps": 0}


def test_recommend_skips_a_setting_more_than_5_percent_slower():
    """The lowest peak wins only among settings within 5% of the baseline's steps/s."""
    trials = [
        _trial("", 100 * MiB, 10.0, baseline=True),
        _trial("expandable_segments:True", 60 * MiB, 9.4),  # 6% slower: out
        _trial("max_split_size_mb:128", 80 * MiB, 9.6),  # 4% slower: in
    ]
    best, reason = recommend(trials)
    assert best is trials[2]
    assert reason == (
        "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128 reserves 20.00 MiB (20%) less at peak than "
        "the baseline at -4% steps/s (within the 5% allowed)"
    )


def test_recommend_keeps_the_baseline_and_names_the_slower_setting():
    """When every saving costs too much speed, the baseline is kept and the reason says why."""
    trials = [
        _trial("", 100 * MiB, 10.0, baseline=True),
        _trial("expandable_segments:True", 60 * MiB, 5.0),
    ]
    best, reason = recommend(trials)
    assert best is trials[0]
    assert reason == (
        "keep PyTorch's default setting: no other setting reserved less at peak without being "
        "more than 5% slower (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True was slower)"
    )


def test_recommend_after_a_baseline_oom():
    """A baseline that ran out of memory cannot be compared on speed: the lowest peak wins."""
    base = Trial(alloc_conf="", baseline=True, status="oom", steps=3, oom_step=3)
    trials = [base, _trial("a:1", 90 * MiB, 1.0), _trial("b:1", 70 * MiB, 0.5)]
    best, reason = recommend(trials)
    assert best is trials[2]
    assert reason.startswith(
        "the baseline ran out of memory at step 3; PYTORCH_CUDA_ALLOC_CONF=b:1"
    )


def test_recommend_nothing_when_no_trial_completed():
    """No completed trial: no recommendation."""
    trials = [Trial(alloc_conf="", baseline=True, status="timeout")]
    assert recommend(trials) == (None, "no trial completed; see the errors above")


@settings(max_examples=200, deadline=None)
@given(
    base=st.tuples(st.integers(1, 10**9), st.floats(0.1, 100.0)),
    others=st.lists(st.tuples(st.integers(1, 10**9), st.floats(0.1, 100.0)), max_size=6),
)
def test_recommend_is_the_lowest_peak_within_the_slowdown(base, others):
    """The pick is never >5% slower than the baseline and no eligible trial reserves less."""
    trials = [_trial("", base[0], base[1], baseline=True)]
    trials += [_trial(f"k:{i}", peak, speed) for i, (peak, speed) in enumerate(others)]
    best, _ = recommend(trials)
    assert best is not None
    assert best.steps_per_s >= base[1] * 0.95
    eligible = [t for t in trials if t.steps_per_s >= base[1] * 0.95]
    assert best.peak_reserved_bytes == min(t.peak_reserved_bytes for t in eligible)


# ------------------------------------------------------------------ trials in child processes


@pytest.fixture(scope="module")
def fragmenting_on_one_gpu(tmp_path_factory):
    """The fragmenting script's experiment on one visible GPU (``CUDA_VISIBLE_DEVICES=7``),
    run once for the two tests that read it (each trial is a child Python: 2-3 s of CPU): its
    result, the progress calls and the folder of the trials' GPU marks."""
    tmp_path = tmp_path_factory.mktemp("fragmenting")
    marks = tmp_path / "marks"
    marks.mkdir()
    env = {**os.environ, "OOMKIT_RUN_SIMULATED_GPU": "1GiB", "CUDA_VISIBLE_DEVICES": "7"}
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        env.pop(name, None)
    seen = []
    result = run_experiment(
        sys.executable,
        [_script(tmp_path, FRAGMENTING), str(marks)],
        ["expandable_segments:True", "expandable_segments:True", "max_split_size_mb:10"],
        steps=6,
        timeout_s=60,
        environ=env,
        progress=lambda i, n, conf: seen.append((i, n, conf)),
    )
    return result, seen, marks


def test_expandable_segments_reserve_less_on_a_fragmenting_script(fragmenting_on_one_gpu):
    """Default vs expandable_segments: the simulator's exact peaks, cudaMalloc counts, 6 steps."""
    result, seen, _ = fragmenting_on_one_gpu
    assert seen == [(0, 2, ""), (1, 2, "expandable_segments:True")]
    default, expandable, invalid = result.trials
    assert (default.status, default.steps, default.baseline) == ("completed", 6, True)
    assert default.peak_reserved_bytes == DEFAULT_PEAK_RESERVED
    assert default.device_allocs == 7
    assert default.max_inactive_split_bytes == 2095104  # the small-pool segment's free rest
    assert (expandable.status, expandable.steps) == ("completed", 6)
    assert expandable.peak_reserved_bytes == EXPANDABLE_PEAK_RESERVED
    assert expandable.device_allocs == 3
    assert expandable.fragmentation == 0.0
    assert default.steps_per_s is not None and default.steps_per_s < 1 / 0.03
    assert invalid.status == "invalid"
    assert invalid.exit_code is None
    assert "max_split_size_mb must be >= 20" in invalid.error


def test_a_trial_that_runs_out_of_memory(tmp_path, sim_env):
    """torch.OutOfMemoryError in the loop's fourth step (i == 3, after 3 completed) is status
    oom at step 4, counted from 1, measured up to it."""
    trial = run_trial(
        sys.executable,
        [_script(tmp_path, OOM_AT_STEP_3)],
        "",
        steps=6,
        timeout_s=60,
        environ=sim_env,
    )
    assert trial.status == "oom"
    assert trial.oom_step == 4
    assert trial.steps == 3
    assert trial.exit_code == 1
    assert trial.error.startswith("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_a_crash_is_recorded_and_a_bad_setting_is_not_run(tmp_path, sim_env):
    """An exception at step 2: crashed, exit 1, its last stderr line; the invalid setting waits."""
    result = run_experiment(
        sys.executable,
        [_script(tmp_path, CRASH_AT_STEP_2)],
        ["bogus_key:1"],
        steps=6,
        timeout_s=60,
        environ=sim_env,
    )
    crashed, invalid = result.trials
    assert crashed.status == "crashed"
    assert crashed.exit_code == 1
    assert crashed.steps == 2
    assert crashed.error == "ValueError: boom at step 2"
    assert invalid.status == "invalid"
    assert "Unrecognized key 'bogus_key'" in invalid.error
    assert result.recommended is None


def test_a_script_that_ends_before_the_steps_is_finished(tmp_path, sim_env):
    """A script with 3 optimizer steps asked for 6: finished, 3 steps, exit 0."""
    trial = run_trial(
        sys.executable,
        [_script(tmp_path, ENDS_AFTER_3_STEPS)],
        "",
        steps=6,
        timeout_s=60,
        environ=sim_env,
        baseline=True,
    )
    assert (trial.status, trial.steps, trial.exit_code) == ("finished", 3, 0)
    assert trial.ok


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")  # a zombie waiting for init to reap it is dead too


def test_a_hanging_trial_is_killed_with_its_process_group(tmp_path, sim_env):
    """After the 3 s timeout the script and the process it started are both killed."""
    pid_file = tmp_path / "grandchild.pid"
    start = time.monotonic()
    trial = run_trial(
        sys.executable,
        [_script(tmp_path, HANGS), str(pid_file)],
        "",
        steps=6,
        timeout_s=3,
        environ=sim_env,
    )
    assert trial.status == "timeout"
    assert trial.error == "no result after 3 s; the process group was killed"
    assert trial.exit_code == -15  # SIGTERM, the first signal sent to the group
    assert time.monotonic() - start < 8
    if pid_file.exists():  # written once the script got past its first step
        pid = int(pid_file.read_text())
        deadline = time.monotonic() + 3
        while not _gone(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(pid)
        assert trial.steps == 1


# ------------------------------------------------------------------ several GPUs

# Writes NAME.start / NAME.end ({"gpu": CUDA_VISIBLE_DEVICES, "time": ...}) into argv[1] around
# its first step; NAME is the setting's key ("baseline" without one). expandable_segments hangs
# after its start mark; the baseline waits for that mark, so it only ends when the two overlap.
MARKS = """
import json, os, sys, time
import torch
conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
name = conf.split(":")[0] or "baseline"
def mark(state):
    path = os.path.join(sys.argv[1], name + "." + state)
    with open(path + ".tmp", "w") as out:
        json.dump({"gpu": os.environ.get("CUDA_VISIBLE_DEVICES"), "time": time.time()}, out)
    os.replace(path + ".tmp", path)
p = torch.nn.Parameter(torch.zeros(256))
opt = torch.optim.SGD([p], lr=0.1)
p.grad = torch.ones(256)
opt.step()
mark("start")
if name == "expandable_segments":
    time.sleep(120)
if name == "baseline":
    deadline = time.time() + 30
    while not os.path.exists(os.path.join(sys.argv[1], "expandable_segments.start")):
        if time.time() > deadline:
            sys.exit("the hanging trial never ran beside the baseline")
        time.sleep(0.02)
mark("end")
opt.step()
"""


def _mark(folder: Path, name: str) -> dict:
    return json.loads((folder / name).read_text())


def test_trials_run_in_parallel_one_per_gpu(tmp_path, sim_env):
    """gpus=("0","1"): each child sees its GPU, two overlap, a hang only holds its own GPU."""
    marks = tmp_path / "marks"
    marks.mkdir()
    seen = []
    # Long enough for a child to import torch on a loaded 2-core CI machine (an 8 s limit
    # timed the baseline out before its first step there); the hang still ends at the limit.
    timeout_s = 40
    start = time.monotonic()
    result = run_experiment(
        sys.executable,
        [_script(tmp_path, MARKS), str(marks)],
        ["expandable_segments:True", "max_split_size_mb:128"],
        steps=2,
        timeout_s=timeout_s,
        environ=sim_env,
        progress=lambda i, n, conf: seen.append((i, n, conf)),
        gpus=("0", "1"),
    )
    elapsed = time.monotonic() - start
    assert seen == [(0, 3, ""), (1, 3, "expandable_segments:True"), (2, 3, "max_split_size_mb:128")]
    base, hang, third = result.trials  # the input order, not the order they ended in
    assert result.gpus == ("0", "1")
    assert (base.alloc_conf, base.status, base.steps, base.gpu) == ("", "completed", 2, "0")
    assert (hang.alloc_conf, hang.status, hang.steps, hang.gpu) == (
        "expandable_segments:True",
        "timeout",
        1,
        "1",
    )
    # The third waited for a free GPU: the baseline's, while the hang still held GPU 1.
    assert (third.alloc_conf, third.status, third.steps, third.gpu) == (
        "max_split_size_mb:128",
        "completed",
        2,
        "0",
    )
    # Each child saw only its own GPU.
    assert _mark(marks, "baseline.start")["gpu"] == "0"
    assert _mark(marks, "expandable_segments.start")["gpu"] == "1"
    assert _mark(marks, "max_split_size_mb.start")["gpu"] == "0"
    # The baseline and the hanging trial ran at the same time ...
    hang_start = _mark(marks, "expandable_segments.start")["time"]
    assert _mark(marks, "baseline.start")["time"] < _mark(marks, "baseline.end")["time"]
    assert hang_start < _mark(marks, "baseline.end")["time"]
    # ... and the third started before the hang was killed: the hang blocked only GPU 1.
    assert _mark(marks, "max_split_size_mb.start")["time"] < hang_start + timeout_s
    assert not (marks / "expandable_segments.end").exists()
    assert hang.duration_s < timeout_s + 3
    assert elapsed < timeout_s + base.duration_s + third.duration_s
    # The simulated device never initialises CUDA: no GPU model, no mixed-models warning.
    assert [t.device_name for t in result.trials] == [None, None, None]
    assert result.warnings == ()


def test_one_visible_gpu_runs_unpinned_one_after_another(fragmenting_on_one_gpu):
    """CUDA_VISIBLE_DEVICES=7 (one GPU): as before, each child keeps the caller's variable."""
    result, _, marks = fragmenting_on_one_gpu
    base, expandable, _ = result.trials
    assert (base.status, base.gpu, result.gpus) == ("completed", None, ())
    assert (expandable.status, expandable.gpu) == ("completed", None)
    assert _mark(marks, "baseline.start")["gpu"] == "7"
    assert _mark(marks, "expandable_segments.start")["gpu"] == "7"


def test_a_gpu_named_twice_is_an_error(tmp_path, sim_env):
    """gpus=("0","0") cannot hold one trial per GPU: OomkitError before anything runs."""
    with pytest.raises(OomkitError, match="each GPU may be named once"):
        run_experiment(sys.executable, ["x.py"], [], environ=sim_env, gpus=("0", "0"))


@pytest.mark.parametrize(
    ("value", "gpus"),
    [
        ("0,1", ("0", "1")),
        ("3, 2", ("3", "2")),
        ("", ()),
        ("0,-1,2", ("0",)),  # a negative entry ends the list
        ("01,2gpu", ("1", "2")),  # strtoul: the number an entry starts with
        ("1,1", ()),  # a repeated device hides every device
        ("GPU-aa,GPU-bb", ("GPU-aa", "GPU-bb")),
        ("GPU-aa,1", ("GPU-aa",)),
    ],
)
def test_visible_gpus_reads_cuda_visible_devices(value, gpus):
    """CUDA_VISIBLE_DEVICES, read as torch.cuda._parse_visible_devices reads it."""
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": value}) == gpus


def test_visible_gpus_counts_with_torch_when_the_variable_is_unset(monkeypatch):
    """Without CUDA_VISIBLE_DEVICES: torch.cuda.device_count() (NVML first, no CUDA context)."""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert visible_gpus({}) == ("0", "1")
    monkeypatch.setattr(experiment, "_torch_device_count", lambda: 0)
    assert visible_gpus({}) == ()


def test_trials_on_different_gpu_models_are_flagged():
    """Two GPU models among the trials: a warning that names both; one model: none."""
    h100 = Trial("", True, "completed", device_name="NVIDIA H100 80GB HBM3")
    a100 = Trial("a:1", False, "completed", device_name="NVIDIA A100-SXM4-80GB")
    unknown = Trial("b:1", False, "crashed")
    assert experiment._mixed_models_warning([h100, a100, unknown]) == (
        "the trials ran on different GPU models (NVIDIA A100-SXM4-80GB, NVIDIA H100 80GB HBM3): "
        "their steps/s compares the GPUs as much as the settings; name GPUs of one model with "
        "--gpus"
    )
    assert experiment._mixed_models_warning([h100, h100, unknown]) is None

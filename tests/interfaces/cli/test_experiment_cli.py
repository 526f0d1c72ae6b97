"""Tests for `oomkit experiment`."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest

import oomkit.runtime.experiment as experiment
from oomkit.core.trace import TraceEvent, TraceHeader, write_trace
from oomkit.interfaces.cli import main
from oomkit.runtime.experiment import DEFAULT_CONFIGS, ExperimentResult, Trial

MiB = 2**20

FRAGMENTING_SCRIPT = """
import torch
p = torch.nn.Parameter(torch.zeros(256))
opt = torch.optim.SGD([p], lr=0.1)
for i in range(100):
    x = torch.empty((20 + 2 * i) * 2**20, dtype=torch.uint8)
    del x
    p.grad = torch.ones(256)
    opt.step()
"""


def _script(tmp_path, text=FRAGMENTING_SCRIPT):
    path = tmp_path / "train.py"
    path.write_text(text)
    return str(path)


def _fake_result() -> ExperimentResult:
    base = Trial("", True, "completed", 20, 100 * MiB, 80 * MiB, 10 * MiB, 0.5, 10.0, 0, 5)
    best = Trial(
        "expandable_segments:True", False, "completed", 20, 60 * MiB, 80 * MiB, 0, 0.0, 9.8, 0, 2
    )
    oom = Trial(
        "roundup_power2_divisions:4",
        False,
        "oom",
        3,
        90 * MiB,
        80 * MiB,
        0,
        0.1,
        9.0,
        0,
        4,
        oom_step=3,
        exit_code=1,
        error="CUDA out of memory. Tried to allocate 2.00 GiB",
    )
    bad = Trial("max_split_size_mb:10", False, "invalid", error="max_split_size_mb must be >= 20")
    return ExperimentResult(
        trials=(base, best, oom, bad),
        recommended=best,
        reason="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True reserves 40.00 MiB (40%) less",
        steps=20,
    )


@pytest.fixture
def fake_run(monkeypatch):
    """Replace the trials with a fixed result; the call's arguments are kept in `calls`."""
    calls = []

    def fake(python, target, configs, **kwargs):
        calls.append({"python": python, "target": target, "configs": list(configs), **kwargs})
        return _fake_result()

    monkeypatch.setattr(experiment, "run_experiment", fake)
    return calls


GOLDEN = """\
                                      Allocator settings on this script
┏━━━━━━━━━━━━━━━━━━━━━━━━━━━━┳━━━━━━━━━━━━━━━━━┳━━━━━━━━━━━━━━━┳━━━━━━━━━━━━━━━━━━━┳━━━━━━━━━━━━━━━┳━━━━━━━━━┓
┃ PYTORCH_CUDA_ALLOC_CONF    ┃ status          ┃ peak reserved ┃     Δ vs baseline ┃ fragmentation ┃ steps/s ┃
┡━━━━━━━━━━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━╇━━━━━━━━━┩
│ (default)                  │ ok (20 steps)   │    100.00 MiB │          baseline │           50% │      10 │
│ expandable_segments:True * │ ok (20 steps)   │     60.00 MiB │ -40.00 MiB (-40%) │            0% │     9.8 │
│ roundup_power2_divisions:4 │ OOM at step 3   │     90.00 MiB │ -10.00 MiB (-10%) │           10% │       9 │
│ max_split_size_mb:10       │ invalid setting │             - │                 - │             - │       - │
└────────────────────────────┴─────────────────┴───────────────┴───────────────────┴───────────────┴─────────┘
  roundup_power2_divisions:4: CUDA out of memory. Tried to allocate 2.00 GiB
  max_split_size_mb:10: max_split_size_mb must be >= 20
Recommendation: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True reserves 40.00 MiB (40%) less
"""


def test_experiment_table_golden(tmp_path, capsys, monkeypatch, fake_run):
    """At 120 columns: one row per setting (the pick starred), the failures, the recommendation."""
    monkeypatch.setenv("COLUMNS", "120")
    assert main(["experiment", "--", sys.executable, _script(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "\n".join(line.rstrip() for line in out.splitlines()) + "\n" == GOLDEN


def test_experiment_defaults_to_the_builtin_settings(tmp_path, fake_run):
    """Without --configs or --from-tune the three built-in settings run, 20 steps, 600 s."""
    script = _script(tmp_path)
    assert main(["experiment", "--", sys.executable, "-u", script, "--lr", "3"]) == 0
    (call,) = fake_run
    assert call["configs"] == list(DEFAULT_CONFIGS)
    assert call["target"] == [script, "--lr", "3"]
    assert call["interpreter_options"] == ["-u"]
    assert (call["steps"], call["timeout_s"]) == (20, 600.0)


def test_experiment_from_tune_runs_the_tune_shortlist(tmp_path, fake_run):
    """--from-tune: the first four settings `oomkit tune` may recommend, best first."""
    trace = tmp_path / "t.jsonl"
    write_trace(
        trace,
        [
            TraceEvent("alloc", 1, 30 * MiB),
            TraceEvent("free_requested", 1, 30 * MiB),
            TraceEvent("free_completed", 1, 30 * MiB),
            TraceEvent("alloc", 2, 40 * MiB),
        ],
        TraceHeader(format_version=1, source="synthetic"),
    )
    argv = ["experiment", "--from-tune", str(trace), "--steps", "5", "--timeout", "30"]
    assert main([*argv, "--", sys.executable, _script(tmp_path)]) == 0
    (call,) = fake_run
    assert call["configs"] == [
        "expandable_segments:True",
        "expandable_segments:True,roundup_power2_divisions:4",
        "expandable_segments:True,roundup_power2_divisions:8",
        "expandable_segments:True,roundup_power2_divisions:16",
    ]
    assert (call["steps"], call["timeout_s"]) == (5, 30.0)


def test_experiment_exits_1_when_no_trial_completed(tmp_path, capsys, monkeypatch):
    """No completed trial: exit 1 and `No recommendation` with the reason."""
    result = ExperimentResult(
        trials=(Trial("", True, "crashed", exit_code=1, error="ValueError: boom"),),
        recommended=None,
        reason="no trial completed; see the errors above",
        steps=20,
    )
    monkeypatch.setattr(experiment, "run_experiment", lambda *a, **k: result)
    assert main(["experiment", "--", sys.executable, _script(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "(default): ValueError: boom" in out
    assert "No recommendation: no trial completed; see the errors above" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "no command to run. Usage: oomkit experiment [--configs FILE] -- python"),
        (["--", "bash", "train.sh"], "`oomkit experiment` runs Python scripts; got `bash`"),
        (["--", sys.executable, "-u"], "no script given after `"),
        (["--", sys.executable, "missing.py"], "missing.py: no such script"),
    ],
)
def test_experiment_bad_command_is_usage_error(tmp_path, capsys, monkeypatch, argv, message):
    """A missing or non-Python command gives exit 2 and a one-line message."""
    monkeypatch.chdir(tmp_path)
    assert main(["experiment", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("oomkit: error:")
    assert message in err


def test_experiment_configs_file_without_settings_is_usage_error(tmp_path, capsys):
    """A configs file of comments only gives exit 2 and says what to write."""
    configs = tmp_path / "configs.txt"
    configs.write_text("# nothing yet\n\n")
    argv = ["experiment", "--configs", str(configs), "--", sys.executable, _script(tmp_path)]
    assert main(argv) == 2
    assert "names no setting" in capsys.readouterr().err


@pytest.mark.parametrize("flag", [["--steps", "0"], ["--timeout", "-1"]])
def test_experiment_bad_numbers_are_usage_errors(tmp_path, flag):
    """--steps below 1 and a non-positive --timeout are argparse errors (exit 2)."""
    with pytest.raises(SystemExit) as exc:
        main(["experiment", *flag, "--", sys.executable, _script(tmp_path)])
    assert exc.value.code == 2


def test_experiment_json_end_to_end(tmp_path, capsys, monkeypatch):
    """Real trials on a simulated 1 GiB GPU: the user's setting is the baseline and kept."""
    monkeypatch.setenv("OOMKIT_RUN_SIMULATED_GPU", "1GiB")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    configs = tmp_path / "configs.txt"
    configs.write_text(
        "# candidates\ndefault\nmax_split_size_mb:10   # too small\nexpandable_segments:True\n"
    )
    argv = ["experiment", "--configs", str(configs), "--steps", "4", "--json"]
    assert main([*argv, "--", sys.executable, _script(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    trials = out["trials"]
    assert [(t["alloc_conf"], t["status"], t["steps"]) for t in trials] == [
        ("expandable_segments:True", "completed", 4),
        ("", "completed", 4),
        ("max_split_size_mb:10", "invalid", 0),
    ]
    assert trials[0]["baseline"] is True
    # The simulator's reserved peaks after 4 steps of 20, 22, 24, 26 MiB requests: the default
    # gives each its own segment (92 MiB + the parameter's 2 MiB small-pool segment).
    assert trials[0]["peak_reserved_bytes"] == 44040192
    assert trials[1]["peak_reserved_bytes"] == 98566144
    assert out["recommended"] == "expandable_segments:True"
    assert out["reason"].startswith(
        "keep PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: no other setting reserved less"
    )
    assert out["steps"] == 4


def test_experiment_gpus_flag_is_passed_on(tmp_path, fake_run):
    """--gpus 0,1,2,3 reaches run_experiment as four GPUs; without it, None (every visible)."""
    script = _script(tmp_path)
    assert main(["experiment", "--gpus", "0, 1,2,3", "--", sys.executable, script]) == 0
    assert main(["experiment", "--", sys.executable, script]) == 0
    assert [call["gpus"] for call in fake_run] == [("0", "1", "2", "3"), None]


@pytest.mark.parametrize("value", ["0,0", "0,,1", ""])
def test_experiment_bad_gpus_are_usage_errors(tmp_path, value):
    """A repeated or empty GPU in --gpus is an argparse error (exit 2)."""
    with pytest.raises(SystemExit) as exc:
        main(["experiment", "--gpus", value, "--", sys.executable, _script(tmp_path)])
    assert exc.value.code == 2


def test_experiment_shows_the_gpu_of_each_trial(tmp_path, capsys, monkeypatch):
    """Trials pinned to GPUs: a GPU column in the table and `gpu`/`gpus` in --json."""
    base, best, oom, bad = _fake_result().trials
    result = ExperimentResult(
        trials=(
            dataclasses.replace(base, gpu="0"),
            dataclasses.replace(best, gpu="1"),
            dataclasses.replace(oom, gpu="0"),
            bad,
        ),
        recommended=None,
        reason="no trial completed; see the errors above",
        steps=20,
        gpus=("0", "1"),
    )
    monkeypatch.setattr(experiment, "run_experiment", lambda *a, **k: result)
    monkeypatch.setenv("COLUMNS", "140")
    assert main(["experiment", "--", sys.executable, _script(tmp_path)]) == 1
    rows = capsys.readouterr().out.splitlines()
    assert rows[2].split("┃")[-2].strip() == "GPU"
    cells = [row.split("│")[-2].strip() for row in rows[4:8]]
    assert cells == ["0", "1", "0", "-"]
    assert main(["experiment", "--json", "--", sys.executable, _script(tmp_path)]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["gpus"] == ["0", "1"]
    assert [t["gpu"] for t in out["trials"]] == ["0", "1", "0", None]

"""`oomkit fit --jobs N`: sizes traced ahead in forked processes, the same answer as one at a time."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

from oomkit.interfaces.cli import main

pytest.importorskip("torch")

# One request of (batch + 4) * 2 MiB a step, as test_fit.py's; every build logs "pid batch".
USER_FILE = """
import os
import torch

MiB = 2**20
LOG = os.path.join(os.path.dirname(__file__), "builds.log")

def build(batch_size, seq_len=16):
    with open(LOG, "a") as out:
        out.write(f"{os.getpid()} {batch_size}\\n")

    def step():
        torch.empty((batch_size + 4) * 2 * MiB, dtype=torch.uint8)

    return step
"""

SMALL = ["--gpu", "100MiB", "--context-overhead", "0", "--margin", "0", "--json"]


def _fit(capsys, *argv):
    code = main(["fit", *argv])
    out = json.loads(capsys.readouterr().out)
    out.pop("scenario", None)  # the request itself: its run.jobs differs between the runs compared
    return code, out


def test_jobs_2_traces_ahead_and_answers_as_jobs_1(tmp_path, capsys):
    """A file.py:function with --jobs 2: the JSON of --jobs 1 (answer 46, the curve, 4 traces),
    with 2 and 46 built in forked processes (47, the last size bisection tries, does not fit by
    its synthesis, so 46 is traced ahead beside it), and 4 perhaps in the background."""
    path = tmp_path / "steps.py"
    path.write_text(textwrap.dedent(USER_FILE))
    log = tmp_path / "builds.log"
    code_1, one = _fit(capsys, f"{path}:build", *SMALL, "--jobs", "1")
    one_pids = {line.split()[0] for line in log.read_text().splitlines()}
    log.unlink()
    code_2, two = _fit(capsys, f"{path}:build", *SMALL, "--jobs", "2")
    assert code_1 == code_2 == 0
    assert two == one and one["batch_size"] == 46 and one["traces"] == 4
    assert one_pids == {str(os.getpid())}
    ahead = sorted(int(b) for pid, b in map(str.split, log.read_text().splitlines())
                   if pid != str(os.getpid()))
    # 4, the first size synthesized, goes to the background and is never asked for: stopped
    # at the end, perhaps before its build ran.
    assert ahead.count(4) <= 1 and [b for b in ahead if b != 4] == [2, 46]


def test_a_preset_searched_on_every_core_answers_as_one_at_a_time(capsys, monkeypatch):
    """GPT-2 (a one-layer preset, forked with the process) at seq 64 on 4 GiB, traced ahead by
    default (a preset), and with --jobs 1: the same JSON."""
    import dataclasses
    from types import MappingProxyType

    from oomkit.prediction.models import presets
    from oomkit.prediction.models.gpt2 import GPT2Shape

    shape = GPT2Shape(hidden=256, layers=1, heads=4, vocab=8192, positions=512)
    tiny = dataclasses.replace(presets.get_preset("gpt2-124m"), name="gpt2-tiny", shape=shape)
    monkeypatch.setattr(presets, "PRESETS", MappingProxyType({**presets.PRESETS, "gpt2-tiny": tiny}))
    argv = ["gpt2-tiny", "--seq", "64", "--gpu", "4GiB", "--max-batch", "8", "--json"]
    code, default = _fit(capsys, *argv)
    code_1, one = _fit(capsys, *argv, "--jobs", "1")
    assert code == code_1 == 0
    assert default == one and one["traces"] >= 2


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_a_bad_jobs_count_exits_2(capsys, value):
    """--jobs takes a whole number from 1: anything else exits 2, naming the flag."""
    assert main(["fit", "gpt2-124m", "--gpu", "4GiB", "--jobs", value]) == 2
    err = capsys.readouterr().err
    expected = "expected a whole number" if value == "two" else "must be at least 1"
    assert f"--jobs (run.jobs): {expected}; got '{value}'" in err


LENGTHS_STEP = """
import os
import torch

LOG = os.path.join(os.path.dirname(__file__), "builds.log")

def build(batch_size=2, seq_len=64):
    with open(LOG, "a") as out:
        out.write(f"{os.getpid()} {batch_size} {seq_len}\\n")
    model = torch.nn.Sequential(torch.nn.Embedding(100, 64), torch.nn.Linear(64, 100))
    opt = torch.optim.AdamW(model.parameters())
    tokens = torch.randint(0, 100, (batch_size, seq_len))

    def step():
        model(tokens).float().logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, (model, opt, tokens)
"""


def test_fit_lengths_with_jobs_traces_a_probes_lengths_at_once(tmp_path, capsys):
    """fit --lengths --jobs 2: the JSON of --jobs 1; the lengths of a probe that are traced
    (both, at 1 and 2: nothing to synthesize from yet) are traced in forked processes."""
    path = tmp_path / "tiny.py"
    path.write_text(textwrap.dedent(LENGTHS_STEP))
    lengths = tmp_path / "l.txt"
    lengths.write_text("32\n48\n")
    argv = [f"{path}:build", "--lengths", str(lengths), "--gpu", "1GiB", "--max-batch", "16"]
    code_1, one = _fit(capsys, *argv, "--json", "--jobs", "1")
    (tmp_path / "builds.log").unlink()
    code_2, two = _fit(capsys, *argv, "--json", "--jobs", "2")
    assert code_1 == code_2 == 0
    assert two == one and one["traces"] >= 4
    rows = [line.split() for line in (tmp_path / "builds.log").read_text().splitlines()]
    ahead = sorted((int(b), int(n)) for pid, b, n in rows if pid != str(os.getpid()))
    assert ahead[:4] == [(1, 32), (1, 48), (2, 32), (2, 48)]


def _args(target, eval=None, compile=False, jobs=None):
    """The scenario of a fit command line with TARGET (None: --hf), --eval, --compile, --jobs."""
    from oomkit.scenario import Scenario

    model = {"hf": "gpt2"} if target is None else (
        {"function": target} if ".py:" in target else {"preset": target}
    )
    if eval is not None:
        model["eval_function"] = eval
    return Scenario(model=model, step={"compile": compile}, run={"jobs": jobs})


def _jobs(scenario):
    from oomkit.scenario.run import tracing_jobs

    return tracing_jobs(scenario)


def test_jobs_default_to_every_core_for_oomkits_own_builders_only(monkeypatch):
    """None (one per core) for a preset on Linux; 1 for a file.py:function, --eval, --compile
    and off Linux; --jobs as given."""
    monkeypatch.setattr(sys, "platform", "linux")
    assert _jobs(_args("gpt2-124m")) is None
    assert _jobs(_args(None)) is None  # --hf
    assert _jobs(_args("train.py:build")) == 1
    assert _jobs(_args("gpt2-124m", eval="e.py:build")) == 1
    assert _jobs(_args("gpt2-124m", compile=True)) == 1
    assert _jobs(_args("train.py:build", jobs=3)) == 3
    monkeypatch.setattr(sys, "platform", "darwin")
    assert _jobs(_args("gpt2-124m")) == 1

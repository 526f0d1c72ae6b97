"""`oomkit predict train.py [flags] -- ARGS`: a whole script, run as `python train.py ARGS`."""

from __future__ import annotations

import json
import textwrap

import pytest

from oomkit.interfaces.cli import main

pytest.importorskip("torch")

SCRIPT = '''
import argparse

import torch
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--batch_size", type=int, default=4)
parser.add_argument("--epochs", type=int, default=50)
args = parser.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"
data = TensorDataset(torch.randn(64, 32), torch.randn(64, 8))
loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
model.to(device)
opt = torch.optim.AdamW(model.parameters())
for epoch in range(args.epochs):
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
torch.save(model.state_dict(), "model.pt")
'''


@pytest.fixture
def script(tmp_path, monkeypatch):
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(SCRIPT))
    monkeypatch.chdir(tmp_path)
    return path


def test_a_script_is_predicted_with_its_own_arguments(script, capsys):
    """The script's arguments after `--` reach its argparse; its loop stops after --steps
    optimizer steps; nothing it would save is written; the scenario names the script."""
    argv = ["predict", str(script), "--gpu", "rtx4090", "--steps", "2", "--json",
            "--", "--batch_size", "16"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["scenario"]["model"] == {"script": str(script), "script_args": ["--batch_size", "16"]}
    assert out["workload"]["kind"] == "script"
    assert out["steps"] == 2 and out["fits"] is True
    assert out["peak_allocated_bytes"] > 0
    assert not (script.parent / "model.pt").exists()
    assert sorted(p.name for p in script.parent.iterdir()) == ["train.py"]


def test_a_stopped_script_says_what_was_not_recorded(script, capsys):
    """The report says the script was stopped after its steps, and how to record further;
    --epochs 1 with 2 steps of 16 rows over 64 runs to its end: no such line."""
    assert main(["predict", str(script), "--gpu", "rtx4090", "--steps", "2"]) == 0
    out = capsys.readouterr().out.replace("\n", " ")
    assert "assumed: script stopped: after its first 2 optimizer step(s) (--steps); " in out
    assert "raise --steps to record it" in out
    assert main(["predict", str(script), "--gpu", "rtx4090", "--steps", "5", "--",
                 "--batch_size", "16", "--epochs", "1"]) == 0
    out = capsys.readouterr().out
    assert "script stopped" not in out and "fewer than the 5 asked for" in out.replace("\n", " ")


def test_a_bigger_batch_of_the_script_needs_more(script, capsys):
    """--batch_size 64 (the script's own flag) allocates more than 16 at its peak."""
    peaks = []
    for batch in ("16", "64"):
        assert main(["predict", str(script), "--gpu", "rtx4090", "--steps", "1", "--json",
                     "--", "--batch_size", batch]) == 0
        peaks.append(json.loads(capsys.readouterr().out)["peak_allocated_bytes"])
    assert peaks[1] > peaks[0]


def test_sizes_for_a_script_are_refused_with_its_arguments_named(script, capsys):
    """--seq sizes a preset or a builder, and --batch a script only through a batch argument
    (its parser's --batch_size here): otherwise exit 2 pointing after `--`."""
    assert main(["predict", str(script), "--seq", "128"]) == 2
    err = capsys.readouterr().err
    assert "a whole script" in err and "pass them after --" in err
    script.write_text(script.read_text().replace('"--batch_size"', '"--width"'))
    assert main(["predict", str(script), "--batch", "8"]) == 2
    assert "pass them after --" in capsys.readouterr().err
    assert main(["fit", str(script)]) == 2
    assert "is a whole script" in capsys.readouterr().err

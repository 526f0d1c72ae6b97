"""`oomkit predict file.py:build` on a builder written with the CUDA lines every loop has
(issue 34): exit 0, and the bytes of the same step written for the meta device."""

from __future__ import annotations

import json
import os
import subprocess
import sys

AS_PEOPLE_WRITE_IT = '''
import torch

device = "cuda" if torch.cuda.is_available() else "cpu"


def build(batch_size):
    model = torch.nn.Linear(512, 512).to(device)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(batch_size, 512)

    def step():
        xb = x.to(device, non_blocking=True)
        idx = torch.randint(0, 512, (batch_size,), device="cuda")
        loss = model(xb)[torch.arange(batch_size, device=device), idx].sum()
        loss.backward()
        opt.step()
        opt.zero_grad()

    return step, (model, opt, x)
'''

ON_META = '''
import torch


def build(batch_size):
    model = torch.nn.Linear(512, 512)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(batch_size, 512)

    def step():
        xb = x
        idx = torch.randint(0, 512, (batch_size,))
        loss = model(xb)[torch.arange(batch_size), idx].sum()
        loss.backward()
        opt.step()
        opt.zero_grad()

    return step, (model, opt, x)
'''


def _predict_json(tmp_path, name, source):
    path = tmp_path / name
    path.write_text(source)
    done = subprocess.run(
        [sys.executable, "-m", "oomkit", "predict", f"{path}:build", "--batch", "8",
         "--gpu", "rtx4090", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    return result["peak_reserved_bytes"], result["peak_allocated_bytes"]


def _predict_json_here(tmp_path, name, source, capsys):
    """The same command run in this process (``oomkit.interfaces.cli.main``)."""
    from oomkit.interfaces.cli import main

    path = tmp_path / name
    path.write_text(source)
    assert main(["predict", f"{path}:build", "--batch", "8", "--gpu", "rtx4090", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    return result["peak_reserved_bytes"], result["peak_allocated_bytes"]


def test_device_lines_predict_the_meta_builders_bytes(tmp_path, capsys):
    """is_available() at import, .to(device), .to(device, non_blocking=True) and device="cuda"
    in the step: exit 0 with the figures of the step written on the default device. The CUDA
    lines run as people run them (``python -m oomkit`` in a fresh interpreter); the reference,
    which has none, is predicted in this process (a second interpreter would only start torch
    again)."""
    assert _predict_json(tmp_path, "written.py", AS_PEOPLE_WRITE_IT) == _predict_json_here(
        tmp_path, "meta.py", ON_META, capsys
    )

"""torch.compile(mode="reduce-overhead"): CUDA graphs asked for, and said not to be modelled."""

from __future__ import annotations

import textwrap

import pytest

from oomkit.core.target import Target
from oomkit.prediction.tracing.script_run import record_script

pytest.importorskip("torch._dynamo")

SCRIPT = """
import sys
import torch

model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
model = model.cuda()
compiled = torch.compile(model, mode=sys.argv[1])
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(2):
    compiled(torch.randn(8, 64, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.parametrize(("mode", "said"), [("reduce-overhead", True), ("max-autotune", True),
                                            ("default", False)])
def test_cuda_graphs_asked_for_are_said_not_modelled(tmp_path, mode, said):
    """The modes that turn on triton.cudagraphs get a warning naming the private pool; the
    default mode gets none. The graph is recorded compiled either way."""
    (tmp_path / "train.py").write_text(textwrap.dedent(SCRIPT))
    run = record_script(tmp_path / "train.py", [mode], steps=2, target=Target.resolve("h100"),
                        cwd=tmp_path)
    warned = [w for w in run.recording.warnings if "asked for CUDA graphs" in w]
    assert len(warned) == (1 if said else 0)
    if said:
        assert warned[0].startswith("torch.compile: 1 captured graph(s) asked for CUDA graphs")
        assert "private pool" in warned[0]
    assert "torch.compile" in run.recording.assumptions

"""``oomkit predict --compile``: compiled steps recorded as compiled, from the command line."""

from __future__ import annotations

import json
import textwrap

import pytest

pytest.importorskip("torch")

from oomkit.interfaces.cli import main  # noqa: E402

_STEP = textwrap.dedent(
    """
    import torch

    def build(batch_size=16):
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)
        )
        x = torch.randn(batch_size, 64)
        compiled = torch.compile(model)

        def step():
            compiled(x).sum().backward()

        return step, (model, x)
    """
)


def test_user_step_that_compiles_is_recorded_compiled(tmp_path, capsys):
    """With --compile a file.py:function step's own torch.compile is recorded as compiled."""
    path = tmp_path / "compiled_step.py"
    path.write_text(_STEP)
    code = main(["predict", f"{path}:build", "--compile", "--steps", "1", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    warnings = out["warnings"]
    assert any(w.startswith("torch.compile: compiled (AOTAutograd partitioner real") for w in warnings)
    assert not any("traced eagerly" in w for w in warnings)


def test_compile_with_ddp_compiles_each_block(capsys):
    """--compile with --dp alone (DDP) records GPT-2's 12 blocks compiled inside DDP (through
    dynamo's DDPOptimizer) and the loss: 13 compiled regions entered in one step, none of
    them recorded eagerly instead."""
    argv = ["predict", "gpt2-124m", "--compile", "--dp", "2", "--seq", "64", "--batch", "1",
            "--steps", "1", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert "each block compiled" in out["description"] and "DDP over 2 replicas" in out["description"]
    said = " ".join(out["warnings"])
    assert "compiled code was entered 13 time(s)" in said
    assert "could not be compiled GPU-free" not in said

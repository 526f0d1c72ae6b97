"""Progress on stderr for predict: a bar on a terminal, nothing in a pipe or with --json."""

from __future__ import annotations

import io
import json
import sys
import textwrap

import pytest

from oomkit.interfaces.cli import main
from oomkit.interfaces.cli._progress import StepProgress

pytest.importorskip("torch")

MiB = 2**20


class Tty(io.StringIO):
    """A stderr that says it is a terminal (the provider the bar is decided by)."""

    def isatty(self) -> bool:
        return True


def test_step_progress_counts_steps_then_names_the_replay():
    """Each call of the wrapped step advances the bar; after the last, the bar names the replay."""
    shown: list[tuple[str, int]] = []
    progress = StepProgress(lambda text, done: shown.append((text, done)), 2)
    step = progress.wrap(lambda x: x + 1)
    assert step(1) == 2 and step(2) == 3
    assert shown == [
        ("recording step 1 of 2 on the meta device", 0),
        ("recording step 2 of 2 on the meta device", 1),
        ("replaying the recording through the simulated allocator", 2),
    ]


def test_step_progress_without_a_bar_returns_the_step_itself():
    """No bar: the step is not wrapped at all."""

    def step():
        return None

    assert StepProgress(None, 3).wrap(step) is step


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "tiny.py"
    path.write_text(
        textwrap.dedent(
            """
            import torch

            def build(batch_size):
                return (lambda: torch.empty(batch_size * 2**20, dtype=torch.uint8)), []
            """
        )
    )
    return f"{path}:build"


def test_predict_draws_a_bar_on_a_terminal(user_file, monkeypatch, capsys):
    """With stderr a terminal, predict's stderr shows each step and the replay (issue 16 item 13)."""
    err = Tty()
    monkeypatch.setattr(sys, "stderr", err)
    assert main(["predict", user_file, "--batch", "2", "--steps", "2", "--gpu", "t4"]) == 0
    text = err.getvalue()
    assert "recording step 1 of 2 on the meta device" in text
    assert "recording step 2 of 2 on the meta device" in text
    assert "replaying the recording through the simulated allocator" in text
    assert "fits on" in capsys.readouterr().out


def test_predict_draws_nothing_in_a_pipe_or_with_json(user_file, monkeypatch, capsys):
    """Not a terminal: one line on stderr, no bar; with --json, stderr stays empty on a terminal."""
    assert main(["predict", user_file, "--batch", "2", "--steps", "2", "--gpu", "t4"]) == 0
    err = capsys.readouterr().err
    assert "recording step" not in err and "\x1b[" not in err
    tty = Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    assert main(["predict", user_file, "--batch", "2", "--steps", "2", "--json"]) == 0
    assert tty.getvalue() == ""
    # CUDACachingAllocator.cpp get_allocation_size: 1-10 MiB requests get a 20 MiB segment.
    assert json.loads(capsys.readouterr().out)["peak_reserved_bytes"] == 20 * MiB


def test_smallest_gpu_draws_a_bar_per_compute_capability(user_file, monkeypatch):
    """fit --smallest-gpu on a terminal counts its traces, one per compute capability."""
    from oomkit.core.gpus import CATALOG

    traces = len({g.kernel_compute_capability for g in CATALOG})
    err = Tty()
    monkeypatch.setattr(sys, "stderr", err)
    assert main(["fit", user_file, "--batch", "2", "--smallest-gpu", "--steps", "1"]) == 0
    text = err.getvalue()
    assert "tracing per compute capability" in text
    assert f"{traces}/{traces}" in text


def test_step_progress_counts_generate_tokens():
    """With tokens_per_step, each forward of the model advances the bar by one token."""

    class Model:
        """A module stand-in: register_forward_pre_hook returns a removable handle."""

        def __init__(self):
            self.hooks = []

        def register_forward_pre_hook(self, hook):
            self.hooks.append(hook)
            model = self

            class Handle:
                def remove(self):
                    model.hooks.remove(hook)

            return Handle()

        def __call__(self):
            for hook in list(self.hooks):
                hook(self, ())

    shown: list[tuple[str, int]] = []
    progress = StepProgress(lambda text, done: shown.append((text, done)), 1, tokens_per_step=2)
    model = Model()

    def generate():
        model()
        model()

    with progress.count_forwards(model):
        progress.wrap(generate)()
    assert model.hooks == []
    assert progress.total == 2
    assert shown == [
        ("recording step 1 of 1 on the meta device, token 1 of 2", 0),
        ("recording step 1 of 1 on the meta device, token 1 of 2", 0),
        ("recording step 1 of 1 on the meta device, token 2 of 2", 1),
        ("replaying the recording through the simulated allocator", 2),
    ]


def test_predict_generate_counts_tokens_on_a_terminal(monkeypatch, capsys):
    """predict --mode generate on a terminal shows the token being recorded (issue 16 item 13)."""
    err = Tty()
    monkeypatch.setattr(sys, "stderr", err)
    argv = ["predict", "gpt2-124m", "--mode", "generate", "--batch", "1", "--seq", "8",
            "--new-tokens", "3", "--steps", "1"]
    assert main(argv) == 0
    text = err.getvalue()
    for token in (1, 2, 3):
        assert f"recording step 1 of 1 on the meta device, token {token} of 3" in text
    assert "replaying the recording through the simulated allocator" in text

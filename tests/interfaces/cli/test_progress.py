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


def test_script_progress_shows_steps_and_events_then_the_replay(monkeypatch):
    """A script reports its optimizer steps and allocator events; the line is redrawn at most
    every _SCRIPT_REFRESH_S unless a step completed; when it ends, the bar names the replay."""
    from oomkit.interfaces.cli import _progress
    from oomkit.prediction.tracing.script_run import ScriptProgress

    clock = [100.0]
    monkeypatch.setattr(_progress.time, "monotonic", lambda: clock[0])
    shown: list[tuple[str, int]] = []
    progress = StepProgress(lambda text, done: shown.append((text, done)), 3)
    progress.script(ScriptProgress(0, 3, 1_200, max_entries=2_000_000))
    clock[0] += 0.05
    progress.script(ScriptProgress(0, 3, 1_900, max_entries=2_000_000))  # too soon: not drawn
    progress.script(ScriptProgress(1, 3, 2_000, max_entries=2_000_000))  # a step: drawn
    clock[0] += 0.2
    progress.script(ScriptProgress(1, 3, 5_000, max_entries=2_000_000))
    progress.script(ScriptProgress(1, 3, 5_000, max_entries=2_000_000, ended=True))
    assert shown == [
        ("recording the script: 0 of 3 optimizer steps, 1,200 allocator events "
         "(at most 2,000,000)", 0),
        ("recording the script: 1 of 3 optimizer steps, 2,000 allocator events "
         "(at most 2,000,000)", 1),
        ("recording the script: 1 of 3 optimizer steps, 5,000 allocator events "
         "(at most 2,000,000)", 1),
        ("replaying the recording through the simulated allocator", 3),
    ]


def test_predict_of_an_evaluation_script_shows_its_events_on_a_terminal(
    tmp_path, monkeypatch, capsys
):
    """An evaluation script has no optimizer step to count: its line counts the allocator
    events it has logged, then names the replay."""
    script = tmp_path / "evaluate.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch

            model = torch.nn.Linear(64, 64).to("cuda")
            with torch.no_grad():
                for _ in range(200):
                    model(torch.randn(8, 64, device="cuda"))
            """
        )
    )
    err = Tty()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr("oomkit.interfaces.cli._progress._SCRIPT_REFRESH_S", 0.0)
    assert main(["predict", str(script), "--gpu", "t4"]) == 0
    text = " ".join(err.getvalue().split())  # the terminal wraps the long line
    # A report at every 64th module call, before its forward: the weight and the bias (2),
    # the first forward's cuBLAS workspace (1), each earlier forward's input and output
    # requested and freed (4 each) and this call's input (1): 4 x 64 = 256, then 4 x 192.
    assert "recording the script: 0 of 3 optimizer steps, 256 allocator events" in text
    assert "recording the script: 0 of 3 optimizer steps, 768 allocator events" in text
    assert "replaying the recording through the simulated allocator" in text
    assert "fits on" in capsys.readouterr().out


def test_a_counted_bar_says_the_time_left_once_an_item_is_done(monkeypatch):
    """progress_bar's last column: blank before the first item, then rich's estimate from the
    pace so far as ~H:MM:SS left (the second item took 10 s: 4 more at that pace), blank
    again when all are done."""
    from rich.progress import Progress

    from oomkit.interfaces.cli import _progress

    column = _progress._time_left()
    now = [0.0]
    bar = Progress(column, get_time=lambda: now[0], auto_refresh=False)
    task = bar.add_task("predicting layouts", total=6)
    assert column.render(bar.tasks[task]).plain == ""
    for now[0], done in ((10.0, 1), (20.0, 2)):
        bar.update(task, completed=done)
    assert column.render(bar.tasks[task]).plain == "~0:00:40 left"
    now[0] = 60.0
    bar.update(task, completed=6)
    assert column.render(bar.tasks[task]).plain == ""


def test_each_rank_of_a_script_is_named_on_the_bar(tmp_path, monkeypatch, capsys):
    """--all-ranks records the ranks in turn: the bar says which one it is recording."""
    script = tmp_path / "ddp.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            import torch.distributed as dist

            dist.init_process_group("nccl")
            model = torch.nn.Linear(64, 64).to("cuda")
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(3):
                model(torch.randn(8, 64, device="cuda")).sum().backward()
                opt.step()
                opt.zero_grad()
            """
        )
    )
    err = Tty()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr("oomkit.interfaces.cli._progress._SCRIPT_REFRESH_S", 0.0)
    assert main(["predict", str(script), "--world-size", "2", "--all-ranks", "--gpu", "t4"]) == 0
    text = " ".join(err.getvalue().split())
    assert "recording rank 0 of 2: 3 of 3 optimizer steps" in text
    assert "recording rank 1 of 2: 3 of 3 optimizer steps" in text
    assert "recording the script" not in text
    assert "rank 0 peaks, of 2 ranks" in capsys.readouterr().out

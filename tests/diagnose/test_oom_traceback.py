"""Where a pasted OOM surfaced: the user's line and the phase (issue 35 item 6)."""

from __future__ import annotations

import json

import pytest

from oomkit.diagnose.oom_traceback import find_oom_location
from oomkit.interfaces.cli import main

SP = "/opt/conda/lib/python3.11/site-packages"
MESSAGE = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 496.00 MiB. GPU 0 has a total "
    "capacity of 14.75 GiB of which 235.06 MiB is free. Process 20398 has 14.52 GiB memory in "
    "use. Of the allocated memory 14.06 GiB is allocated by PyTorch, and 330.42 MiB is reserved "
    "by PyTorch but unallocated."
)


def _traceback(*frames: tuple[str, int, str, str]) -> str:
    lines = ["step 450 loss=2.31", "Traceback (most recent call last):"]
    for path, line, func, source in frames:
        lines.append(f'  File "{path}", line {line}, in {func}')
        if source:
            lines.append(f"    {source}")
            lines.append("    " + "^" * len(source))
    return "\n".join(lines) + "\n" + MESSAGE + "\n"


BACKWARD = _traceback(
    ("/home/me/project/train.py", 180, "<module>", "loss.backward()"),
    (f"{SP}/torch/_tensor.py", 626, "backward", "torch.autograd.backward("),
    (f"{SP}/torch/autograd/__init__.py", 347, "backward", "_engine_run_backward("),
    (f"{SP}/torch/autograd/graph.py", 823, "_engine_run_backward", "return Variable._exec"),
)


def test_backward_at_the_users_line():
    """loss.backward() at train.py:180, the frames through torch/autograd: backward."""
    location = find_oom_location(BACKWARD)
    assert location is not None
    assert (location.path, location.line, location.function) == (
        "/home/me/project/train.py",
        180,
        "<module>",
    )
    assert location.source == "loss.backward()"
    assert location.phase == "backward"
    assert location.label == "loss.backward() at train.py:180"


@pytest.mark.parametrize(
    ("frames", "phase", "label"),
    [
        (
            [
                ("train.py", 52, "<module>", "optimizer.step()"),
                (f"{SP}/torch/optim/optimizer.py", 493, "wrapper", "out = func(*args)"),
                (f"{SP}/torch/optim/adamw.py", 220, "step", "has_complex = self._init_group("),
                (f"{SP}/torch/optim/adamw.py", 160, "_init_group", "state['exp_avg'] = ..."),
            ],
            "optimizer state creation",
            "optimizer.step() at train.py:52",
        ),
        (
            [
                ("train.py", 52, "<module>", "optimizer.step()"),
                (f"{SP}/torch/optim/adamw.py", 230, "step", "adamw("),
                (f"{SP}/torch/optim/adamw.py", 600, "_multi_tensor_adamw", "exp_avg_sq_sqrt ="),
            ],
            "optimizer step",
            "optimizer.step() at train.py:52",
        ),
        (
            [
                ("C:\\Users\\me\\run.py", 31, "main", "out = model(x)"),
                (f"{SP}/torch/nn/modules/module.py", 1751, "_wrapped_call_impl", "return ..."),
                ("C:\\Users\\me\\net.py", 12, "forward", "h = self.fc(x)"),
                (f"{SP}/torch/nn/modules/linear.py", 125, "forward", "return F.linear(...)"),
            ],
            "forward",
            "h = self.fc(x) at net.py:12",
        ),
        (
            [
                ("train.py", 77, "step", "loss = criterion(logits, y)"),
                (f"{SP}/torch/nn/modules/module.py", 1762, "_call_impl", "return forward_call()"),
                (f"{SP}/torch/nn/modules/loss.py", 1297, "forward", "return F.cross_entropy("),
            ],
            "loss",
            "loss = criterion(logits, y) at train.py:77",
        ),
        (
            [("train.py", 9, "<module>", "x = torch.empty(n, device='cuda')")],
            None,
            "x = torch.empty(n, device='cuda') at train.py:9",
        ),
        (
            [("train.py", 9, "<module>", ""), (f"{SP}/foo/bar.py", 3, "go", "")],
            None,
            "train.py:9 in <module>",
        ),
    ],
)
def test_phase_from_the_frames(frames, phase, label):
    """Each phase from the PyTorch functions on the stack; the innermost user frame."""
    location = find_oom_location(_traceback(*frames))
    assert location is not None
    assert (location.phase, location.label) == (phase, label)


def test_a_message_alone_has_no_location():
    """No traceback before the message: None."""
    assert find_oom_location(MESSAGE) is None
    assert find_oom_location("") is None


def test_the_last_traceback_before_the_message_is_read():
    """A chained exception: the traceback right before the OOM message counts."""
    first = _traceback(("train.py", 5, "<module>", "optimizer.step()")).replace(MESSAGE, "")
    text = first + "During handling of the above exception, another exception occurred:\n"
    location = find_oom_location(text + BACKWARD)
    assert location is not None and location.line == 180


def test_explain_reports_where_and_the_phase(tmp_path, capsys):
    """`oomkit explain LOG` prints the user's line and phase; --json carries them."""
    log = tmp_path / "train.log"
    log.write_text(BACKWARD)
    assert main(["explain", str(log)]) == 0
    out = capsys.readouterr().out
    assert "Where: loss.backward() at train.py:180, in the backward" in out
    assert "GPU: T4, matched by the message's total memory" in out
    assert main(["explain", str(log), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["location"] == {
        "path": "/home/me/project/train.py",
        "line": 180,
        "function": "<module>",
        "source": "loss.backward()",
        "phase": "backward",
        "script": "/home/me/project/train.py",
        "trainer": None,
    }
    assert data["gpu"] == "T4"


def test_the_html_report_says_where(tmp_path):
    """--html: the verdict section carries the same 'Where:' line as the terminal."""
    log = tmp_path / "train.log"
    log.write_text(BACKWARD)
    page = tmp_path / "oom.html"
    assert main(["explain", str(log), "--html", str(page)]) == 0
    assert "Where: loss.backward() at train.py:180, in the backward" in page.read_text()


def test_a_forward_pass_inside_an_optimizer_closure_is_forward():
    """Lightning runs training_step inside optimizer.step(closure): the innermost phase wins."""
    location = find_oom_location(
        _traceback(
            ("train.py", 40, "<module>", "trainer.fit(model, data)"),
            (f"{SP}/torch/optim/optimizer.py", 493, "wrapper", "out = func(*args, **kwargs)"),
            (f"{SP}/torch/optim/adamw.py", 209, "step", "loss = closure()"),
            (f"{SP}/lightning/pytorch/loops/optimization/automatic.py", 146, "__call__", ""),
            ("model.py", 88, "training_step", "logits = self.net(x)"),
            (f"{SP}/torch/nn/modules/module.py", 1751, "_wrapped_call_impl", "return ..."),
            (f"{SP}/torch/nn/modules/linear.py", 125, "forward", "return F.linear(...)"),
        )
    )
    assert location is not None
    assert (location.phase, location.label) == ("forward", "logits = self.net(x) at model.py:88")


@pytest.mark.parametrize(
    ("first", "script"),
    [
        # python train.py: the outermost frame is the script's top level.
        (("/home/me/project/train.py", 180, "<module>", "main()"), "/home/me/project/train.py"),
        # python -m project.train: runpy's frames come first; the command is not a file's.
        (("/usr/lib/python3.11/runpy.py", 198, "_run_module_as_main", ""), None),
        # a notebook cell, python -c, a traceback that starts inside a function
        (("/tmp/ipykernel_4121/2851163853.py", 3, "<module>", "main()"), None),
        (("<string>", 1, "<module>", ""), None),
        (("/home/me/project/train.py", 40, "main", "step()"), None),
    ],
)
def test_the_script_python_ran_is_the_outermost_frame_at_a_file_s_top_level(first, script):
    """The traceback's outermost frame, where it is a script file's top level, names the
    script; anything else names none (the remedies then keep the train.py placeholder)."""
    text = _traceback(first, ("/home/me/project/model.py", 12, "forward", "x = self.fc(x)"))
    location = find_oom_location(text)
    assert location is not None and location.script == script


def test_explain_s_setting_command_runs_the_script_of_the_traceback(tmp_path, capsys):
    """A fragmentation OOM under a traceback from `python "my run/train.py"`: the expandable
    segments remedy's command names that script, quoted for the shell, not `python train.py`;
    the same message without a traceback keeps the placeholder."""
    from cases.oom_cases import fragmented_oom_message

    message = f"torch.OutOfMemoryError: {fragmented_oom_message()}"
    text = _traceback(
        ("/home/me/my run/train.py", 75, "<module>", "loss.backward()"),
        (f"{SP}/torch/_tensor.py", 626, "backward", "torch.autograd.backward("),
    ).replace(MESSAGE, message)
    log = tmp_path / "train.log"
    log.write_text(text)
    assert main(["explain", str(log)]) == 0
    out = capsys.readouterr().out
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python '/home/me/my run/train.py'" in (
        out
    )
    assert "python train.py" not in out
    log.write_text(message)
    assert main(["explain", str(log)]) == 0
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python train.py" in (
        capsys.readouterr().out
    )


@pytest.mark.parametrize("prefix", ["[rank0]: ", "[rank3]:", "[default1]:"])
def test_a_torchrun_worker_s_prefixed_lines_are_read_as_its_traceback(prefix):
    """torchrun prefixes each line a worker prints with its rank. The rank whose message comes
    first is read, without its prefix; another rank's lines interleaved with it (another line
    of the script, its own message later) do not mix in. They had given no location at all."""
    other = "[rank9]: " if prefix != "[rank9]: " else "[rank8]: "
    own = BACKWARD.replace(MESSAGE, "").splitlines()
    theirs = _traceback(("/home/me/project/eval.py", 7, "<module>", "model(x)")).splitlines()
    lines = []
    for i in range(max(len(own), len(theirs))):
        if i < len(own):
            lines.append(prefix + own[i])
        if i < len(theirs) and theirs[i] != MESSAGE:
            lines.append(other + theirs[i])
    text = "\n".join([*lines, prefix + MESSAGE, other + MESSAGE]) + "\n"
    location = find_oom_location(text)
    assert location is not None
    assert (location.path, location.line, location.source, location.phase) == (
        "/home/me/project/train.py",
        180,
        "loss.backward()",
        "backward",
    )
    assert location.script == "/home/me/project/train.py"


HF_TRAINER = (
    ("/home/me/sft/run_sft.py", 188, "<module>", "main()"),
    ("/home/me/sft/run_sft.py", 181, "main", "trainer.train()"),
    (f"{SP}/trl/trainer/sft_trainer.py", 915, "train", "return super().train(*args)"),
    (f"{SP}/transformers/trainer.py", 2241, "train", "return inner_training_loop("),
    (f"{SP}/transformers/trainer.py", 3740, "training_step", "self.accelerator.backward(loss)"),
    (f"{SP}/accelerate/accelerator.py", 2329, "backward", "loss.backward(**kwargs)"),
    (f"{SP}/torch/_tensor.py", 626, "backward", "torch.autograd.backward("),
)
LIGHTNING = (
    ("/home/me/pl/train.py", 40, "<module>", "trainer.fit(model, data)"),
    (f"{SP}/lightning/pytorch/trainer/trainer.py", 538, "fit", "call._call_and_handle_int"),
    (f"{SP}/lightning/pytorch/loops/optimization/automatic.py", 146, "__call__", ""),
    ("/home/me/pl/model.py", 88, "training_step", "logits = self.net(x)"),
)


@pytest.mark.parametrize(
    ("frames", "trainer"),
    [
        (HF_TRAINER, "transformers"),  # trl's SFTTrainer runs Hugging Face's loop
        (LIGHTNING, "lightning"),
        (tuple((p.replace("lightning/pytorch", "pytorch_lightning"), *r) for p, *r in LIGHTNING),
         "lightning"),
        # a script's own loop; a file of the user's named trainer.py is no library's
        ((("/home/me/project/trainer.py", 9, "<module>", "loss.backward()"),
          (f"{SP}/accelerate/accelerator.py", 2329, "backward", "loss.backward(**kwargs)")), None),
    ],
)
def test_the_trainer_whose_loop_ran_the_step_is_named(frames, trainer):
    location = find_oom_location(_traceback(*frames))
    assert location is not None and location.trainer == trainer


def _workload_code(text: str) -> str:
    from oomkit.diagnose.diagnosis import diagnose_oom_text
    from oomkit.diagnose.oom_text import parse_oom_text

    diagnosis = diagnose_oom_text(parse_oom_text(text), location=find_oom_location(text))
    (remedy,) = [r for r in diagnosis.remedies if r.title.startswith("reduce memory per step")]
    return remedy.code


def test_the_workload_remedy_speaks_the_trainer_s_arguments_and_measures_them_on_the_oom_s_gpu():
    """Tensors held 95% of a T4 (matched by the message's 14.75 GiB): the remedy says the
    Trainer's own arguments and gives the oomkit commands that measure them for the script
    Python ran, on that GPU, fit with the Trainer's batch argument; Lightning's Trainer gets
    its arguments; a plain script the PyTorch ways and the commands, its path quoted for the
    shell; a message without a traceback keeps the commands unwritten."""
    hf = _workload_code(_traceback(*HF_TRAINER))
    assert hf.splitlines() == [
        "# the Trainer's arguments: a smaller --per_device_train_batch_size with a larger",
        "# --gradient_accumulation_steps (same global batch), --gradient_checkpointing, --bf16,",
        "# --optim adamw_bnb_8bit (bitsandbytes);",
        "# measure each before a run (ARGS: the arguments the run was given):",
        "oomkit predict /home/me/sft/run_sft.py --gpu t4 -- ARGS",
        "oomkit fit /home/me/sft/run_sft.py --gpu t4 --batch-arg --per_device_train_batch_size "
        "-- ARGS  # the largest batch that fits",
    ]
    lightning = _workload_code(_traceback(*LIGHTNING))
    assert 'Trainer(precision="bf16-mixed")' in lightning
    assert "Trainer(accumulate_grad_batches=2)" in lightning
    assert lightning.endswith(
        "oomkit fit /home/me/pl/train.py --gpu t4 -- ARGS  # the largest batch that fits"
    )
    plain = _workload_code(
        _traceback(("/home/me/my run/train.py", 75, "<module>", "loss.backward()"))
    )
    assert plain.startswith("# a smaller batch with gradient accumulation")
    assert "oomkit predict '/home/me/my run/train.py' --gpu t4 -- ARGS" in plain
    assert _workload_code(MESSAGE).endswith(
        "an 8-bit optimizer;\n# `oomkit predict` or `oomkit fit` measure each on your step"
    )


def test_a_device_the_catalog_lacks_is_named_by_its_total_memory():
    """A 30 GiB device matches no catalog GPU: the commands give its size as --gpu."""
    text = _traceback(("/home/me/train.py", 5, "<module>", "loss.backward()")).replace(
        "14.75 GiB of which", "30.00 GiB of which"
    )
    assert "oomkit predict /home/me/train.py --gpu 30.00GiB -- ARGS" in _workload_code(
        text.replace("14.06 GiB is allocated", "29.00 GiB is allocated").replace(
            "14.52 GiB memory", "29.60 GiB memory"
        )
    )

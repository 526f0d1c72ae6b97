"""CUDA as the user's code sees it at every stage: import, builder, step (issue 34, item 1)."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from oomkit.core.gpus import get_gpu
from oomkit.core.target import Target
from oomkit.errors import UserCodeError
from oomkit.prediction.predictor import predict
from oomkit.prediction.tracing import trace_step
from oomkit.scenario.user_function import load_user_step

RTX4090 = Target.resolve("rtx4090")

# The lines the issue measured failing: a module-level device choice, model.to(device) in the
# builder, x.to(device, non_blocking=True) and torch.randint(device="cuda") in the step.
AS_PEOPLE_WRITE_IT = '''
import torch

device = "cuda" if torch.cuda.is_available() else "cpu"


def build(batch_size=8):
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(),
                                torch.nn.Linear(1024, 256)).to(device)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(batch_size, 256)

    def step():
        xb = x.to(device, non_blocking=True)
        noise = torch.randint(0, 10, (batch_size, 256), device="cuda")
        loss = (model(xb) + noise).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

    return step, (model, opt, x)
'''

# The same step in the builder contract's own terms: everything on the default (meta) device.
ON_THE_DEFAULT_DEVICE = '''
import torch


def build(batch_size=8):
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(),
                                torch.nn.Linear(1024, 256))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(batch_size, 256)

    def step():
        xb = x
        noise = torch.randint(0, 10, (batch_size, 256))
        loss = (model(xb) + noise).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

    return step, (model, opt, x)
'''


def _peaks(path, gpu=RTX4090):
    user = load_user_step(f"{path}:build", batch_size=8, gpu=gpu.gpu)
    result = predict(user.step_fn, track=user.track, target=gpu, steps=3)
    return result.peak_reserved_bytes, result.peak_allocated_bytes


def test_the_lines_people_write_predict_as_the_meta_builder(tmp_path):
    """device chosen at import, .to(device), .to(device, non_blocking=True), device="cuda" in the
    step: no error, and byte for byte the prediction of the same step on the default device."""
    written = tmp_path / "written.py"
    written.write_text(AS_PEOPLE_WRITE_IT)
    meta = tmp_path / "meta.py"
    meta.write_text(ON_THE_DEFAULT_DEVICE)
    assert _peaks(written) == _peaks(meta)


def _probe(tmp_path, monkeypatch, body, gpu_name):
    """Run ``body`` in a step of a builder file; what it saw lands in probe_store.SEEN."""
    (tmp_path / "probe_store.py").write_text("SEEN = {}\n")
    path = tmp_path / "probe.py"
    path.write_text(
        textwrap.dedent(
            """
            import torch
            from probe_store import SEEN

            SEEN["at_import"] = torch.cuda.is_available()


            def build():
                model = torch.nn.Linear(4, 4).cuda()

                def step():
            %s
                    model(torch.ones(2, 4, device="cuda:0")).sum().backward()

                return step, (model,)
            """
        )
        % textwrap.indent(textwrap.dedent(body), " " * 8)
    )
    monkeypatch.delitem(sys.modules, "probe_store", raising=False)
    user = load_user_step(f"{path}:build", gpu=get_gpu(gpu_name))
    trace_step(lambda *tracked: user.step_fn(), *user.track, gpu=get_gpu(gpu_name))
    seen = dict(sys.modules["probe_store"].SEEN)
    monkeypatch.delitem(sys.modules, "probe_store")
    return seen


@pytest.mark.parametrize(("gpu_name", "bf16"), [("rtx4090", True), ("t4", False)])
# bf16: is_bf16_supported(including_emulation=False), True from sm 8.0 (the default call is True
# on a T4 too: torch/cuda/__init__.py, a bf16 tensor can be made there).
def test_torch_cuda_answers_for_the_target_in_the_step(tmp_path, monkeypatch, gpu_name, bf16):
    """is_available at import; is_bf16_supported, get_device_properties, current_device,
    set_device and synchronize in the step: the target GPU's answers."""
    seen = _probe(
        tmp_path,
        monkeypatch,
        """
        torch.cuda.set_device(0)
        torch.cuda.synchronize()
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        SEEN.update(bf16=torch.cuda.is_bf16_supported(including_emulation=False), name=props.name,
                    memory=props.total_memory, capability=(props.major, props.minor))
        """,
        gpu_name,
    )
    gpu = get_gpu(gpu_name)
    assert seen == {
        "at_import": True,
        "bf16": bf16,
        "name": gpu.name,
        "memory": gpu.total_memory_bytes,
        "capability": gpu.compute_capability,
    }


def test_a_cpu_batch_copied_to_cuda_is_an_allocation_of_its_bytes():
    """x.pin_memory().to("cuda", non_blocking=True) of a 64x512 fp32 CPU batch: one 131072-byte
    allocation on the target, as cudaMemcpyAsync into a new block."""
    batch = torch.randn(64, 512)

    def step():
        moved = batch.pin_memory().to("cuda", non_blocking=True)
        assert moved.is_meta
        moved.cuda()  # already there: nothing more

    recording = trace_step(step)
    assert [e.size for e in recording.events if e.action == "alloc"] == [131072]


def test_a_traced_tensor_sent_back_follows_the_value_rules():
    """.cpu() of a traced tensor then .item(): a stand-in read (the loss logged), not a failure."""

    def step():
        loss = torch.ones(3, device="cuda").sum() * torch.randn(1, device="cuda").sum()
        loss.cpu().item()

    recording = trace_step(step)
    assert any("Tensor.item() read a tensor value" in w for w in recording.warnings)


def test_tied_weights_stay_tied_when_a_cpu_model_moves_to_cuda():
    """A CPU model whose output layer shares the embedding's weight, then .to("cuda") with its
    optimizer already built: one weight, one gradient, one pair of Adam states (CUDA keeps
    the Parameter in place; meta would have made two)."""

    def build_and_step():
        embed = torch.nn.Embedding(1000, 64, device="cpu")
        head = torch.nn.Linear(64, 1000, bias=False, device="cpu")
        head.weight = embed.weight
        model = torch.nn.Sequential(embed, head)
        opt = torch.optim.Adam(model.parameters())
        model.to("cuda")
        assert embed.weight is head.weight
        assert opt.param_groups[0]["params"][0] is embed.weight
        model(torch.zeros(2, 8, dtype=torch.long, device="cuda")).sum().backward()
        opt.step()

    recording = trace_step(build_and_step)
    weight_bytes = 1000 * 64 * 4
    by_kind = {"parameter": 0, "gradient": 0, "optimizer_state": 0}
    for event in recording.events:
        category = dict(event.tags)["category"]
        if event.action == "alloc" and event.size == weight_bytes and category in by_kind:
            by_kind[category] += 1
    assert by_kind == {"parameter": 1, "gradient": 1, "optimizer_state": 2}


CHOSE_CPU = '''
import torch

device = "cuda" if torch.cuda.is_available() else "cpu"
'''


def test_a_file_that_chose_the_cpu_is_told_so(tmp_path, monkeypatch):
    """A module imported without the emulated GPU picked "cpu": its CPU batch fed to a model on
    the GPU raises, naming the line that chose the CPU."""
    (tmp_path / "settings_cpu.py").write_text(CHOSE_CPU)
    monkeypatch.syspath_prepend(str(tmp_path))
    import settings_cpu  # imported here, where CUDA is absent

    assert settings_cpu.device == "cpu"
    with torch.device("meta"):
        model = torch.nn.Linear(16, 16)

    def step(*_tracked):
        batch = torch.randn(4, 16, device=settings_cpu.device)
        model(batch).sum().backward()

    with pytest.raises(UserCodeError) as raised:
        trace_step(step, model)
    message = str(raised.value)
    assert "a CPU tensor (shape (4, 16)) goes into Linear" in message
    assert "settings_cpu.py:4 (device = 'cpu') chose the CPU" in message


STEP_RUNS_FIT = '''
import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 2)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def build():
    trainer = pl.Trainer(accelerator="gpu", devices=1, max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False)
    net = Net()
    loader = DataLoader(TensorDataset(torch.randn(16, 8, device="cpu")), batch_size=4)

    def step():
        trainer.fit(net, loader)

    return step, (net,)
'''

STEP_RUNS_TRAIN = '''
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


def build():
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    args = TrainingArguments(output_dir="out", max_steps=1, report_to="none")
    trainer = Trainer(model=model, args=args)

    def step():
        trainer.train()

    return step, (model,)
'''


@pytest.mark.parametrize(
    ("source", "said"),
    [(STEP_RUNS_FIT, "Lightning's trainer.fit()"), (STEP_RUNS_TRAIN, "the transformers trainer.train()")],
)
def test_a_step_that_runs_a_trainer_gets_the_trainer_contract(tmp_path, monkeypatch, source, said):
    """trainer.fit(...) / trainer.train() inside the step: one line with the trainer contract,
    not advice about .item() or attention masks."""
    path = tmp_path / "fits.py"
    path.write_text(source)
    monkeypatch.chdir(tmp_path)
    user = load_user_step(f"{path}:build")
    with pytest.raises(UserCodeError) as raised:
        trace_step(lambda *tracked: user.step_fn(), *user.track)
    message = str(raised.value)
    assert f"the step called {said}; return the trainer from the builder instead" in message
    assert "(lightning_trainer, module[, datamodule_or_dataloader]) or the transformers.Trainer" in message
    assert "\n" not in message


def test_a_builder_that_trains_itself_is_told_it_is_a_script(tmp_path):
    """main() running its own loop and returning None: the steps it ran, and the script route."""
    path = tmp_path / "loop.py"
    path.write_text(
        textwrap.dedent(
            """
            import torch


            def main():
                model = torch.nn.Linear(8, 8)
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                for _ in range(5):
                    model(torch.randn(4, 8)).sum().backward()
                    opt.step()
            """
        )
    )
    with pytest.raises(UserCodeError) as raised:
        load_user_step(f"{path}:main")
    message = str(raised.value)
    assert "main() ran 5 optimizer step(s) itself and returned None" in message
    assert f"`oomkit predict {path}`" in message


def test_the_file_sees_its_own_argv_not_oomkit_s(tmp_path, monkeypatch):
    """sys.argv is [file.py] while the file imports, its builder runs and its step runs, as
    under `python file.py`: a main() that parses its arguments reads its defaults, not
    oomkit's command line (argparse exited 2 on `predict file.py:main --gpu h100`)."""
    path = tmp_path / "loop.py"
    path.write_text(
        textwrap.dedent(
            """
            import argparse
            import sys

            import torch

            def seen():
                with open(__file__ + ".argv", "a") as out:
                    out.write(repr(sys.argv) + "\\n")


            seen()


            def main():
                parser = argparse.ArgumentParser()
                parser.add_argument("--steps", type=int, default=3)
                args = parser.parse_args()
                seen()
                model = torch.nn.Linear(8, 8)
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                for _ in range(args.steps):
                    model(torch.randn(4, 8)).sum().backward()
                    opt.step()
            """
        )
    )
    monkeypatch.setattr(sys, "argv", ["oomkit", "predict", f"{path}:main", "--gpu", "h100"])
    with pytest.raises(UserCodeError) as raised:
        load_user_step(f"{path}:main")
    assert "main() ran 3 optimizer step(s) itself and returned None" in str(raised.value)
    assert sys.argv == ["oomkit", "predict", f"{path}:main", "--gpu", "h100"]
    assert (tmp_path / "loop.py.argv").read_text() == f"{[str(path)]!r}\n" * 2


@pytest.mark.parametrize("guarded", [True, False])
def test_a_failing_main_that_the_file_runs_is_pointed_to_the_script_route(tmp_path, guarded):
    """main() fails (here as a DataLoader's sampler does on meta) and `python file.py` runs it:
    the message says to predict the file as a script; a function the file does not run as its
    __main__ gets no such hint."""
    path = tmp_path / "train.py"
    source = textwrap.dedent(
        """
        import torch


        def main():
            order = torch.randperm(8).tolist()
            print(order)
        """
    )
    path.write_text(source + ('\nif __name__ == "__main__":\n    main()\n' if guarded else ""))
    with pytest.raises(UserCodeError) as raised:
        load_user_step(f"{path}:main")
    hint = (
        f"main() is what `python {path}` runs: if it is your training loop, predict the file as "
        f"a script (`oomkit predict {path} -- ARGS` runs it as python does and records its "
        "first steps)."
    )
    assert str(raised.value).endswith(hint) is guarded
    assert f"{path}:main: main() failed at {path}:6 in main: a device move" in str(raised.value)


def test_a_step_sees_its_file_s_argv(tmp_path, monkeypatch):
    """The step, run later by the tracer, sees [file.py] too; the caller's argv between."""
    path = tmp_path / "steps.py"
    path.write_text(
        textwrap.dedent(
            """
            import sys

            import torch

            def build():
                model = torch.nn.Linear(8, 8)

                def step():
                    with open(__file__ + ".argv", "a") as out:
                        out.write(repr(sys.argv) + "\\n")
                    model(torch.randn(4, 8)).sum().backward()

                return step, model
            """
        )
    )
    monkeypatch.setattr(sys, "argv", ["oomkit", "predict"])
    user = load_user_step(f"{path}:build")
    assert sys.argv == ["oomkit", "predict"]
    user.step_fn()
    assert sys.argv == ["oomkit", "predict"]
    assert (tmp_path / "steps.py.argv").read_text() == f"{[str(path)]!r}\n"


def test_timing_and_device_switching_lines_run_on_the_emulated_gpu():
    """with torch.cuda.device(0), torch.cuda.Event timing, synchronize, memory_summary: they run,
    the timing reads 0 ms, and only the tensor made on cuda is allocated (16 bytes)."""
    timings = []

    def step():
        with torch.cuda.device(0):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            torch.ones(4, device="cuda")
            end.record()
            torch.cuda.synchronize()
            timings.append(start.elapsed_time(end))
            assert isinstance(torch.cuda.memory_summary(), str)

    recording = trace_step(step)
    assert timings == [0.0]
    assert [e.size for e in recording.events if e.action == "alloc"] == [16]

"""predict_script on scripts as people write them: nanoGPT unmodified, HF Trainer, Lightning, accelerate.

Each script's peak equals, byte for byte, the builder form of the same step (``file.py:function``
through ``load_user_step`` and ``predict``), and the script's folder is left as it was apart from
what its steps write.
"""

from __future__ import annotations

import hashlib
import pickle
import shutil
import sys
import textwrap
import types
import warnings
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from _folders import files_in

from oomkit.core.target import Target
from oomkit.prediction.predictor import predict
from oomkit.prediction.scripts import predict_script
from oomkit.prediction.tracing.script_run import fresh_accelerate_state
from oomkit.scenario.user_function import load_user_step

RTX4090 = Target.resolve("rtx4090")
NANOGPT = Path(__file__).resolve().parents[1] / "fixtures" / "nanogpt"
# Small enough to run in seconds on a CPU (one block: the script route, not the depth, is the
# point); the script's own --key=value overrides.
NANOGPT_ARGS = [
    "config/train_shakespeare_char.py",
    "--n_layer=1",
    "--n_head=2",
    "--n_embd=64",
    "--block_size=64",
    "--batch_size=8",
    "--eval_iters=2",
]

# nanoGPT's training step at the same sizes, written as a builder. The script's loop keeps
# `logits, loss` and the next batch in globals between iterations; so does `state`.
NANOGPT_TWIN = '''
import torch
from model import GPT, GPTConfig

device = "cuda" if torch.cuda.is_available() else "cpu"


def build():
    config = GPTConfig(n_layer=1, n_head=2, n_embd=64, block_size=64, bias=False,
                       vocab_size=65, dropout=0.2)
    model = GPT(config).to(device)
    optimizer = model.configure_optimizers(1e-1, 1e-3, (0.9, 0.99), "cuda")
    ctx = torch.amp.autocast("cuda", dtype=torch.bfloat16)

    def batch():
        return (torch.randint(65, (8, 64), device=device), torch.randint(65, (8, 64), device=device))

    state = {"xy": batch()}

    def step():
        with ctx:
            logits, loss = model(*state["xy"])
            state["out"] = logits, loss / 1  # loss / gradient_accumulation_steps
        del logits, loss
        state["xy"] = batch()
        state["out"][1].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, (model, optimizer, state)
'''

NANOGPT_TWIN_COMPILED = NANOGPT_TWIN.replace(
    "    model = GPT(config).to(device)\n",
    "    model = GPT(config).to(device)\n    model = torch.compile(model)\n",
).replace("model.configure_optimizers", "model._orig_mod.configure_optimizers")


@pytest.fixture(autouse=True)
def _accelerate_as_in_a_new_process():
    """accelerate's state is per process; each test's builders start from an empty one too."""
    with fresh_accelerate_state():
        yield


def _builder(folder, target, compile=False):
    user = load_user_step(str(folder / target), gpu=RTX4090.gpu)
    result = predict(user.step_fn, track=user.track, target=RTX4090, steps=3, compile=compile)
    return result.peak_reserved_bytes, result.peak_allocated_bytes


def _peaks(scripted):
    return scripted.prediction.peak_reserved_bytes, scripted.prediction.peak_allocated_bytes


@pytest.fixture
def nanogpt(tmp_path):
    """nanoGPT's files, unmodified, with small random data as data/shakespeare_char/prepare.py
    would write it (uint16 token ids, meta.pkl with the vocabulary size)."""
    folder = tmp_path / "nanoGPT"
    shutil.copytree(NANOGPT, folder)
    data = folder / "data" / "shakespeare_char"
    data.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for split, tokens in (("train", 20_000), ("val", 4_000)):
        rng.integers(0, 65, tokens, dtype=np.uint16).tofile(data / f"{split}.bin")
    with open(data / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 65, "itos": {}, "stoi": {}}, f)
    (folder / "twin.py").write_text(NANOGPT_TWIN)
    (folder / "twin_compiled.py").write_text(NANOGPT_TWIN_COMPILED)
    return folder


# sha256 of the files as published at karpathy/nanoGPT commit 3adf61e1 (README.md there).
_PUBLISHED_SHA256 = {
    "train.py": "413bd97b40bb400a2a0d01230e2946f056c263ebac1b7281c2367d964a123085",
    "model.py": "7c01703240dbec5d554527dc666e35b3df8391d0b117fddc07afcf325a21d11c",
    "configurator.py": "5cc23aca26b4ab3c0d9e5f82740f4781f9444f42718c15abcee70d93c5aabe8f",
    "config/train_shakespeare_char.py": (
        "9b41cdfb2c917259d796a8184d835221a349c23cd18a0a63b46da431d95d9c05"
    ),
}


def test_the_fixture_is_nanogpt_unmodified():
    """The copied files are nanoGPT's as published, byte for byte."""
    for name, digest in _PUBLISHED_SHA256.items():
        assert hashlib.sha256((NANOGPT / name).read_bytes()).hexdigest() == digest, name
    train = (NANOGPT / "train.py").read_text()
    assert "exec(open('configurator.py').read()) # overrides from command line or config file" in train
    assert "scaler.step(optimizer)" in train
    assert "MIT License" in (NANOGPT / "LICENSE").read_text()


def test_nanogpt_train_py_predicts_its_builder_form(nanogpt, monkeypatch):
    """`python train.py config/train_shakespeare_char.py --n_layer=1 ...` (compile off): 3 steps,
    the same bytes as the step written as a builder; no checkpoint, only its out_dir made."""
    monkeypatch.chdir(nanogpt)
    before = files_in(nanogpt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # nanoGPT's torch.cuda.amp.GradScaler
        scripted = predict_script(
            "train.py", [*NANOGPT_ARGS, "--compile=False"], steps=3, target=RTX4090
        )
    assert scripted.run.steps_recorded == 3
    assert scripted.run.saves_skipped == 0
    assert _peaks(scripted) == _builder(nanogpt, "twin.py:build")
    # Recorded ready to compile, but nothing was: no torch.compile assumption is stated (it
    # had been, with "no graphs", for every script).
    assert "torch.compile" not in scripted.prediction.assumptions
    # os.makedirs(out_dir) runs before the first step, as it would on the GPU; nothing else.
    assert files_in(nanogpt) == sorted([*before, "out-shakespeare-char"])
    assert list((nanogpt / "out-shakespeare-char").iterdir()) == []


def test_nanogpt_compiled_records_its_torch_compile(nanogpt, monkeypatch):
    """nanoGPT's default compile=True: recorded compiled, equal to the compiled builder form."""
    monkeypatch.chdir(nanogpt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        scripted = predict_script("train.py", NANOGPT_ARGS, steps=3, target=RTX4090)
    assert scripted.run.steps_recorded == 3
    assert not any("recorded eagerly" in w for w in scripted.prediction.warnings)
    assert _peaks(scripted) == _builder(nanogpt, "twin_compiled.py:build", compile=True)
    # Its training step (forward and backward) and estimate_loss()'s eval under no_grad.
    assert "(1 backward, 1 forward, 1 inference)" in scripted.prediction.assumptions["torch.compile"]


HF_SCRIPT = '''
import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class Tokens(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.randint(0, 128, (32,))
        return {"input_ids": ids, "labels": ids}


def trainer():
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=128,
                                       n_positions=64))
    args = TrainingArguments(
        output_dir="out", per_device_train_batch_size=4, max_steps=20, report_to="none",
        save_strategy="no", logging_steps=1, dataloader_num_workers=0,
        bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
    )
    return Trainer(model=model, args=args, train_dataset=Tokens())


if __name__ == "__main__":
    t = trainer()
    t.train()
    t.save_model("out/final")
'''

LIGHTNING_SCRIPT = '''
import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(),
                                       torch.nn.Linear(256, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def parts():
    data = TensorDataset(torch.randn(256, 32, device="cpu"),
                         torch.randint(0, 4, (256,), device="cpu"))
    trainer = pl.Trainer(accelerator="auto", devices=1, max_epochs=3, precision="bf16-mixed",
                         logger=False, enable_checkpointing=False, enable_progress_bar=False)
    return trainer, Net(), DataLoader(data, batch_size=16)


if __name__ == "__main__":
    trainer, net, loader = parts()
    trainer.fit(net, loader)
    trainer.save_checkpoint("final.ckpt")
'''

ACCELERATE_SCRIPT = '''
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset


def main():
    accelerator = Accelerator(mixed_precision="bf16")
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = DataLoader(TensorDataset(torch.randn(256, 32), torch.randint(0, 4, (256,))),
                      batch_size=16)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    for epoch in range(3):
        for x, y in data:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    accelerator.save_state("checkpoint")


if __name__ == "__main__":
    main()
'''

ACCELERATE_TWIN = '''
import torch
from accelerate import Accelerator


def build():
    accelerator = Accelerator(mixed_precision="bf16")
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)

    def batch():
        return torch.randn(16, 32, device="cuda"), torch.randint(0, 4, (16,), device="cuda")

    state = {"xy": batch()}  # the loop's variables live on between iterations

    def step():
        x, y = state["xy"]
        state["loss"] = torch.nn.functional.cross_entropy(model(x), y)
        accelerator.backward(state["loss"])
        optimizer.step()
        optimizer.zero_grad()
        del x, y
        state["xy"] = batch()

    return step, (model, optimizer, state)
'''


def _write(folder, name, text):
    (folder / name).write_text(textwrap.dedent(text))


def test_an_accelerate_script_predicts_its_builder_form(tmp_path, monkeypatch):
    """Accelerator() on one GPU, the optimizer made before prepare(): 3 steps, the builder's
    bytes, and save_state after the loop never runs."""
    _write(tmp_path, "train_acc.py", ACCELERATE_SCRIPT)
    _write(tmp_path, "twin_acc.py", ACCELERATE_TWIN)
    monkeypatch.chdir(tmp_path)
    scripted = predict_script("train_acc.py", steps=3, target=RTX4090)
    assert scripted.run.steps_recorded == 3
    assert _peaks(scripted) == _builder(tmp_path, "twin_acc.py:build")
    assert files_in(tmp_path) == ["train_acc.py", "twin_acc.py"]


# A builder returning the trainer (tracing/trainers.py) restarts the trainer's loop for each
# step; what one run holds from one optimizer step into the next is kept there as the script's
# one loop keeps it (the Hugging Face loop's last tr_loss_step and grad_norm, Lightning's last
# logged value in callback_metrics), so the two forms give the same bytes.


@pytest.mark.parametrize(
    "more_arguments",
    # The loop's grad_norm comes from _clip_grad_norm, or, without clipping, from _get_grad_norm
    # alone; with accumulation tr_loss_step is rebound at each micro-batch.
    ["", "gradient_accumulation_steps=2, max_grad_norm=0.0,"],
)
def test_a_hugging_face_trainer_script_predicts_the_trainer_path(
    tmp_path, monkeypatch, more_arguments
):
    """Trainer(...).train() in __main__: 3 optimizer steps, the trainer path's bytes (peak
    allocated and reserved); save_model never runs.

    Each train() enters accelerate's ``clear_device_cache(garbage_collection=True)``
    (accelerate/utils/memory.py), whose ``gc.collect()`` is most of this test's time in a process
    that has imported torch and transformers and frees nothing on the emulated device: counted,
    not run."""
    import accelerate.utils.memory

    collect = mock.Mock(return_value=0)
    monkeypatch.setattr(accelerate.utils.memory, "gc", types.SimpleNamespace(collect=collect))
    _write(tmp_path, "train_hf.py", HF_SCRIPT.replace("logging_steps=1,", f"logging_steps=1, {more_arguments}"))
    (tmp_path / "twin_hf.py").write_text("from train_hf import trainer\n\n\ndef build():\n    return trainer()\n")
    monkeypatch.chdir(tmp_path)
    scripted = predict_script("train_hf.py", steps=3, target=RTX4090)
    assert scripted.run.steps_recorded == 3
    monkeypatch.delitem(sys.modules, "train_hf", raising=False)  # this test's file, not a cached one
    assert _peaks(scripted) == _builder(tmp_path, "twin_hf.py:build")
    assert not (tmp_path / "out" / "final").exists()
    assert collect.call_count > 0


@pytest.mark.parametrize("more_arguments", ["", "accumulate_grad_batches=2, gradient_clip_val=1.0,"])
def test_a_lightning_script_predicts_the_trainer_path(tmp_path, monkeypatch, more_arguments):
    """trainer.fit(...) in __main__, bf16-mixed on the emulated GPU: 3 steps, the trainer path's
    bytes (peak allocated and reserved); save_checkpoint never runs."""
    script = LIGHTNING_SCRIPT.replace('precision="bf16-mixed",', f'precision="bf16-mixed", {more_arguments}')
    _write(tmp_path, "train_pl.py", script)
    (tmp_path / "twin_pl.py").write_text("from train_pl import parts\n\n\ndef build():\n    return parts()\n")
    monkeypatch.chdir(tmp_path)
    scripted = predict_script("train_pl.py", steps=3, target=RTX4090)
    assert scripted.run.steps_recorded == 3
    monkeypatch.delitem(sys.modules, "train_pl", raising=False)  # this test's file, not a cached one
    assert _peaks(scripted) == _builder(tmp_path, "twin_pl.py:build")
    assert files_in(tmp_path) == ["train_pl.py", "twin_pl.py"]


TORCHRUN_SCRIPT = '''
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("nccl")
local_rank = int(os.environ["LOCAL_RANK"])
model = DDP(torch.nn.Linear(8, 8).to(local_rank), device_ids=[local_rank])
'''


def test_a_torchrun_script_exits_2_naming_its_line_and_world_size(tmp_path, capsys):
    """`oomkit predict ddp.py` without --world-size: init_process_group refused at its line,
    --world-size named, one line on stderr and no traceback."""
    from oomkit.interfaces.cli import main

    _write(tmp_path, "ddp.py", TORCHRUN_SCRIPT)
    assert main(["predict", str(tmp_path / "ddp.py"), "--gpu", "rtx4090"]) == 2
    err = capsys.readouterr().err
    assert "ddp.py:8 calls torch.distributed.init_process_group" in err
    assert "--world-size 8" in err
    assert "Traceback" not in err


def test_a_torchrun_script_with_world_size_is_rank_0_of_that_many(tmp_path, capsys):
    """`oomkit predict ddp.py --world-size 4`: the script as written (its `.to(local_rank)` and
    DDP's device_ids included), rank 0 of a fake group of 4; the same scenario from Python
    (world_size=4) and its config (model.script_world_size)."""
    import json

    import oomkit
    from oomkit.interfaces.cli import main

    _write(tmp_path, "ddp.py", TORCHRUN_SCRIPT)
    script = str(tmp_path / "ddp.py")
    assert main(["predict", script, "--world-size", "4", "--dump-config"]) == 0
    assert "script_world_size = 4" in capsys.readouterr().out
    assert main(["predict", script, "--world-size", "4", "--gpu", "rtx4090"]) == 0
    said = " ".join(capsys.readouterr().err.split())  # the console wraps the line
    assert f"recording torchrun --nproc-per-node=4 {script} as rank 0, on a fake process" in said
    assert main(["predict", script, "--world-size", "4", "--gpu", "rtx4090", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["description"] == f"{script}, rank 0 of 4"
    assert out["scenario"]["model"]["script_world_size"] == 4
    assert any("world size 4" in w for w in out["warnings"])
    assert out["peak_allocated_bytes"] > 0  # the replica's Linear and DDP's bucket
    # NCCL's memory for the communicator over the 4 ranks: the script wrapped DDP, so dp 4.
    assert out["target"]["parallel"]["dp"] == 4
    lines = [what for what, _, _ in out["distributed"]["outside_lines"]]
    assert "NCCL dp communicator (4 ranks): fixed cost beside its buffers" in lines
    api = oomkit.predict(script, world_size=4, gpu="rtx4090")
    assert (api.peak_allocated_bytes, api.peak_reserved_bytes) == (
        out["peak_allocated_bytes"], out["peak_reserved_bytes"]
    )


def test_nanogpt_under_torchrun_is_a_ddp_replica(nanogpt, monkeypatch):
    """nanoGPT's own DDP branch (RANK set: init_process_group, cuda:{LOCAL_RANK}, DDP, its
    get_batch indexing the data with CPU randint): rank 0 of 2 holds the model and DDP's
    gradient bucket of the same size."""
    monkeypatch.chdir(nanogpt)
    args = [*NANOGPT_ARGS, "--compile=False", "--gradient_accumulation_steps=2"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        scripted = predict_script("train.py", args, steps=3, target=RTX4090, world_size=2)
    assert scripted.run.steps_recorded == 3
    by = scripted.prediction.peak_allocated_at.by_category_bytes
    assert by["ddp_bucket"] > 0 and by["parameter"] >= by["ddp_bucket"]
    assert scripted.prediction.description.endswith(", rank 0 of 2")


LAST_RANK_HEAVY = """
import torch
import torch.distributed as dist

dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(rank % torch.cuda.device_count())
layers = 8 if rank == world - 1 else 2  # the last rank also evaluates a head
model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(layers)]).cuda()
opt = torch.optim.Adam(model.parameters())
for _ in range(3):
    model(torch.randn(64, 2048, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def test_a_script_s_rank_and_each_rank(tmp_path, capsys):
    """`--rank 3` records the script as rank 3; `--all-ranks` records each of the 4 ranks and
    returns the peaking one's prediction (the last rank: four times the Linears), naming it
    in the verdict and listing every rank's peaks (no pipeline stage: a script's own), the
    same from Python (rank=, all_ranks=) and in a config (model.script_rank)."""
    import json

    import oomkit
    from oomkit.interfaces.cli import main

    _write(tmp_path, "train.py", LAST_RANK_HEAVY)
    script = str(tmp_path / "train.py")
    base = ["predict", script, "--world-size", "4", "--gpu", "h100", "--json"]
    peaks = {}
    for rank in (0, 3):
        assert main([*base, "--rank", str(rank)]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["description"] == f"{script}, rank {rank} of 4"
        assert out["scenario"]["model"]["script_rank"] == rank
        peaks[rank] = out["peak_allocated_bytes"], out["peak_reserved_bytes"]
    linear = (2048 * 2048 + 2048) * 4
    # The last rank holds 6 more Linears, each with its gradient and Adam's two states.
    assert peaks[3][0] - peaks[0][0] >= 6 * 4 * linear
    assert main([*base, "--all-ranks"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["peak_allocated_bytes"], out["peak_reserved_bytes"]) == peaks[3]
    assert [(p["rank"], p["stage"]) for p in out["rank_peaks"]] == [
        (0, None), (1, None), (2, None), (3, None)
    ]
    assert [(p["peak_allocated_bytes"], p["peak_reserved_bytes"])
            for p in out["rank_peaks"]] == [peaks[0]] * 3 + [peaks[3]]
    assert out["verdict"].endswith("; rank 3 peaks, of 4 ranks")
    assert main(base[:-1] + ["--all-ranks"]) == 0
    said = " ".join(capsys.readouterr().err.split())
    assert f"{script} as each of its 4 ranks in turn, on a fake process group" in said
    api = oomkit.predict(script, world_size=4, all_ranks=True, gpu="h100")
    assert (api.peak_allocated_bytes, api.peak_reserved_bytes) == peaks[3]
    assert [p["rank"] for p in api.rank_peaks] == [0, 1, 2, 3]
    config = tmp_path / "run.toml"
    config.write_text(f'[model]\nscript = "{script}"\nscript_world_size = 4\nscript_rank = 3\n'
                      '[target]\ngpu = "h100"\n')
    assert main(["predict", "--config", str(config), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["peak_allocated_bytes"], out["peak_reserved_bytes"]) == peaks[3]


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--world-size", "4", "--rank", "4"],
         "--rank 4 is outside the script's 4 ranks (--world-size 4): use 0 to 3"),
        (["--world-size", "4", "--rank", "1", "--all-ranks"], "exclude each other"),
        (["--rank", "1"], "(a torchrun script: --world-size N)"),
        (["--set", "model.script_rank=1"], "pick ranks of a torchrun script: add --world-size N"),
        (["--world-size", "4", "--set", 'torchtitan.overrides=["x"]'],
         "torchtitan.overrides set a --torchtitan job: a torchrun script"),
        (["--fsdp", "4"], "a whole script shards itself: give the ranks torchrun starts it on"),
        (["--dp", "2"], "a whole script shards itself: give the ranks torchrun starts it on"),
    ],
)
def test_a_script_takes_its_ranks_as_world_size_only(tmp_path, capsys, flags, said):
    """A script's layout is its own: --fsdp/--dp, a rank it does not have, and a rank without
    --world-size are refused (exit 2, one line), before anything runs."""
    from oomkit.interfaces.cli import main

    _write(tmp_path, "ddp.py", TORCHRUN_SCRIPT)
    assert main(["predict", str(tmp_path / "ddp.py"), *flags]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err and "recording" not in err

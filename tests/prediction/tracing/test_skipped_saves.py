"""A script's torch.save writes nothing, and torch.load of what it saved gets it back
(skipped_saves.py). A load of a skipped save had read an empty or missing file (Lightning's
Tuner.scale_batch_size raised EOFError restoring its trainer)."""

from __future__ import annotations

import textwrap

import pytest
from _folders import files_in

from oomkit.core.gpus import GpuSpec
from oomkit.core.target import Target
from oomkit.prediction.tracing.script_run import record_script

MiB = 2**20
TARGET = Target.resolve(GpuSpec("test GPU", 1024 * MiB, 0))

SAVE_THEN_LOAD = """
import io, sys, torch
weights = torch.empty(1024, 1024, device="cuda")  # 4 MiB
counter = torch.tensor([7, 8])  # a host tensor with values
where = sys.argv[1]
if where == "path":
    torch.save({{"w": weights, "n": counter, "tag": "best"}}, "ckpt.pt")
    source = "ckpt.pt"
else:
    buffer = io.BytesIO()
    torch.save({{"w": weights, "n": counter, "tag": "best"}}, buffer)
    with open("copied.pt", "wb") as f:  # as Lightning's _atomic_save writes it
        f.write(buffer.getvalue())
    source = "copied.pt"
before = torch.cuda.memory_allocated()
loaded = torch.load(source, {map_location}, weights_only=False)
print("loaded", before, torch.cuda.memory_allocated(), loaded["tag"], loaded["n"].tolist(),
      loaded["w"].shape[0], loaded["w"] is weights, flush=True)
"""


@pytest.mark.parametrize("where", ["path", "buffer"])
@pytest.mark.parametrize(("map_location", "grown"), [("None", 4 * MiB), ("'cpu'", 0)])
def test_a_load_of_a_skipped_save_is_a_new_object_of_its_layout(tmp_path, capfd, where, map_location, grown):
    """Saved to a path (nothing written) or to a buffer whose bytes the script writes itself
    (a marker): the load gives back the dict, the host tensor's values, and a new 4 MiB device
    tensor (a real load's allocation), or, sent to the CPU, host memory."""
    (tmp_path / "train.py").write_text(textwrap.dedent(SAVE_THEN_LOAD.format(map_location=map_location)))
    run = record_script(tmp_path / "train.py", [where], steps=1, target=TARGET, cwd=tmp_path)
    printed = [line for line in capfd.readouterr().out.splitlines() if line.startswith("loaded")]
    assert printed == [f"loaded {4 * MiB} {4 * MiB + grown} best [7, 8] 1024 False"]
    assert run.saves_skipped == 1
    expected = ["train.py"] if where == "path" else ["copied.pt", "train.py"]
    assert files_in(tmp_path) == expected


def test_a_load_of_a_file_not_saved_here_is_torch_s_own(tmp_path, capfd):
    """A checkpoint on disk from before the run is read by torch: its values come back."""
    import torch

    torch.save({"n": torch.tensor([1, 2, 3])}, tmp_path / "old.pt")
    (tmp_path / "train.py").write_text(
        "import torch\nx = torch.empty(1, device='cuda')\n"
        "print('old', torch.load('old.pt')['n'].tolist(), flush=True)\n"
    )
    record_script(tmp_path / "train.py", [], steps=1, target=TARGET, cwd=tmp_path)
    assert "old [1, 2, 3]" in capfd.readouterr().out


TUNED = """
import torch, torch.nn as nn, lightning as L
from torch.utils.data import DataLoader, TensorDataset
from lightning.pytorch.tuner import Tuner


class M(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.batch_size = 64
        self.net = nn.Sequential(nn.Linear(256, 16384), nn.ReLU(), nn.Linear(16384, 256))

    def training_step(self, batch, i):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(8192, 256)), batch_size=self.batch_size)


m = M()
trainer = L.Trainer(accelerator="gpu", devices=1, max_steps=10, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
Tuner(trainer).scale_batch_size(m, mode="power", steps_per_trial=2, init_val=64, max_trials=10)
print("tuned", m.batch_size, flush=True)
trainer.fit(m)
"""


def test_lightning_s_tuner_searches_as_on_the_gpu_and_the_steps_after_it_are_recorded(tmp_path, capfd):
    """On a 400 MiB GPU the weights and gradients (32 MiB each, fp32) fit and the activations
    (batch x 16384 floats, 64 KiB a row, several kept for backward) grow with the batch: the
    Tuner doubles from 64 until the trial at 2048 raises torch.OutOfMemoryError, as on the
    GPU, and fits at 1024. Its trial steps do not count: the three recorded steps are the
    fit's. Its checkpoint restore reads the save it made (skipped)."""
    (tmp_path / "train.py").write_text(TUNED)
    gpu = Target.resolve(GpuSpec("test GPU", 400 * MiB, 0))
    run = record_script(tmp_path / "train.py", [], steps=3, target=gpu, cwd=tmp_path, ooms=True)
    out = capfd.readouterr().out
    tuned = [int(line.split()[1]) for line in out.splitlines() if line.startswith("tuned")]
    assert tuned == [1024]
    assert run.steps_recorded == 3
    assert any(
        note.startswith("Lightning's Tuner.scale_batch_size ran its trial steps before the recorded ones")
        and "it caught 1 out-of-memory error(s)" in note
        for note in run.notes
    )

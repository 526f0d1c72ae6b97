"""The Lightning monitor callback: one record per optimizer step, metrics logged, log written."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
L = pytest.importorskip("lightning.pytorch")

from _fake_device import GrowingDevice, MiB  # noqa: E402

from oomkit.interfaces.integrations.lightning_monitor import OomkitMonitorCallback  # noqa: E402
from oomkit.runtime.monitor import read_monitor_log  # noqa: E402


class _Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.logged: dict[str, float] = {}

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.layer(x).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(32, 4))
        return torch.utils.data.DataLoader(data, batch_size=4)


def _fit(callback, **kwargs):
    module = _Module()
    L.Trainer(
        callbacks=[callback],
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    ).fit(module)
    return module


def test_one_record_per_optimizer_step_with_accumulation(tmp_path):
    """max_steps=3 with accumulate_grad_batches=2: 3 records (6 batches), levels as read."""
    callback = OomkitMonitorCallback(device=GrowingDevice(), log_path=tmp_path / "m_{rank}.jsonl")
    _fit(callback, max_steps=3, accumulate_grad_batches=2)
    records = callback.monitor.records
    assert [r.step for r in records] == [1, 2, 3]
    assert [r.allocated_bytes for r in records] == [MiB, 2 * MiB, 3 * MiB]
    header, from_log = read_monitor_log(tmp_path / "m_0.jsonl")
    assert from_log == records and header["device"] == "fake"
    assert [s.steps for s in callback.summaries] == [3]


def test_metrics_are_logged_to_lightning():
    """The record's figures reach trainer.callback_metrics under oomkit/."""
    callback = OomkitMonitorCallback(device=GrowingDevice())
    module = _Module()
    trainer = L.Trainer(
        callbacks=[callback],
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        max_steps=2,
    )
    trainer.fit(module)
    assert float(trainer.callback_metrics["oomkit/allocated_bytes"]) == 2 * MiB
    assert float(trainer.callback_metrics["oomkit/reserved_bytes"]) == 8 * MiB


def test_auto_step_is_refused():
    """auto_step would double-count: the callback refuses it."""
    with pytest.raises(ValueError, match="drop auto_step"):
        OomkitMonitorCallback(auto_step=True)

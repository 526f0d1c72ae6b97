"""The Trainer monitor callback: one record per optimizer step, figures added to the logs."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _fake_device import GrowingDevice, MiB  # noqa: E402
from _hf_data import RowDataset  # noqa: E402

from oomkit.interfaces.integrations.huggingface_monitor import OomkitMonitorTrainerCallback  # noqa: E402


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x, labels):
        pred = self.linear(x).squeeze(-1)
        return {"loss": torch.nn.functional.mse_loss(pred, labels)}


class _Capture(transformers.TrainerCallback):
    def __init__(self) -> None:
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def test_records_each_optimizer_step_and_logs_figures(tmp_path):
    """max_steps=4, accumulation 2, logging every 2 steps: 4 records; logs carry the latest."""
    callback = OomkitMonitorTrainerCallback(device=GrowingDevice(), log_path=tmp_path / "m.jsonl")
    capture = _Capture()
    trainer = transformers.Trainer(
        model=_Model(),
        args=transformers.TrainingArguments(
            str(tmp_path),
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            max_steps=4,
            logging_steps=2,
        ),
        train_dataset=RowDataset(),
        callbacks=[callback, capture],
    )
    trainer.train()
    records = callback.monitor.records
    assert [r.step for r in records] == [1, 2, 3, 4]
    assert [r.allocated_bytes for r in records] == [MiB, 2 * MiB, 3 * MiB, 4 * MiB]
    step_logs = [log for log in capture.logs if "loss" in log]
    assert [log["oomkit/allocated_bytes"] for log in step_logs] == [2 * MiB, 4 * MiB]
    assert callback.summaries[0].steps == 4
    assert (tmp_path / "m.jsonl").read_text().count("\n") == 5


def test_auto_step_is_refused():
    """auto_step would double-count: the callback refuses it."""
    with pytest.raises(ValueError, match="drop auto_step"):
        OomkitMonitorTrainerCallback(auto_step=True)

"""The transformers Trainer integration: batch size from oomkit, recovered OOMs reported."""

from __future__ import annotations

import logging
import types
from unittest import mock

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _hf_data import RowDataset  # noqa: E402

from oomkit.interfaces.integrations.huggingface import OomkitTrainerCallback, apply_batch_size  # noqa: E402
from oomkit.runtime import resilient, use_device  # noqa: E402


class _Device:
    name = "fake"

    def empty_cache(self) -> None:
        pass


class _Prediction:
    batch_size = 24


def _args(tmp_path, **kwargs):
    return transformers.TrainingArguments(
        str(tmp_path), use_cpu=True, report_to=[], save_strategy="no", **kwargs
    )


def test_apply_batch_size_takes_a_prediction_as_given(tmp_path):
    """A prediction (int or result object) becomes per_device_train_batch_size, unprobed."""
    args = _args(tmp_path, per_device_train_batch_size=8)
    assert apply_batch_size(args, predicted=_Prediction()) is None
    assert args.per_device_train_batch_size == 24
    apply_batch_size(args, predict=lambda: 12, max_batch_size=10)
    assert args.per_device_train_batch_size == 10
    apply_batch_size(args)  # nothing asked: unchanged
    assert args.per_device_train_batch_size == 10


def test_apply_batch_size_confirms_the_prediction_with_real_probes(tmp_path):
    """With train_step, a prediction 1 too high costs one OOM and 90% of it is set."""
    args = _args(tmp_path, per_device_train_batch_size=8)

    def train_step(batch_size):
        if batch_size > 20:
            raise torch.OutOfMemoryError("CUDA out of memory.")

    with use_device(_Device()):
        result = apply_batch_size(args, predicted=21, train_step=train_step)
    assert result.sizes_tried == (21, 18) and result.oom_count == 1
    assert args.per_device_train_batch_size == 18


class _Model(torch.nn.Module):
    """Raises the real torch.OutOfMemoryError for batches above 4 samples."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)
        self.batch_sizes: list[int] = []

    def forward(self, x, labels):
        self.batch_sizes.append(len(x))
        if len(x) > 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        pred = self.linear(x).squeeze(-1)
        return {"loss": torch.nn.functional.mse_loss(pred, labels)}


def test_callback_reports_auto_find_batch_size_shrinking(tmp_path, caplog, monkeypatch):
    """auto_find_batch_size (accelerate: x0.9 per OOM) pays 9 OOMs from 16 to 4; each is logged.

    accelerate's ``clear_device_cache(garbage_collection=True)`` (accelerate/utils/memory.py,
    run by ``release_memory`` and ``find_executable_batch_size`` at every restart) calls
    ``gc.collect()`` three times per restart, most of this test's time in a process that has
    imported torch and transformers; it frees nothing the CPU model holds, so it is counted here
    instead of run."""
    import accelerate.utils.memory

    collect = mock.Mock(return_value=0)
    monkeypatch.setattr(accelerate.utils.memory, "gc", types.SimpleNamespace(collect=collect))
    model = _Model()
    callback = OomkitTrainerCallback()
    trainer = transformers.Trainer(
        model=model,
        args=_args(
            tmp_path, per_device_train_batch_size=16, auto_find_batch_size=True, max_steps=2
        ),
        train_dataset=RowDataset(),
        callbacks=[callback],
    )
    with caplog.at_level(logging.WARNING, "oomkit.interfaces.integrations.huggingface"):
        trainer.train()
    sizes = [16, 14, 12, 10, 9, 8, 7, 6, 5, 4]
    assert model.batch_sizes == sizes + [4]  # one OOM per size above 4, then two steps at 4
    assert callback.batch_size_changes == list(zip(sizes[:-1], sizes[1:], strict=True))
    assert caplog.records[0].getMessage() == (
        "training restarted after a CUDA OOM: batch size 16 -> 14"
    )
    assert len(caplog.records) == 9
    assert collect.call_count >= len(sizes) - 1  # at least once per restart


def test_callback_adds_resilient_counts_to_the_logs():
    """on_log adds the resilient step's OOM count and working micro-batch size."""
    model = torch.nn.Linear(2, 1)

    def step(x):
        if len(x) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        return model(x).mean()

    wrapped = resilient(step, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with use_device(_Device()):
        wrapped(torch.ones(8, 2))
    callback = OomkitTrainerCallback(resilient=wrapped)
    logs: dict = {"loss": 1.0}
    callback.on_log(None, None, None, logs=logs)
    assert logs == {"loss": 1.0, "oomkit/oom_count": 2, "oomkit/micro_batch_size": 2}

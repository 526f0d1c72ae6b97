"""The Lightning callback: batch size set at fit start from oomkit, recovered OOMs logged."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
L = pytest.importorskip("lightning.pytorch")

from oomkit.interfaces.integrations.lightning import OomkitCallback  # noqa: E402
from oomkit.runtime import resilient, use_device  # noqa: E402


class _Device:
    name = "fake"

    def __init__(self) -> None:
        self.empty_cache_calls = 0

    def empty_cache(self) -> None:
        self.empty_cache_calls += 1


class _Module(L.LightningModule):
    """Reads self.batch_size in train_dataloader and records the batch sizes it trains on."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_size = 32
        self.layer = torch.nn.Linear(4, 1)
        self.seen: list[int] = []

    def training_step(self, batch, batch_idx):
        (x,) = batch
        self.seen.append(len(x))
        return self.layer(x).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(40, 4))
        return torch.utils.data.DataLoader(data, batch_size=self.batch_size)


def _trainer(callback, **kwargs):
    return L.Trainer(
        callbacks=[callback],
        max_steps=2,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def test_prediction_sets_the_batch_size_before_the_dataloader_is_built():
    """predicted=5 replaces the module's 32 in the batches training sees."""
    module = _Module()
    callback = OomkitCallback(predicted=5)
    _trainer(callback).fit(module)
    assert module.seen == [5, 5] and module.batch_size == 5 and callback.result is None


def test_train_step_confirms_the_prediction_with_real_probes():
    """With train_step, predicted 12 OOMs (room for 10): probes 12 then 10, and 10 is used."""
    module = _Module()
    tried = []

    def train_step(batch_size):
        tried.append(batch_size)
        if batch_size > 10:
            raise torch.OutOfMemoryError("CUDA out of memory.")

    callback = OomkitCallback(predict=lambda: 12, train_step=train_step)
    with use_device(_Device()):
        _trainer(callback).fit(module)
    assert tried == [12, 10] and callback.result.oom_count == 1
    assert module.seen == [10, 10]


def test_missing_attribute_says_what_to_add():
    """A module without the attribute gets an error naming it and attr_name=."""
    module = _Module()
    callback = OomkitCallback(predicted=4, attr_name="bs")
    with pytest.raises(AttributeError, match="`bs`.*attr_name="):
        _trainer(callback).fit(module)


class _ManualModule(_Module):
    """Manual optimization with a resilient step that OOMs above 2 samples."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.batch_size = 8
        self.wrapped = None

    def on_fit_start(self):
        self.wrapped = resilient(
            self._step, optimizer=self.optimizers(), backward=self.manual_backward
        )
        self.callback.watch(self.wrapped)

    def _step(self, x):
        self.seen.append(len(x))
        if len(x) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        return self.layer(x).mean()

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.wrapped(x)


def test_recovered_ooms_of_a_resilient_step_are_logged():
    """A manual-optimization step recovers 8 -> 4 -> 2; the callback logs oomkit/oom_count = 2."""
    module = _ManualModule()
    callback = OomkitCallback()
    module.callback = callback
    trainer = _trainer(callback)
    with use_device(_Device()):
        trainer.fit(module)
    assert module.seen[:6] == [8, 4, 2, 2, 2, 2]
    assert module.wrapped.optimizer_steps == 2 and module.wrapped.oom_count == 2
    assert float(trainer.callback_metrics["oomkit/oom_count"]) == 2.0

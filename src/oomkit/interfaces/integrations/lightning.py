"""PyTorch Lightning callback: set the batch size at fit start, log OOMs that oomkit recovered.

Importing this module imports Lightning (``lightning.pytorch``, else ``pytorch_lightning``);
``import oomkit`` never does. Install with ``pip install oomkit[lightning]``.

Example::

    from oomkit.interfaces.integrations.lightning import OomkitCallback

    callback = OomkitCallback(predicted=oomkit.max_batch_size(...))   # or train_step=... to probe
    trainer = L.Trainer(callbacks=[callback])
    trainer.fit(model)          # model.batch_size (or its datamodule's) is set before data loads
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from oomkit.interfaces.integrations._common import EventCursor, choose_batch_size
from oomkit.runtime.batch_probe import BatchSizeResult
from oomkit.runtime.resilient import Resilient

# mypy checks against ``lightning.pytorch``; the standalone package has the same API under its
# own class names, which mypy would see as different types.
if TYPE_CHECKING:
    from lightning.pytorch import Callback
    from lightning.pytorch.utilities.parsing import lightning_hasattr, lightning_setattr
else:
    try:
        from lightning.pytorch import Callback
        from lightning.pytorch.utilities.parsing import lightning_hasattr, lightning_setattr
    except ImportError:  # the standalone package
        from pytorch_lightning import Callback
        from pytorch_lightning.utilities.parsing import lightning_hasattr, lightning_setattr

__all__ = ["OomkitCallback"]

logger = logging.getLogger(__name__)


class OomkitCallback(Callback):
    """Sets the batch size from oomkit's prediction or probe, and logs recovered OOMs.

    At ``on_fit_start`` (before Lightning builds the dataloaders, as its ``BatchSizeFinder``
    does) the size is chosen: with ``train_step``, by :func:`oomkit.find_batch_size` (at most 2
    real probes when a prediction is given); else the prediction itself. It is written to
    ``attr_name`` of the LightningModule, its hparams or its datamodule (Lightning's
    ``lightning_setattr``). After each training batch, OOMs that a :class:`~oomkit.Resilient`
    step recovered from are logged (Python logging and ``pl_module.log("oomkit/oom_count")``).

    Args:
        predicted: The predicted largest batch size: an int or a result with ``.batch_size``.
        predict: Called at fit start to get the prediction when ``predicted`` is None.
        train_step: ``train_step(batch_size)`` runs one real step; given, the size is probed.
        attr_name: The attribute that holds the batch size.
        resilient: The resilient step used in ``training_step`` (manual optimization), whose
            recoveries are logged.
        max_batch_size: Never set a larger size (e.g. the dataset size).
    """

    def __init__(
        self,
        *,
        predicted: Any = None,
        predict: Callable[[], Any] | None = None,
        train_step: Callable[[int], Any] | None = None,
        attr_name: str = "batch_size",
        resilient: Resilient | None = None,
        max_batch_size: int | None = None,
    ) -> None:
        self.predicted = predicted
        self.predict = predict
        self.train_step = train_step
        self.attr_name = attr_name
        self.max_batch_size = max_batch_size
        self.batch_size: int | None = None
        self.result: BatchSizeResult | None = None
        self._cursor = EventCursor(resilient)

    def watch(self, resilient: Resilient) -> None:
        """Report the recoveries of ``resilient`` (e.g. one made in ``on_fit_start``)."""
        self._cursor = EventCursor(resilient)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """Choose the batch size and write it where the dataloaders will read it."""
        chosen = choose_batch_size(
            train_step=self.train_step,
            predicted=self.predicted,
            predict=self.predict,
            max_batch_size=self.max_batch_size,
        )
        if chosen is None:
            return
        if not lightning_hasattr(pl_module, self.attr_name):
            raise AttributeError(
                f"OomkitCallback: neither the LightningModule, its hparams nor its datamodule "
                f"has `{self.attr_name}`; add it (and read it in train_dataloader) or pass "
                "attr_name="
            )
        self.batch_size, self.result = chosen
        lightning_setattr(pl_module, self.attr_name, self.batch_size)
        logger.info("oomkit: %s = %d", self.attr_name, self.batch_size)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Log the OOMs the resilient step recovered from during this batch."""
        wrapped = self._cursor.wrapped
        if self._cursor.new_events() and wrapped is not None:
            pl_module.log("oomkit/oom_count", float(wrapped.oom_count))

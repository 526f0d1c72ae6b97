"""Hugging Face ``transformers`` Trainer: set the batch size from oomkit, log recovered OOMs.

Importing this module imports ``transformers``; ``import oomkit`` never does.

The Trainer copies ``per_device_train_batch_size`` while it is constructed, before any callback
runs, so the batch size is set on the ``TrainingArguments`` beforehand with
:func:`apply_batch_size`. :class:`OomkitTrainerCallback` reports what happened in training: the
batch size shrinking under ``auto_find_batch_size`` (an OOM that accelerate recovered from), and
the recoveries of an :class:`~oomkit.Resilient` step. Example::

    args = TrainingArguments("out", per_device_train_batch_size=8)
    apply_batch_size(args, predicted=oomkit.max_batch_size(...))   # or train_step=... to probe
    trainer = Trainer(model, args, callbacks=[OomkitTrainerCallback()], ...)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback

from oomkit.interfaces.integrations._common import EventCursor, choose_batch_size
from oomkit.runtime.batch_probe import BatchSizeResult
from oomkit.runtime.resilient import Resilient

__all__ = ["OomkitTrainerCallback", "apply_batch_size"]

logger = logging.getLogger(__name__)


def apply_batch_size(
    args: Any,
    *,
    predicted: Any = None,
    predict: Callable[[], Any] | None = None,
    train_step: Callable[[int], Any] | None = None,
    max_batch_size: int | None = None,
) -> BatchSizeResult | None:
    """Set ``args.per_device_train_batch_size`` from a prediction or a probe; call before Trainer.

    Args:
        args: The ``TrainingArguments``.
        predicted: The predicted largest batch size per device: an int or a result with
            ``.batch_size``.
        predict: Called to get the prediction when ``predicted`` is None.
        train_step: ``train_step(batch_size)`` runs one real step; given, the size is confirmed
            or found by :func:`oomkit.find_batch_size`.
        max_batch_size: Never set a larger size.

    Returns:
        The probe result when ``train_step`` was given, else ``None``. ``args`` is left alone
        when there is neither a prediction nor a ``train_step``.
    """
    chosen = choose_batch_size(
        train_step=train_step, predicted=predicted, predict=predict, max_batch_size=max_batch_size
    )
    if chosen is None:
        return None
    size, result = chosen
    logger.info(
        "oomkit: per_device_train_batch_size %d -> %d", args.per_device_train_batch_size, size
    )
    args.per_device_train_batch_size = size
    return result


class OomkitTrainerCallback(TrainerCallback):
    """Logs OOMs recovered during training into the Python log and the Trainer's logs.

    Args:
        resilient: A resilient step whose recoveries are reported (e.g. used in a custom
            ``training_step``); ``None`` to report only ``auto_find_batch_size`` shrinking.

    Attributes:
        batch_size_changes: ``(from, to)`` per-step batch sizes each time the Trainer restarted
            training with a smaller batch after an OOM (``auto_find_batch_size``).
    """

    def __init__(self, resilient: Resilient | None = None) -> None:
        self.batch_size_changes: list[tuple[int, int]] = []
        self._last_batch_size: int | None = None
        self._cursor = EventCursor(resilient)

    def watch(self, resilient: Resilient) -> None:
        """Report the recoveries of ``resilient`` from now on."""
        self._cursor = EventCursor(resilient)

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Notice a smaller ``state.train_batch_size``: the Trainer recovered from an OOM."""
        size = state.train_batch_size
        if size is None:
            return
        if self._last_batch_size is not None and size < self._last_batch_size:
            self.batch_size_changes.append((self._last_batch_size, size))
            logger.warning(
                "training restarted after a CUDA OOM: batch size %d -> %d",
                self._last_batch_size,
                size,
            )
        self._last_batch_size = size

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        """Add ``oomkit/oom_count`` and ``oomkit/micro_batch_size`` to the Trainer's logs."""
        self._cursor.new_events()
        wrapped = self._cursor.wrapped
        if logs is None or wrapped is None:
            return
        logs["oomkit/oom_count"] = wrapped.oom_count
        if wrapped.micro_batch_size is not None:
            logs["oomkit/micro_batch_size"] = wrapped.micro_batch_size

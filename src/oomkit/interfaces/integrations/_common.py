"""What both framework callbacks share: resolving the batch size to use, reporting new OOM events."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from oomkit.errors import ConfigError
from oomkit.runtime.batch_probe import BatchSizeResult, find_batch_size
from oomkit.runtime.resilient import RecoveryEvent, Resilient

__all__ = ["EventCursor", "choose_batch_size"]

logger = logging.getLogger("oomkit.interfaces.integrations")


def choose_batch_size(
    *,
    train_step: Callable[[int], Any] | None,
    predicted: Any,
    predict: Callable[[], Any] | None,
    max_batch_size: int | None = None,
) -> tuple[int, BatchSizeResult | None] | None:
    """The batch size a callback should set, and the probe result when it probed.

    With ``train_step``: :func:`~oomkit.runtime.batch_probe.find_batch_size` (confirming the
    prediction with at most 2 real steps, or searching without one). Without it: the prediction
    as given (an int or a result with ``.batch_size``), unconfirmed. ``None`` when neither.
    """
    if train_step is not None:
        result = find_batch_size(
            train_step, predicted=predicted, predict=predict, max_batch_size=max_batch_size
        )
        return result.batch_size, result
    if predicted is None and predict is not None:
        predicted = predict()
    if predicted is None:
        return None
    size = int(getattr(predicted, "batch_size", predicted))
    if size < 1:
        raise ConfigError(f"the predicted batch size must be >= 1; got {size}")
    if max_batch_size is not None:
        size = min(size, max_batch_size)
    return size, None


class EventCursor:
    """Hands out each :class:`RecoveryEvent` of a :class:`Resilient` once, logging it."""

    def __init__(self, wrapped: Resilient | None) -> None:
        self.wrapped = wrapped
        self._seen = 0

    def new_events(self) -> list[RecoveryEvent]:
        """The events recorded since the last call."""
        if self.wrapped is None:
            return []
        events = self.wrapped.events[self._seen :]
        self._seen = len(self.wrapped.events)
        for event in events:
            logger.info(
                "recovered CUDA OOM in %s step %d: micro-batch %d -> %s",
                event.phase,
                event.step_index + 1,  # counted from 1 in messages (step_index is 0-based)
                event.failed_micro_batch_size,
                event.next_micro_batch_size,
            )
        return events

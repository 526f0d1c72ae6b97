"""Find the largest batch size that runs on the real device, paying as few OOMs as possible.

With a prediction (``predicted=`` or ``predict=``, e.g. from ``oomkit.max_batch_size``) the size
is confirmed with at most two real steps. Without one, an OOM-safe search grows the batch
exponentially from ``start`` and then bisects between the last success and the first failure,
cleaning up after every OOM. Every size tried is reported in order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from oomkit.errors import ConfigError, NoFeasibleBatchSizeError, OomRecoveryError
from oomkit.runtime import _distributed
from oomkit.runtime._distributed import Status
from oomkit.runtime.device import current_device, is_out_of_memory, release_after_oom

__all__ = ["BatchSizeResult", "BatchTrial", "find_batch_size"]

logger = logging.getLogger(__name__)

# One safer retry when the predicted size OOMs: 90% of it (a prediction that is off by a few
# percent, e.g. fragmentation the simulator did not see, is then caught with one more probe).
SAFER_FRACTION = 0.9


@dataclass(frozen=True)
class BatchTrial:
    """One real step run by :func:`find_batch_size`.

    Attributes:
        batch_size: The batch size tried.
        outcome: ``"ok"`` or ``"oom"`` (under torch.distributed: ``"oom"`` if any rank ran out).
    """

    batch_size: int
    outcome: Literal["ok", "oom"]


@dataclass(frozen=True)
class BatchSizeResult:
    """The batch size :func:`find_batch_size` chose and how it got there.

    Attributes:
        batch_size: The largest size that ran (the confirmed prediction, or the search's answer).
        method: ``"predicted"`` when the prediction (or the one safer size) ran, ``"search"``
            when the OOM-safe search decided.
        predicted: The predicted size given or computed; ``None`` without a prediction.
        probes: Every size tried, in order, with its outcome.
        warnings: Things the caller should know (a prediction that OOMed, a cap that was hit).
    """

    batch_size: int
    method: Literal["predicted", "search"]
    predicted: int | None
    probes: tuple[BatchTrial, ...]
    warnings: tuple[str, ...] = ()

    @property
    def sizes_tried(self) -> tuple[int, ...]:
        """The batch sizes tried, in order."""
        return tuple(p.batch_size for p in self.probes)

    @property
    def oom_count(self) -> int:
        """How many probes ran out of memory."""
        return sum(p.outcome == "oom" for p in self.probes)


class _Prober:
    def __init__(self, train_step: Callable[[int], Any], group: Any) -> None:
        self.train_step = train_step
        self.group = group
        self.probes: list[BatchTrial] = []
        self.outcomes: dict[int, bool] = {}

    def fits(self, batch_size: int) -> bool:
        if batch_size in self.outcomes:
            return self.outcomes[batch_size]
        ok = self._run(batch_size)
        self.outcomes[batch_size] = ok
        self.probes.append(BatchTrial(batch_size, "ok" if ok else "oom"))
        logger.info("batch size %d: %s", batch_size, "ok" if ok else "out of memory")
        return ok

    def _run(self, batch_size: int) -> bool:
        distributed = _distributed.active_world(self.group) is not None
        exc: BaseException | None = None
        try:
            self.train_step(batch_size)
        except Exception as caught:
            if not is_out_of_memory(caught):
                if distributed:
                    # Tell the other ranks to stop too before leaving, so none waits forever.
                    _distributed.agree(Status.FATAL, batch_size, self.group)
                raise
            exc = caught
        status = Status.OK if exc is None else Status.OOM
        if distributed:
            # Every rank takes the same branch of the search: OOM on any rank is OOM for all.
            status = _distributed.agree(status, batch_size, self.group).status
            if status == Status.FATAL:
                raise OomRecoveryError(
                    f"another rank raised an error while probing batch size {batch_size}, so "
                    "this rank stops too; see that rank's error"
                ) from exc
        if exc is not None or status != Status.OK:
            # Drop what the failed step's frames hold, gc, empty_cache (PyTorch FAQ on OOM handlers).
            release_after_oom(exc)
        else:
            # A step that returned holds nothing; return its cached blocks so the next probe
            # starts from the same empty cache (a full gc per probe costs seconds in big processes).
            current_device().empty_cache()
        return status == Status.OK


def find_batch_size(
    train_step: Callable[[int], Any],
    *,
    predicted: Any = None,
    predict: Callable[[], Any] | None = None,
    start: int = 1,
    max_batch_size: int | None = None,
    process_group: Any = None,
) -> BatchSizeResult:
    """The largest batch size for which ``train_step(batch_size)`` runs without a CUDA OOM.

    ``train_step(batch_size)`` must run one full step at that size (forward, backward and the
    optimizer step, the first one included since it allocates the optimizer state), creating its
    own batch, and should begin with ``optimizer.zero_grad(set_to_none=True)``: a probe that ran
    out of memory in backward leaves partial gradients behind, which the next probe would carry.
    OOM is detected by exception type; any other exception propagates.

    With a prediction, the predicted size is tried; if it OOMs, 90% of it is tried (at most 2
    real probes). If that OOMs too, the search below runs, bounded by the failed sizes.
    Without a prediction: try ``start``, double until a size OOMs (or ``max_batch_size`` runs),
    then bisect between the last size that ran and the first that did not; if ``start`` itself
    OOMs, halve down to the first size that runs, then bisect. After each OOM the memory the
    failed step held is released (:func:`~oomkit.runtime.device.release_after_oom`).

    Under ``torch.distributed`` every probe's outcome is agreed by all ranks (one all-reduce), so
    they all take the same path and return the same size.

    Args:
        train_step: Runs one step at the given batch size.
        predicted: The predicted largest size: an int, or a result with ``.batch_size`` (such as
            ``oomkit.max_batch_size``'s).
        predict: Called once, with no arguments, to get the prediction when ``predicted`` is
            None.
        start: First size of the search without a prediction.
        max_batch_size: Never try above this (e.g. the dataset size).
        process_group: The ``torch.distributed`` group, or ``None`` for the default one.

    Returns:
        The chosen size, the method, and every probe in order.

    Raises:
        NoFeasibleBatchSizeError: Even a batch of one sample ran out of memory.
        ValueError: ``start``, ``max_batch_size`` or the prediction is below 1.
    """
    if start < 1:
        raise ConfigError(f"start must be >= 1; got {start}")
    if max_batch_size is not None and max_batch_size < 1:
        raise ConfigError(f"max_batch_size must be >= 1 or None; got {max_batch_size}")
    if predicted is None and predict is not None:
        predicted = predict()
    guess = None if predicted is None else int(getattr(predicted, "batch_size", predicted))
    if guess is not None and guess < 1:
        raise ConfigError(
            f"the predicted batch size must be >= 1; got {guess}. If even one sample does not fit "
            "the prediction, find_batch_size cannot help: reduce the model or sequence length."
        )
    prober = _Prober(train_step, process_group)
    warnings: list[str] = []
    if max_batch_size is not None:
        start = min(start, max_batch_size)
        if guess is not None and guess > max_batch_size:
            warnings.append(f"predicted {guess} is above max_batch_size {max_batch_size}")
            guess = max_batch_size

    if guess is not None:
        if prober.fits(guess):
            return _result(guess, "predicted", guess, prober, warnings)
        safer = max(1, min(guess - 1, int(guess * SAFER_FRACTION)))
        if guess > 1 and prober.fits(safer):
            warnings.append(f"predicted batch {guess} ran out of memory; {safer} ran")
            return _result(safer, "predicted", guess, prober, warnings)
        warnings.append(
            f"predicted batch {guess} and the safer {safer} ran out of memory; searched below"
        )
        lo, hi = 0, safer
    else:
        lo, failed = _bracket(prober, start, max_batch_size)
        if failed is None:
            if lo == max_batch_size and lo != start:
                warnings.append(f"max_batch_size {max_batch_size} ran; larger sizes not tried")
            return _result(lo, "search", guess, prober, warnings)
        hi = failed

    if lo == 0:
        lo, hi = _descend(prober, hi)
    # Bisect: lo ran, hi did not.
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if prober.fits(mid):
            lo = mid
        else:
            hi = mid
    return _result(lo, "search", guess, prober, warnings)


def _bracket(prober: _Prober, start: int, cap: int | None) -> tuple[int, int | None]:
    """Double from ``start``: (last size that ran or 0, first that OOMed or None at the cap)."""
    size, last_ok = start, 0
    while prober.fits(size):
        last_ok = size
        if cap is not None and size >= cap:
            return last_ok, None
        size = size * 2 if cap is None else min(size * 2, cap)
    return last_ok, size


def _descend(prober: _Prober, failed: int) -> tuple[int, int]:
    """Halve below a size that OOMed until one runs: (that size, the smallest failure above it)."""
    hi = failed
    while hi > 1:
        size = hi // 2
        if prober.fits(size):
            return size, hi
        hi = size
    raise NoFeasibleBatchSizeError(
        "even a batch of 1 ran out of memory (sizes tried: "
        f"{', '.join(str(p.batch_size) for p in prober.probes)}); reduce the model, sequence "
        "length or precision, enable activation checkpointing, or use a larger GPU "
        "(`oomkit predict` shows what dominates the peak)."
    )


def _result(
    size: int,
    method: Literal["predicted", "search"],
    guess: int | None,
    prober: _Prober,
    warnings: list[str],
) -> BatchSizeResult:
    return BatchSizeResult(
        batch_size=size,
        method=method,
        predicted=guess,
        probes=tuple(prober.probes),
        warnings=tuple(warnings),
    )

"""Training steps that survive a CUDA OOM: split the batch into micro-batches and try again.

``oomkit.resilient`` wraps a step function that computes a loss. On an out-of-memory error the
wrapper frees what the failed attempt held, zeroes the partial gradients, halves the micro-batch,
and runs the *same* samples again with gradient accumulation, so the optimizer steps on the full
batch's gradient (up to floating-point rounding). The working micro-batch size is remembered for
later steps. Under ``torch.distributed`` all ranks agree on the outcome before anyone retries.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from oomkit.errors import BatchSplitError, ConfigError, OomRecoveryError
from oomkit.runtime import _distributed
from oomkit.runtime._distributed import Status
from oomkit.runtime.device import is_out_of_memory, release_after_oom

__all__ = ["RecoveryEvent", "Resilient", "batch_size_of", "resilient", "split_batch"]

logger = logging.getLogger(__name__)

Phase = Literal["train", "eval"]


@dataclass(frozen=True)
class RecoveryEvent:
    """One OOM that a :class:`Resilient` step caught and what it did about it.

    Attributes:
        step_index: Which call of the wrapper (0-based; evaluation calls count separately).
        phase: ``"train"`` or ``"eval"``; an eval OOM never changes the training micro-batch.
        batch_size: Samples in the batch given to the wrapper.
        failed_micro_batch_size: The micro-batch size that ran out of memory.
        next_micro_batch_size: The size of the retry; ``None`` when the wrapper gave up.
        micro_batch_index: Which micro-batch of the attempt failed on this rank; ``None`` when
            only another rank ran out of memory.
        rank: This process's rank under ``torch.distributed``; ``None`` in a single process.
        message: First line of the OOM message (or a note that another rank failed).
    """

    step_index: int
    phase: Phase
    batch_size: int
    failed_micro_batch_size: int
    next_micro_batch_size: int | None
    micro_batch_index: int | None
    rank: int | None
    message: str


def batch_size_of(batch: Any) -> int:
    """The number of samples in ``batch``: the shared first dimension of its tensors.

    Args:
        batch: A tensor, or a tuple/list/dict (nested allowed) whose tensors share dimension 0;
            other values (flags, strings) are carried along unchanged.

    Raises:
        BatchSplitError: No tensor with a first dimension, or tensors disagree on it.
    """
    sizes = {int(t.shape[0]) for t in _tensors(batch)}
    if len(sizes) != 1:
        found = "no tensor with a batch dimension" if not sizes else f"first dims {sorted(sizes)}"
        raise BatchSplitError(
            f"cannot split this batch into micro-batches: {found}. Pass a tensor, or a "
            "tuple/list/dict of tensors that share their first (batch) dimension."
        )
    return sizes.pop()


def split_batch(batch: Any, micro_batch_size: int) -> list[Any]:
    """Cut ``batch`` into consecutive micro-batches of ``micro_batch_size`` samples (last may be smaller).

    Every sample lands in exactly one micro-batch, in order; tensors are views (``torch.split``).

    Args:
        batch: As for :func:`batch_size_of`.
        micro_batch_size: Samples per micro-batch, at least 1.

    Raises:
        BatchSplitError: The batch cannot be split (see :func:`batch_size_of`).
        ValueError: ``micro_batch_size`` is below 1.
    """
    if micro_batch_size < 1:
        raise ConfigError(f"micro_batch_size must be >= 1; got {micro_batch_size}")
    n = batch_size_of(batch)
    count = -(-n // micro_batch_size)
    return [_take(batch, i * micro_batch_size, micro_batch_size) for i in range(count)]


def _tensors(batch: Any) -> Iterator[Any]:
    import torch

    if isinstance(batch, torch.Tensor):
        if batch.dim() > 0:
            yield batch
    elif isinstance(batch, Mapping):
        for value in batch.values():
            yield from _tensors(value)
    elif isinstance(batch, (tuple, list)):
        for value in batch:
            yield from _tensors(value)


def _take(batch: Any, start: int, length: int) -> Any:
    import torch

    if isinstance(batch, torch.Tensor):
        return batch.narrow(0, start, min(length, batch.shape[0] - start)) if batch.dim() else batch
    if isinstance(batch, Mapping):
        return {key: _take(value, start, length) for key, value in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_take(value, start, length) for value in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(_take(value, start, length) for value in batch)
    return batch


def _halve(size: int) -> int:
    # Ceil of half: 8 -> 4 -> 2 -> 1, 6 -> 3 -> 2 -> 1; never 0.
    return max(1, (size + 1) // 2)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _add_note(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note"):  # Python >= 3.11
        exc.add_note(note)


@dataclass
class _Attempt:
    status: int
    total: Any = None
    exc: BaseException | None = None
    failed_index: int | None = None


class Resilient:
    """A training step that recovers from CUDA OOMs by gradient accumulation over micro-batches.

    Calling contract: ``wrapper(batch, *args, **kwargs)`` calls ``step(micro_batch, *args,
    **kwargs)``, which runs the forward pass and **returns the loss without calling backward**.
    The wrapper owns the rest of the step:

    1. ``optimizer.zero_grad(set_to_none=True)``;
    2. for each micro-batch: ``backward(loss * weight)`` with ``weight = micro / batch`` for a
       mean-reduced loss (``loss_reduction="mean"``, the default: the loss is the mean over the
       micro-batch's samples) or 1 for ``loss_reduction="sum"``, so the accumulated gradient
       equals the full batch's;
    3. under ``torch.distributed``: agree with the other ranks (one all-reduce), then average the
       gradients over ranks when ``model`` is a ``DistributedDataParallel``;
    4. ``optimizer_step()`` (default ``optimizer.step()``), only after every micro-batch of the
       batch succeeded on every rank, so the optimizer never steps on a partial gradient.

    It returns the batch's loss, detached (the weighted sum of the micro-batch losses). On an OOM
    in steps 2–3 it releases memory (:func:`~oomkit.runtime.device.release_after_oom`), zeroes the
    gradients, halves the micro-batch and runs the whole batch again; samples of the failed attempt
    are run again, but each sample contributes exactly once to the gradient the optimizer uses.
    The working size is kept in :attr:`micro_batch_size` for later calls (it never grows back;
    call :meth:`reset` to try the full batch again). Each OOM is logged (logger
    ``oomkit.runtime.resilient``) and recorded in :attr:`events`. An OOM with micro-batches of
    one sample re-raises that ``torch.OutOfMemoryError`` with a note. An OOM inside
    ``optimizer_step`` is re-raised with a note (smaller micro-batches cannot help there).

    Evaluation never shrinks the training micro-batch: :meth:`evaluate`, or a call made while
    ``torch.is_grad_enabled()`` is False, runs ``step`` without backward or optimizer, splits on
    OOM with its own remembered size (:attr:`eval_micro_batch_size`), and returns the weighted sum
    of scalar results or the concatenation of per-sample results. Ranks do not agree on
    evaluation splits (no gradients are synchronized, and evaluation often runs on one rank).

    Under ``torch.distributed`` a rank that raises any other exception joins the agreement
    before re-raising, and the other ranks raise :class:`~oomkit.errors.OomRecoveryError`, so
    none waits forever. Collectives inside ``step``'s backward (FSDP, or DDP not passed as
    ``model``) are outside the wrapper's control and can still hang when one rank OOMs there.

    Args:
        step: ``step(micro_batch, *args, **kwargs) -> loss`` (a scalar tensor).
        optimizer: The optimizer; required for training calls (or ``optimizer_step`` and
            ``model``, whose ``zero_grad`` then clears partial gradients).
        model: The model; when it is a ``DistributedDataParallel``, micro-batches run under
            ``model.no_sync()`` and the wrapper averages gradients once all ranks succeeded.
        loss_reduction: How ``step`` reduces the loss over the micro-batch's samples.
        micro_batch_size: Start with micro-batches of this size instead of the full batch.
        backward: Replaces ``loss.backward()``, e.g. ``lambda loss: scaler.scale(loss).backward()``.
        optimizer_step: Replaces ``optimizer.step()``, e.g. to clip gradients or use a GradScaler.
        process_group: The ``torch.distributed`` group to agree in (``None``: the default group).
    """

    def __init__(
        self,
        step: Callable[..., Any],
        *,
        optimizer: Any = None,
        model: Any = None,
        loss_reduction: Literal["mean", "sum"] = "mean",
        micro_batch_size: int | None = None,
        backward: Callable[[Any], None] | None = None,
        optimizer_step: Callable[[], None] | None = None,
        process_group: Any = None,
    ) -> None:
        if loss_reduction not in ("mean", "sum"):
            raise ConfigError(f'loss_reduction must be "mean" or "sum"; got {loss_reduction!r}')
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ConfigError(f"micro_batch_size must be >= 1 or None; got {micro_batch_size}")
        self.step = step
        self.optimizer = optimizer
        self.model = model
        self.loss_reduction = loss_reduction
        self.micro_batch_size: int | None = micro_batch_size
        self.eval_micro_batch_size: int | None = None
        self.events: list[RecoveryEvent] = []
        self.optimizer_steps = 0
        self._backward = backward
        self._optimizer_step = optimizer_step
        self._group = process_group
        self._calls = {"train": 0, "eval": 0}
        functools.update_wrapper(self, step)

    @property
    def oom_count(self) -> int:
        """OOMs this wrapper caught, on this rank or (under torch.distributed) on another."""
        return len(self.events)

    def reset(self) -> None:
        """Forget the remembered micro-batch sizes: the next calls try the full batch again."""
        self.micro_batch_size = None
        self.eval_micro_batch_size = None

    def __call__(self, batch: Any, *args: Any, **kwargs: Any) -> Any:
        """Run one training step on ``batch`` (an evaluation step when grad is disabled)."""
        import torch

        if not torch.is_grad_enabled():
            return self._run(batch, args, kwargs, phase="eval")
        if self.optimizer is None and (self._optimizer_step is None or self.model is None):
            raise TypeError(
                "oomkit.resilient needs the optimizer for a training step, to zero partial "
                "gradients and step only on the full batch: resilient(step, optimizer=opt)"
            )
        return self._run(batch, args, kwargs, phase="train")

    def evaluate(self, batch: Any, *args: Any, **kwargs: Any) -> Any:
        """Run ``step`` on ``batch`` under ``torch.no_grad()``; an OOM here splits only evaluation."""
        import torch

        with torch.no_grad():
            return self._run(batch, args, kwargs, phase="eval")

    # -- the attempt loop -------------------------------------------------------------------

    def _run(self, batch: Any, args: tuple, kwargs: dict, *, phase: Phase) -> Any:
        train = phase == "train"
        step_index = self._calls[phase]
        self._calls[phase] += 1
        n = batch_size_of(batch)
        remembered = self.micro_batch_size if train else self.eval_micro_batch_size
        micro = n if remembered is None else min(remembered, n)
        world = _distributed.active_world(self._group)
        rank = None if world is None else world[0]
        if train:
            self._zero_grad()
        while True:
            attempt = self._attempt(batch, n, micro, args, kwargs, train=train)
            own_status = attempt.status
            if own_status == Status.OOM and micro == 1:
                own_status = Status.FATAL
            status = own_status
            proposal = _halve(micro) if attempt.status == Status.OOM else micro
            # Evaluation does not agree: it syncs no gradients, and often runs on one rank only.
            if world is not None and train:
                agreed = _distributed.agree(status, proposal, self._group)
                status, proposal = agreed.status, agreed.micro_batch_size
            if status == Status.OK:
                break
            gave_up = status == Status.FATAL
            self._record(
                RecoveryEvent(
                    step_index=step_index,
                    phase=phase,
                    batch_size=n,
                    failed_micro_batch_size=micro,
                    next_micro_batch_size=None if gave_up else proposal,
                    micro_batch_index=attempt.failed_index,
                    rank=rank,
                    message=(
                        _first_line(attempt.exc)
                        if attempt.exc is not None
                        else "another rank could not finish this attempt"
                    ),
                )
            )
            if train:
                self._zero_grad()
            if gave_up:
                self._give_up(attempt, micro, own=own_status == Status.FATAL)
            release_after_oom(attempt.exc)
            attempt = _Attempt(status=Status.OK)  # drop the exception before retrying
            micro = proposal
            if train:
                self.micro_batch_size = micro
            else:
                self.eval_micro_batch_size = micro
        if not train:
            return attempt.total
        if world is not None and _is_ddp(self.model):
            _distributed.average_gradients(self.model.parameters(), self._group)
        self._step_optimizer()
        return attempt.total

    def _attempt(
        self, batch: Any, n: int, micro: int, args: tuple, kwargs: dict, *, train: bool
    ) -> _Attempt:
        sync = self.model.no_sync() if train and _is_ddp(self.model) else contextlib.nullcontext()
        chunks = [batch] if micro >= n else split_batch(batch, micro)
        parts: list[Any] = []  # one per finished micro-batch: len(parts) is the failing index
        try:
            with sync:
                for chunk in chunks:
                    size = n if len(chunks) == 1 else batch_size_of(chunk)
                    weight = size / n if self.loss_reduction == "mean" else 1.0
                    result = self.step(chunk, *args, **kwargs)
                    if train:
                        _check_loss(result)
                        # Unsplit: backward on the loss itself, bit-identical to an unwrapped step.
                        self._run_backward(result if weight == 1.0 else result * weight)
                    parts.append((result.detach() if hasattr(result, "detach") else result, weight))
                    del result
        except Exception as exc:
            if is_out_of_memory(exc):
                return _Attempt(status=Status.OOM, exc=exc, failed_index=len(parts))
            if train and _distributed.active_world(self._group) is not None:
                # Tell the other ranks to stop before this one leaves, so none waits forever.
                _distributed.agree(Status.FATAL, micro, self._group)
            raise
        return _Attempt(status=Status.OK, total=self._combine(parts, train=train))

    def _combine(self, parts: Sequence[tuple[Any, float]], *, train: bool) -> Any:
        import torch

        first = parts[0][0]
        if len(parts) == 1:
            return first
        if isinstance(first, torch.Tensor) and first.dim() == 0:
            total = parts[0][0] * parts[0][1]
            for value, weight in parts[1:]:
                total = total + value * weight
            return total
        if not train and isinstance(first, torch.Tensor):
            return torch.cat([value for value, _ in parts])
        return [value for value, _ in parts]

    def _give_up(self, attempt: _Attempt, micro: int, *, own: bool) -> None:
        if own and attempt.exc is not None:
            exc = attempt.exc
            _add_note(
                exc,
                f"oomkit.resilient: micro-batches of {micro} sample(s) still ran out of memory; "
                "reduce the model, sequence length or precision, or enable activation "
                "checkpointing (oomkit predict shows what dominates the peak).",
            )
            logger.error("OOM with micro-batch %d; giving up", micro)
            raise exc
        logger.error("another rank could not recover; giving up at micro-batch %d", micro)
        raise OomRecoveryError(
            "another rank ran out of memory with micro-batches of one sample, or raised another "
            f"error, so this rank (at micro-batch {micro}) stops too; see the other ranks' errors."
        ) from attempt.exc

    def _record(self, event: RecoveryEvent) -> None:
        self.events.append(event)
        if event.next_micro_batch_size is not None:
            logger.warning(
                "CUDA OOM in %s step %d (batch %d, micro-batch %d%s); retrying with micro-batch %d",
                event.phase,
                event.step_index + 1,  # steps counted from 1 in messages, as users count
                event.batch_size,
                event.failed_micro_batch_size,
                "" if event.micro_batch_index is not None else ", on another rank",
                event.next_micro_batch_size,
            )

    # -- what the wrapper does to the optimizer ---------------------------------------------

    def _zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        elif self.model is not None:
            self.model.zero_grad(set_to_none=True)

    def _run_backward(self, loss: Any) -> None:
        if self._backward is not None:
            self._backward(loss)
        else:
            loss.backward()

    def _step_optimizer(self) -> None:
        try:
            if self._optimizer_step is not None:
                self._optimizer_step()
            else:
                self.optimizer.step()
        except Exception as exc:
            if is_out_of_memory(exc):
                _add_note(
                    exc,
                    "oomkit.resilient: the optimizer step itself ran out of memory (its state, "
                    "e.g. Adam's two moments, is allocated on the first step); smaller "
                    "micro-batches cannot help: use a smaller optimizer state or shard it.",
                )
            raise
        self.optimizer_steps += 1


def _check_loss(result: Any) -> None:
    import torch

    if not (isinstance(result, torch.Tensor) and result.dim() == 0):
        raise TypeError(
            "the step wrapped by oomkit.resilient must return the loss as a scalar tensor "
            f"(and not call backward itself); it returned {type(result).__name__}"
        )


def _is_ddp(model: Any) -> bool:
    if model is None:
        return False
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(model, DistributedDataParallel)


def resilient(
    step: Callable[..., Any] | None = None,
    *,
    optimizer: Any = None,
    model: Any = None,
    loss_reduction: Literal["mean", "sum"] = "mean",
    micro_batch_size: int | None = None,
    backward: Callable[[Any], None] | None = None,
    optimizer_step: Callable[[], None] | None = None,
    process_group: Any = None,
) -> Any:
    """Make a training step survive CUDA OOMs; a decorator or a wrapper.

    ``step(batch)`` returns the loss and does not call backward; see :class:`Resilient` for the
    whole contract. Example::

        @oomkit.resilient(optimizer=opt)
        def train_step(batch):
            inputs, labels = batch
            return F.cross_entropy(model(inputs), labels)

        for batch in loader:
            loss = train_step(batch)    # zero_grad, forward/backward (split on OOM), opt.step()

    Args:
        step: The step function; leave it out to use ``resilient(...)`` as a decorator.
        optimizer: As for :class:`Resilient`.
        model: As for :class:`Resilient`.
        loss_reduction: As for :class:`Resilient`.
        micro_batch_size: As for :class:`Resilient`.
        backward: As for :class:`Resilient`.
        optimizer_step: As for :class:`Resilient`.
        process_group: As for :class:`Resilient`.

    Returns:
        A :class:`Resilient`, or a decorator that makes one.
    """
    options = dict(
        optimizer=optimizer,
        model=model,
        loss_reduction=loss_reduction,
        micro_batch_size=micro_batch_size,
        backward=backward,
        optimizer_step=optimizer_step,
        process_group=process_group,
    )
    if step is None:
        return lambda fn: Resilient(fn, **options)
    return Resilient(step, **options)

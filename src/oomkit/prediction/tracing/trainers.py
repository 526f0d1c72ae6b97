"""Lightning and Hugging Face trainers as a step: one optimizer step of the trainer per call.

A ``file.py:function`` builder may return the trainer itself instead of a step function:

- Lightning (``lightning.pytorch`` or ``pytorch_lightning``): ``(trainer, module)`` or
  ``(trainer, module, data)``, where ``data`` is a ``LightningDataModule`` or what
  ``Trainer.fit`` takes as ``train_dataloaders`` (a ``DataLoader``).
- Hugging Face: a ``transformers.Trainer`` (its model, arguments and ``train_dataset``).

Each call of the step runs the trainer's own loop for one more optimizer step, on one emulated
CUDA GPU (``cuda_device.as_one_cuda_gpu``: the trainer picks the CUDA accelerator, its precision
plugin enters ``torch.autocast("cuda")``, its tensors land on meta). So its precision plugin,
gradient clipping, gradient accumulation (all micro-batches of the step), loss scaling and
logging run as written; what the trainer adds to a plain loop is recorded with the rest
(Lightning's logged values, accelerate's fp32 copy of the model's outputs, the Trainer's loss
total and gradient norm).

How a call continues the run (the optimizer, its state and the learning-rate schedule carry
over; each call starts a new pass over the data):
- Lightning: ``Trainer.fit`` again, with ``max_steps`` one above the steps done and one more
  epoch allowed (Lightning continues from its progress counters); ``configure_optimizers`` runs
  once and its answer is reused, as one fit uses one optimizer. Strategy teardown's moves to the
  CPU leave the meta tensors in place.
- Hugging Face: ``Trainer.train()`` again with a callback that stops it after one optimizer step
  (the Trainer keeps ``self.optimizer`` between calls; accelerate marks the model prepared and
  wraps its ``forward`` in autocast once, as in one run).

What one run keeps on the GPU from one optimizer step into the next, and a restart would free, is
kept, and freed where the run frees it (so the builder form equals the same trainer run by a
script, ``script_run``, byte for byte):
- Lightning: the logged values in the logger connector's ``callback_metrics`` (``self.log``'s
  clone, logger_connector/result.py ``_ResultMetric.update``), replaced after the next step's
  optimizer step (logger_connector.py ``on_batch_end``). One fit resets them once, when it
  starts (trainer/trainer.py ``_run``: ``reset_results()``, ``reset_metrics()``); a later call
  skips that reset.
- Hugging Face: the loop's ``tr_loss_step`` (the step's detached loss) and ``grad_norm`` (the
  total norm, a device scalar), locals of ``Trainer._run_epoch`` (transformers/trainer.py) that
  the next step rebinds: ``tr_loss_step`` when its ``training_step`` returns, ``grad_norm`` when
  it is set to ``None`` before the next clipping.
- Hugging Face ``torch_empty_cache_steps=N``: ``training_step`` empties the cache after the
  loss, before the backward, in the optimizer steps whose ``global_step`` N divides (0, N, 2N,
  ...; every micro-batch of such a step). A restarted ``train()`` counts from 0 again, so the
  recorded step i (from 0) empties where the run's step i does and not elsewhere.

What does not run, while oomkit runs the trainer (restored after each call):
- no files are written: Lightning's loggers and checkpoint callbacks are detached, and the
  Hugging Face Trainer's saves are cancelled (none holds GPU memory);
- validation does not run (the sanity check, ``val_check_interval``, ``eval_strategy``): the
  prediction is of the training steps (predict an evaluation step with ``oomkit fit --eval``).
- a Hugging Face ``train()`` restarted for the next step skips accelerate's ``gc.collect()``
  (its ``free_memory`` at the start of ``train()``), as one run collects only before its first.

Refused: more than one device, or a strategy other than Lightning's single-device one, and
DeepSpeed or FSDP in a Hugging Face Trainer (``TrainerRefusedError``, saying what to change).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from oomkit.errors import UserCodeError
from oomkit.prediction.tracing.cuda_device import as_one_cuda_gpu, emptying_cache

__all__ = ["TrainerRefusedError", "TrainerStep", "trainer_step"]

# The packages a Lightning trainer comes from (the unified package and the standalone one).
_LIGHTNING_PACKAGES = ("lightning.pytorch", "pytorch_lightning")
_ONE_GPU_ADVICE = "oomkit predicts one GPU's memory"


class TrainerRefusedError(UserCodeError):
    """The builder returned a trainer set up for something oomkit does not predict."""


@dataclass(frozen=True)
class TrainerStep:
    """A trainer that runs one optimizer step per call of ``step_fn``.

    Attributes:
        step_fn: runs the trainer's loop for one more optimizer step.
        track: what exists before the first step (the model).
        framework: ``"lightning"`` or ``"transformers"``.
        summary: what was found, for the report (``Lightning Trainer.fit, precision
            bf16-mixed, accumulate 1``).
    """

    step_fn: Callable[[], None]
    track: tuple[Any, ...]
    framework: str
    summary: str


def _lightning_root(obj: Any) -> Any | None:
    """The Lightning package ``obj``'s class comes from, when it is a Lightning Trainer."""
    for name in _LIGHTNING_PACKAGES:
        package = sys.modules.get(name)
        trainer_cls = getattr(package, "Trainer", None)
        if trainer_cls is not None and isinstance(obj, trainer_cls):
            return package
    return None


def _is_hf_trainer(obj: Any) -> bool:
    transformers = sys.modules.get("transformers")
    if transformers is None or "transformers.trainer" not in sys.modules:
        return False
    return isinstance(obj, sys.modules["transformers.trainer"].Trainer)


def trainer_step(result: Any, where: str) -> TrainerStep | None:
    """The trainer a builder returned, as a step; ``None`` when ``result`` holds no trainer.

    Args:
        result: what the builder returned.
        where: ``file.py:function``, for messages.

    Raises:
        TrainerRefusedError: a trainer for several devices or a sharded strategy, or a Lightning
            trainer returned without its module.
    """
    if _is_hf_trainer(result):
        return _hf_step(result, where)
    if _lightning_root(result) is not None:
        raise TrainerRefusedError(
            f"{where} returned a Lightning Trainer alone; return (trainer, module) or "
            "(trainer, module, datamodule_or_dataloader), what you pass to trainer.fit."
        )
    if isinstance(result, (tuple, list)) and 2 <= len(result) <= 3:
        package = _lightning_root(result[0])
        if package is not None:
            data = result[2] if len(result) == 3 else None
            return _lightning_step(package, result[0], result[1], data, where)
    return None


def _on_one_gpu() -> contextlib.ExitStack:
    """The trainer's loop on one emulated GPU, with the CPU as the default device.

    The recorder runs a step under ``torch.device("meta")``; a trainer's own CPU work (the
    sampler's ``randperm`` and its ``tolist()``, the loader's seed) must stay on the CPU, as on a
    GPU machine, where it has values. Its device tensors go to ``cuda``, which lands on meta.
    ``torch.cuda.empty_cache()`` does nothing here: each recorded step starts the trainer
    again, and its start and end empty the cache (Lightning's ``CUDAAccelerator``
    ``setup_device`` and ``teardown``, ``_clear_cuda_memory``; the Hugging Face Trainer's
    ``accelerator.free_memory()``), where one run empties it before its first step and after
    its last only.
    """
    stack = contextlib.ExitStack()
    stack.enter_context(as_one_cuda_gpu(cache_emptied=False))
    stack.enter_context(torch.device("cpu"))
    return stack


# ---------------------------------------------------------------------- Lightning


def _lightning_step(package: Any, trainer: Any, module: Any, data: Any, where: str) -> TrainerStep:
    if not isinstance(module, package.LightningModule):
        raise TrainerRefusedError(
            f"{where} returned a Lightning Trainer with a {type(module).__name__} where the "
            "LightningModule goes; return (trainer, module) or (trainer, module, data)."
        )
    single = importlib.import_module(f"{package.__name__}.strategies").SingleDeviceStrategy
    strategy = trainer.strategy
    if trainer.num_devices != 1 or not isinstance(strategy, single):
        raise TrainerRefusedError(
            f"{where}: the Lightning Trainer uses {type(strategy).__name__} on "
            f"{trainer.num_devices} devices; {_ONE_GPU_ADVICE}. Build it with devices=1 and "
            "the default strategy, then divide what sharding divides by hand."
        )
    if strategy.root_device.type != "cuda":
        raise TrainerRefusedError(
            f"{where}: the Lightning Trainer runs on {strategy.root_device}, not on a GPU "
            f"(accelerator={trainer.accelerator.__class__.__name__}); build it with "
            'accelerator="gpu" or "auto".'
        )
    checkpoint_cls = importlib.import_module(f"{package.__name__}.callbacks").Checkpoint
    datamodule_cls = package.LightningDataModule
    fit_kwargs: dict[str, Any] = {}
    if isinstance(data, datamodule_cls):
        fit_kwargs["datamodule"] = data
    elif data is not None:
        fit_kwargs["train_dataloaders"] = data
    configured: list[Any] = []
    original_configure = module.configure_optimizers

    def configure_once() -> Any:
        # One fit calls configure_optimizers once; the calls after the first continue it.
        if not configured:
            configured.append(original_configure())
        return configured[0]

    fits = [0]

    def step() -> None:
        loop = trainer.fit_loop
        saved = {
            "loggers": trainer.loggers,
            "callbacks": trainer.callbacks,
            "limit_val_batches": trainer.limit_val_batches,
            "num_sanity_val_steps": trainer.num_sanity_val_steps,
        }
        limits = (loop.epoch_loop.max_steps, loop.max_epochs)
        trainer.loggers = []
        trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, checkpoint_cls)]
        trainer.limit_val_batches = 0
        trainer.num_sanity_val_steps = 0
        loop.epoch_loop.max_steps = trainer.global_step + 1
        loop.max_epochs = trainer.current_epoch + 1
        module.configure_optimizers = configure_once
        try:
            with contextlib.ExitStack() as stack:
                if fits[0]:
                    # One fit resets the logger connector once, when it starts (trainer.py
                    # _run); the logged values of the last step stay on the GPU until the
                    # next step's on_batch_end replaces them.
                    connector = trainer._logger_connector
                    stack.enter_context(_first_call_skipped(connector, "reset_results"))
                    stack.enter_context(_first_call_skipped(connector, "reset_metrics"))
                stack.enter_context(_on_one_gpu())
                trainer.fit(module, **fit_kwargs)
            fits[0] += 1
        finally:
            del module.configure_optimizers
            loop.epoch_loop.max_steps, loop.max_epochs = limits
            for name, value in saved.items():
                setattr(trainer, name, value)

    precision = getattr(trainer.precision_plugin, "precision", "32-true")
    accumulate = trainer.accumulate_grad_batches
    clip = trainer.gradient_clip_val
    summary = (
        f"Lightning Trainer.fit, precision {precision}, accumulate {accumulate}"
        + (f", clip {clip}" if clip else "")
    )
    return TrainerStep(step, (module,), "lightning", summary)


# ---------------------------------------------------------------------- Hugging Face


def _hf_step(trainer: Any, where: str) -> TrainerStep:
    from transformers import TrainerCallback

    args = trainer.args
    if getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False):
        raise TrainerRefusedError(
            f"{where}: the Hugging Face Trainer shards with DeepSpeed or FSDP; {_ONE_GPU_ADVICE}. "
            "Build TrainingArguments without deepspeed= and fsdp=."
        )
    if args.n_gpu > 1 or args.world_size > 1:
        raise TrainerRefusedError(
            f"{where}: the Hugging Face Trainer runs on {max(args.n_gpu, args.world_size)} "
            f"devices; {_ONE_GPU_ADVICE}. Run it on one (CUDA_VISIBLE_DEVICES=0)."
        )
    if args.device.type not in ("cuda", "meta"):
        raise TrainerRefusedError(
            f"{where}: the Hugging Face Trainer runs on {args.device}, not on a GPU; build "
            "TrainingArguments without use_cpu=True."
        )
    if trainer.train_dataset is None:
        raise TrainerRefusedError(
            f"{where}: the Hugging Face Trainer has no train_dataset; pass one to Trainer(...)."
        )
    # training_step empties the cache after compute_loss when the state's global_step is a
    # multiple of this (transformers/trainer.py: clear_device_cache(), accelerate's
    # torch.cuda.empty_cache()).
    empty_every = getattr(args, "torch_empty_cache_steps", None)

    class _OneStep(TrainerCallback):
        """Stops after one optimizer step; cancels saves and evaluations (no files, no eval)."""

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            control.should_training_stop = True
            control.should_save = False
            control.should_evaluate = False

        def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            control.should_save = False
            control.should_evaluate = False

    carried = _LoopLocals()
    trains = [0]  # the train() calls begun

    def step() -> None:
        callback = _OneStep()
        trainer.add_callback(callback)
        try:
            with contextlib.ExitStack() as stack:
                if trains[0]:
                    stack.enter_context(_restart_without_gc_collect())
                # One run's global_step at this optimizer step: the train() calls before it.
                global_step = trains[0]
                trains[0] += 1
                stack.enter_context(carried.kept(trainer))
                if empty_every is not None and global_step % empty_every == 0:
                    stack.enter_context(_wrapped(trainer, "training_step", _emptying_cache))
                stack.enter_context(_on_one_gpu())
                trainer.train()
        finally:
            trainer.remove_callback(callback)

    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    summary = (
        f"Hugging Face Trainer.train, {precision}, accumulate {args.gradient_accumulation_steps}"
        + (f", clip {args.max_grad_norm}" if args.max_grad_norm else "")
    )
    return TrainerStep(step, (trainer.model,), "transformers", summary)


def _emptying_cache(original: Callable[..., Any]) -> Callable[..., Any]:
    """``training_step`` in which ``torch.cuda.empty_cache()`` is a request of the recording,
    for the steps one run's ``global_step`` test empties in. Elsewhere it does nothing
    (``_on_one_gpu``): the restarted ``train()``'s ``global_step`` is 0, so the trainer's own
    test would always empty."""

    def training_step(*args: Any, **kwargs: Any) -> Any:
        with emptying_cache():
            return original(*args, **kwargs)

    return training_step


@contextlib.contextmanager
def _restart_without_gc_collect() -> Iterator[None]:
    """While open, accelerate's device-cache clearing skips its ``gc.collect()``; the rest runs.

    Each ``train()`` begins with ``self.accelerator.free_memory()`` (transformers/trainer.py
    ``_inner_training_loop``: "reset everything"), which calls accelerate/utils/memory.py
    ``release_memory`` -> ``clear_device_cache(garbage_collection=True)``: a full
    ``gc.collect()`` (0.7 to 1.3 s measured in a process that has imported torch and
    transformers, most of a tiny Trainer's recorded step), then ``torch.cuda.empty_cache()``.
    ``auto_find_batch_size``'s decorator (``find_executable_batch_size``) clears the same way.
    Why skipping the collection in a restart is safe, and is what a GPU run does: one run calls
    ``train()`` once, so it collects once, before its first step; the step's later calls
    restart ``train()`` only to run one more optimizer step, and that run collects nothing
    between its steps (a device tensor held only by a reference cycle waits for Python's own
    collection there, as here). The first ``train()`` keeps its collection
    (``empty_cache`` does nothing in a trainer's step: ``_on_one_gpu``).
    """
    try:
        memory: Any = importlib.import_module("accelerate.utils.memory")
    except ImportError:  # pragma: no cover - transformers' Trainer requires accelerate
        yield
        return
    original = memory.clear_device_cache

    def clear_device_cache(garbage_collection: bool = False) -> None:
        original(garbage_collection=False)

    memory.clear_device_cache = clear_device_cache
    try:
        yield
    finally:
        memory.clear_device_cache = original


class _LoopLocals:
    """The tensors ``Trainer._run_epoch``'s locals hold from one optimizer step into the next.

    In one ``train()`` they live on between steps; a call of the step restarts ``train()``, so
    they are kept here and dropped where the loop rebinds them (transformers/trainer.py
    ``_run_epoch``):
    - ``tr_loss_step = self.training_step(...)``: the last step's loss goes when the next
      ``training_step`` returns;
    - ``grad_norm = None`` before ``self._clip_grad_norm(model)``, then
      ``grad_norm = self._get_grad_norm(...)``: the last norm goes before the next clipping.
    A Trainer without ``_get_grad_norm`` (older transformers) keeps its norm in a local of
    another shape; only the loss is kept then.
    """

    def __init__(self) -> None:
        self.loss: Any = None
        self.grad_norm: Any = None

    @contextlib.contextmanager
    def kept(self, trainer: Any) -> Iterator[None]:
        """While open, the Trainer's methods note what the loop's locals would hold."""

        def training_step(original: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                self.loss = original(*args, **kwargs)
                return self.loss

            return wrapper

        def clip(original: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                self.grad_norm = None
                return original(*args, **kwargs)

            return wrapper

        def norm(original: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                self.grad_norm = None
                self.grad_norm = original(*args, **kwargs)
                return self.grad_norm

            return wrapper

        with contextlib.ExitStack() as stack:
            stack.enter_context(_wrapped(trainer, "training_step", training_step))
            if hasattr(trainer, "_get_grad_norm") and hasattr(trainer, "_clip_grad_norm"):
                stack.enter_context(_wrapped(trainer, "_clip_grad_norm", clip))
                stack.enter_context(_wrapped(trainer, "_get_grad_norm", norm))
            yield


@contextlib.contextmanager
def _wrapped(
    obj: Any, name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> Iterator[None]:
    """``obj.name`` is ``wrap(obj.name)`` while open (an instance attribute, removed after)."""
    own = vars(obj)
    had, before = name in own, own.get(name)
    setattr(obj, name, wrap(getattr(obj, name)))
    try:
        yield
    finally:
        if had:
            setattr(obj, name, before)
        else:
            delattr(obj, name)


@contextlib.contextmanager
def _first_call_skipped(obj: Any, name: str) -> Iterator[None]:
    """While open, the first call of ``obj.name`` does nothing; later ones run."""
    skipped = [False]

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def once(*args: Any, **kwargs: Any) -> Any:
            if skipped[0]:
                return original(*args, **kwargs)
            skipped[0] = True
            return None

        return once

    with _wrapped(obj, name, wrap):
        yield

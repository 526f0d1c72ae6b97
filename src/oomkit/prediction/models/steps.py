"""Turn a built model into a step function: train, inference or greedy generation.

Shared by the presets and by Hugging Face models; the caller supplies how to run the model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

from oomkit.errors import OomkitError
from oomkit.prediction.models.optimizers import make_optimizer
from oomkit.prediction.models.options import BuiltStep, Precision, StepOptions

__all__ = ["ModelRunner", "Task", "build_step", "autocast_dtype", "model_dtype"]

Task = Literal[
    "causal_lm",
    "masked_lm",
    "image_classification",
    "sequence_classification",
    "token_classification",
]


@dataclass(frozen=True)
class ModelRunner:
    """How to call one model: what the step builder needs besides the model itself.

    Attributes:
        model: the module, already on its device and in its dtype.
        task: what its inputs and loss are.
        classes: vocabulary size (text) or number of classes (images).
        forward: inputs -> logits.
        new_cache: a fresh KV cache (``generate`` only).
        decode: (token ids, cache, logits_to_keep) -> logits, extending the cache (``generate``).
        train_outputs: (inputs, labels) -> the model's outputs with their ``loss``, computed by
            the model itself (a Hugging Face model's ``labels=`` path: ``ForCausalLMLoss``
            upcasts the logits to fp32 and shifts the labels). The training step keeps the
            outputs (logits included) alive until it ends, as a training loop's ``outputs``
            variable does. ``None``: ``forward`` then ``CrossEntropyLoss``, as a plain-torch
            loop computes the loss.
        make_labels: token ids -> the labels the model's loss takes, where they are not the ids
            themselves (a sequence classifier's ``[batch]`` class ids, a token classifier's
            ``[batch, seq]``); ``None``: a copy of the ids (language models).
    """

    model: torch.nn.Module
    task: Task
    classes: int
    forward: Callable[[torch.Tensor], torch.Tensor]
    new_cache: Callable[[], Any] | None = None
    decode: Callable[[torch.Tensor, Any, int], torch.Tensor] | None = None
    train_outputs: Callable[[torch.Tensor, torch.Tensor], Any] | None = None
    make_labels: Callable[[torch.Tensor], torch.Tensor] | None = None


def model_dtype(precision: Precision | None) -> torch.dtype:
    """Dtype of parameters, gradients and optimizer states: bf16 / fp16 only for pure ``bf16`` /
    ``fp16``; fp32 otherwise (mixed precision keeps fp32 master weights; ``None`` is fp32)."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision or "fp32", torch.float32)


def autocast_dtype(precision: Precision | None) -> torch.dtype | None:
    """The autocast dtype of a mixed precision, else ``None``."""
    return {"fp16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}.get(precision or "")


@contextlib.contextmanager
def _autocast(precision: Precision | None) -> Iterator[None]:
    dtype = autocast_dtype(precision)
    if dtype is None:
        yield
        return
    # The oomkit tracer emulates CUDA autocast (tracing/autocast.py); a CPU-only torch build
    # warns that CUDA autocast is disabled, which is expected on the meta device.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*CUDA is not available.*")
        ctx = torch.autocast("cuda", dtype=dtype)
    with ctx:
        yield


def _optimizer(options: StepOptions, model: torch.nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    # foreach=True is what CUDA parameters get by default (torch/optim/optimizer.py,
    # _default_to_fused_or_foreach); on meta the default would be the per-tensor loop.
    return make_optimizer(options.optimizer, params, options.optimizer_impl)


def _inputs(
    runner: ModelRunner, options: StepOptions, seq_len: int, image_size: int, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    batch = options.batch_size
    if runner.task == "image_classification":
        images = torch.randn(
            batch, 3, image_size, image_size, device=device, dtype=model_dtype(options.precision)
        )
        labels = torch.randint(runner.classes, (batch,), device=device)
        return images, labels
    if runner.make_labels is not None:
        ids = torch.randint(_vocab(runner), (batch, seq_len), device=device)
        return ids, runner.make_labels(ids)
    ids = torch.randint(runner.classes, (batch, seq_len), device=device)
    if runner.train_outputs is not None:
        # A Hugging Face model shifts the labels itself (ForCausalLMLoss); its collators pass a
        # copy of the ids (DataCollatorForLanguageModeling: labels = input_ids.clone()).
        return ids, ids.clone()
    # Labels are the ids shifted left by one (next-token targets; the last one is ignored), made
    # once so they count as input rather than as a copy inside the step.
    labels = torch.roll(ids, -1, dims=1)
    if device != "meta":
        labels[:, -1] = -100
    return ids, labels


def _vocab(runner: ModelRunner) -> int:
    """Token ids' range for a classifier of tokens: its input embedding's rows."""
    embeddings: Any = getattr(runner.model, "get_input_embeddings", None)
    rows = getattr(embeddings() if callable(embeddings) else None, "num_embeddings", None)
    return rows if isinstance(rows, int) else 2


def _loss(loss_fn: torch.nn.Module, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # A loss module rather than F.cross_entropy: the tracer then tags what the loss allocates
    # (autocast's fp32 copy of the logits, log_softmax, and their backward) "CrossEntropyLoss"
    # instead of leaving it outside any module. The reshapes are views: nothing is allocated.
    return loss_fn(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


class _GradScalerTensors:
    """The device tensors of ``torch.amp.GradScaler`` and its in-place kernels (fp16-mixed).

    Mirrors torch/amp/grad_scaler.py: ``_lazy_init_scale_growth_tracker`` (fp32 scale, int32
    growth tracker, on first ``scale``), ``scale`` (``loss * scale``), ``unscale_`` (``inv_scale =
    scale.double().reciprocal().float()``, a ``found_inf`` scalar, and
    ``_amp_foreach_non_finite_check_and_unscale_`` in place on the gradients) and ``update``
    (``_amp_update_scale_`` in place). Not modelled: skipping ``optimizer.step`` when a gradient is
    inf/NaN (GradScaler reads ``found_inf.item()``, which meta tensors cannot answer); the step
    always runs, as it does whenever gradients are finite.
    """

    def __init__(self) -> None:
        self.scale: torch.Tensor | None = None
        self.growth_tracker: torch.Tensor | None = None

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            self.scale = torch.full((), 2.0**16, dtype=torch.float32, device=loss.device)
            self.growth_tracker = torch.full((), 0, dtype=torch.int32, device=loss.device)
        return loss * self.scale

    def unscale_and_update(self, optimizer: torch.optim.Optimizer) -> None:
        assert self.scale is not None and self.growth_tracker is not None
        inv_scale = self.scale.double().reciprocal().float()
        found_inf = torch.full((), 0.0, dtype=torch.float32, device=self.scale.device)
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        optimizer.step()
        # GradScaler defaults: growth_factor 2.0, backoff_factor 0.5, growth_interval 2000.
        torch._amp_update_scale_(self.scale, self.growth_tracker, found_inf, 2.0, 0.5, 2000)

    def unscale(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """``GradScaler.unscale_`` alone (before clipping): ``inv_scale`` dies on return, the
        ``found_inf`` it returns is kept (``_per_optimizer_states``) until ``update``."""
        assert self.scale is not None
        inv_scale = self.scale.double().reciprocal().float()
        found_inf = torch.full((), 0.0, dtype=torch.float32, device=self.scale.device)
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        return found_inf

    def step_and_update(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
        """``GradScaler.step`` (already unscaled) then ``update``."""
        assert self.scale is not None and self.growth_tracker is not None
        optimizer.step()
        torch._amp_update_scale_(self.scale, self.growth_tracker, found_inf, 2.0, 0.5, 2000)


def build_step(
    runner: ModelRunner,
    options: StepOptions,
    *,
    title: str,
    seq_len: int,
    image_size: int,
    device: str,
    precision_source: str | None = None,
    loss_fn: torch.nn.Module | None = None,
) -> BuiltStep:
    """Make the step function of ``options.mode`` around an already-built model.

    Args:
        runner: the model and how to call it.
        options: batch, precision, optimizer, checkpointing, mode.
        title: model name for the description, e.g. ``"GPT-2 124M"``.
        seq_len: tokens per sequence (text) after defaults.
        image_size: pixels per side (vision) after defaults.
        device: where inputs are created (``"meta"`` to trace).
        precision_source: where ``options.precision`` came from when not given, for the
            description and ``BuiltStep.precision_source``.
        loss_fn: the training loss module; ``None``: ``torch.nn.CrossEntropyLoss()`` (a
            sharded compiled step passes it compiled, as torchtitan compiles its loss).

    Returns:
        The step; its ``step_fn`` accepts and ignores positional arguments, so
        ``trace_step(built.step_fn, *built.track)`` works.

    Raises:
        OomkitError: ``generate`` asked of a model that is not a causal language model.
    """
    if options.precision is None:
        options = dataclasses.replace(options, precision="fp32")
    model = runner.model
    params = sum(p.numel() for p in model.parameters())
    inputs, labels = _inputs(runner, options, seq_len, image_size, device)
    description = _describe(title, options, runner.task, seq_len, image_size, precision_source)
    precision = options.precision

    def built(step_fn: Callable[..., None], track: tuple[object, ...]) -> BuiltStep:
        return BuiltStep(step_fn, track, description, params, options, precision_source)

    if options.compile:
        runner = _compiled(runner)
    if options.mode == "train":
        model.train()
        optimizer = _optimizer(options, model)
        scaler = _GradScalerTensors() if precision == "fp16-mixed" else None
        loss_fn = torch.nn.CrossEntropyLoss() if loss_fn is None else loss_fn
        train_outputs = runner.train_outputs

        accumulate, max_norm = options.grad_accum, options.max_grad_norm
        trainer = options.trainer_mixed_precision
        if trainer in ("bf16", "fp16") and train_outputs is not None:
            train_outputs = _accelerate_forward(train_outputs, trainer)
        # trainer.py _inner_training_loop: `self._tr_loss = torch.tensor(0.0, device=args.
        # device)` before the first step, kept across steps (tracked, like the inputs).
        tr_loss = None if trainer is None else torch.tensor(0.0, device=device)
        empty_every = options.trainer_empty_cache_steps
        steps_done = [0]  # one run's global_step at the step being recorded

        def train_step(*_tracked: object) -> None:
            outputs = None
            empties = empty_every is not None and steps_done[0] % empty_every == 0
            steps_done[0] += 1
            # Gradient accumulation as a training loop (and transformers' Trainer, trainer.py
            # _inner_training_loop / training_step) runs it: `accumulate` forward+backward
            # passes, the loss divided by their number (training_step: `loss / self.current_
            # gradient_accumulation_steps`); the first backward allocates each .grad, the later
            # ones add into it in place (torch/csrc/autograd/input_buffer.cpp accumulate). The
            # previous micro-batch's `outputs` lives until the next forward reassigns it. Every
            # micro-batch reads the one tracked batch (a loader would hold the next one too).
            for _micro in range(accumulate):
                with _autocast(precision):
                    if train_outputs is None:
                        loss = _loss(loss_fn, runner.forward(inputs), labels)
                    else:
                        # `outputs = model(**batch, labels=...)`: outputs (its logits) stay
                        # alive through backward and the optimizer step, as in a training loop.
                        outputs = train_outputs(inputs, labels)
                        loss = outputs.loss
                        if trainer is not None:
                            # trainer.py compute_loss returns the loss alone: its `outputs`
                            # (the logits, accelerate's fp32 copy) die before the backward.
                            outputs = None
                if empties:
                    # training_step: after compute_loss and `del inputs`, `if args.torch_empty_
                    # cache_steps is not None and state.global_step % torch_empty_cache_steps
                    # == 0: clear_device_cache()` (accelerate: torch.cuda.empty_cache()).
                    torch.cuda.empty_cache()
                if accumulate > 1:
                    loss = loss / accumulate
                if scaler is None:
                    loss.backward()
                else:
                    scaler.scale_loss(loss).backward()
                if tr_loss is not None:
                    # _inner_training_loop: `self._tr_loss += tr_loss_step` (training_step
                    # returns `loss.detach()`, a view): in place, nothing allocated.
                    tr_loss.add_(loss.detach())
            found_inf = None
            if scaler is not None and max_norm is not None:
                # torch/amp/grad_scaler.py: unscale_ before clipping, then step and update.
                found_inf = scaler.unscale(optimizer)
            if max_norm is not None:
                # torch/nn/utils/clip_grad.py clip_grad_norm_: on CUDA foreach is the default
                # (_has_foreach_support); on meta it must be asked for, as here.
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)
            if scaler is None:
                optimizer.step()
            elif found_inf is None:
                scaler.unscale_and_update(optimizer)
            else:
                scaler.step_and_update(optimizer, found_inf)
            del found_inf
            optimizer.zero_grad(set_to_none=True)
            del outputs  # the end of the loop body: the outputs die with the step

        track = (model, optimizer, inputs, labels)
        return built(train_step, track if tr_loss is None else (*track, tr_loss))
    model.eval()
    if options.mode == "inference":

        def inference_step(*_tracked: object) -> None:
            with torch.no_grad(), _autocast(precision):
                runner.forward(inputs)

        return built(inference_step, (model, inputs))
    if runner.task != "causal_lm" or runner.decode is None or runner.new_cache is None:
        raise OomkitError(
            f"{title} is not a decoder language model, so it cannot generate; use mode "
            "'train' or 'inference', or a GPT-2 / Llama preset or a causal LM from Hugging Face"
        )
    decode, new_cache = runner.decode, runner.new_cache

    def generate_step(*_tracked: object) -> None:
        # Greedy decoding as transformers' GenerationMixin._sample: the prompt's forward fills
        # the cache and yields token 1; each later token needs one forward of the previous
        # token; the last token is appended but never fed back (new_tokens forwards in all).
        # Logits are kept for the last position only (logits_to_keep=1) and copied to fp32
        # (`outputs.logits[:, -1, :].to(copy=True, dtype=torch.float32)`); ids grow by cat.
        with torch.no_grad(), _autocast(precision):
            cache = new_cache()
            ids = inputs
            step_ids = inputs
            for _ in range(options.new_tokens):
                logits = decode(step_ids, cache, 1)
                next_logits = logits[:, -1, :].to(copy=True, dtype=torch.float32)
                del logits
                step_ids = next_logits.argmax(dim=-1, keepdim=True)
                ids = torch.cat([ids, step_ids], dim=-1)

    return built(generate_step, (model, inputs))


def _accelerate_forward(
    train_outputs: Callable[[torch.Tensor, torch.Tensor], Any], mixed_precision: str
) -> Callable[[torch.Tensor, torch.Tensor], Any]:
    """The model's forward as accelerate's ``Accelerator.prepare_model`` wraps it with
    ``mixed_precision`` bf16 / fp16 (``native_amp``; accelerate/accelerator.py): under autocast,
    then ``convert_outputs_to_fp32`` (accelerate/utils/operations.py: every bf16 / fp16 tensor
    of the outputs, the logits among them, copied by ``.float()`` after autocast exits).
    accelerate's own function is called; without accelerate the forward is left as it is (the
    assumptions then list the copy as not added)."""
    try:  # accelerate ships no type information: imported by name, as Any
        operations = importlib.import_module("accelerate.utils")
    except ImportError:
        return train_outputs
    dtype = torch.bfloat16 if mixed_precision == "bf16" else torch.float16

    def autocast_forward(inputs: torch.Tensor, labels: torch.Tensor) -> Any:
        # accelerate/utils/modeling.py get_mixed_precision_context_manager: torch.autocast on
        # the device's type with the mixed precision's dtype (the tracer emulates CUDA's).
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*CUDA is not available.*")
            ctx = torch.autocast("cuda", dtype=dtype)
        with ctx:
            return train_outputs(inputs, labels)

    wrapped: Callable[[torch.Tensor, torch.Tensor], Any] = operations.convert_outputs_to_fp32(
        autocast_forward
    )
    return wrapped


def _compiled(runner: ModelRunner) -> ModelRunner:
    """The runner with its forward (and loss-computing forward) wrapped in ``torch.compile``."""
    train_outputs = runner.train_outputs
    return dataclasses.replace(
        runner,
        forward=torch.compile(runner.forward),
        train_outputs=None if train_outputs is None else torch.compile(train_outputs),
    )


def _describe(
    title: str,
    options: StepOptions,
    task: Task,
    seq_len: int,
    image_size: int,
    precision_source: str | None = None,
) -> str:
    parts = [title, f"batch {options.batch_size}"]
    if task == "image_classification":
        parts.append(f"image {image_size}")
    elif options.mode == "generate":
        parts.append(f"prompt {seq_len} + {options.new_tokens} new tokens")
    else:
        parts.append(f"seq {seq_len}")
    assert options.precision is not None  # build_step resolved it
    parts.append(
        options.precision
        if precision_source is None
        else f"{options.precision} ({precision_source})"
    )
    if options.mode == "train":
        parts.append(options.optimizer)
        if options.checkpointing != "none":
            mode = "checkpointing" if options.checkpointing == "full" else "selective-op checkpointing"
            parts.append(mode + (" (reentrant)" if options.checkpoint_reentrant else ""))
        if options.grad_accum > 1:
            parts.append(f"accumulate {options.grad_accum}")
        if options.max_grad_norm is not None:
            parts.append(f"clip {options.max_grad_norm:g}")
    if options.compile:
        parts.append("torch.compile")
    parts.append(options.mode)
    return ", ".join(parts)

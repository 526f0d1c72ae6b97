"""Built-in, deterministic, training-like allocation workloads (no GPU, no torch, no files).

The default workload is what ``oomkit demo`` replays. It mimics the allocation pattern of a
decoder-only transformer trained with AdamW where the sequence length changes from step to step
(as with length-bucketed batches): parameters live for the whole run, activations are saved in the
forward pass and freed in reverse order in the backward pass, attention score matrices are large
short-lived temporaries whose size grows with the square of the sequence length, gradients are
created in backward and dropped by ``zero_grad(set_to_none=True)``, and AdamW's two state tensors
per parameter are created on the first optimizer step. Changing sequence lengths is what fragments
the classic caching allocator, so the workload shows the effect of ``expandable_segments``.

The sizes are a model of a workload, not a recording: ``oomkit replay`` handles recordings.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from oomkit.core.trace import TraceEvent

__all__ = ["TrainingWorkload", "training_events", "DEFAULT_WORKLOAD"]

_FP32_BYTES = 4
_BF16_BYTES = 2


@dataclass(frozen=True)
class TrainingWorkload:
    """The shape of the built-in training-like workload.

    Sizes are element counts; bytes follow from fp32 parameters, gradients and optimizer states and
    bf16 activations (mixed precision).
    """

    layers: int = 12
    hidden: int = 1024
    heads: int = 16
    vocab: int = 32_000
    batch: int = 8
    min_seq: int = 256
    max_seq: int = 2048
    steps: int = 12
    seed: int = 0

    def seq_lengths(self) -> list[int]:
        """The sequence length of each step: a seeded draw in multiples of 128."""
        rng = random.Random(self.seed)
        lo, hi = self.min_seq // 128, self.max_seq // 128
        return [128 * rng.randint(lo, hi) for _ in range(self.steps)]


DEFAULT_WORKLOAD = TrainingWorkload()


class _Ids:
    """Hands out opaque allocation ids (synthetic traces put them in ``TraceEvent.address``)."""

    __slots__ = ("next_id",)

    def __init__(self) -> None:
        self.next_id = 1

    def new(self) -> int:
        value = self.next_id
        self.next_id += 1
        return value


def _alloc(ids: _Ids, nbytes: int, out: list[TraceEvent]) -> int:
    handle = ids.new()
    out.append(TraceEvent("alloc", handle, nbytes))
    return handle


def _free(handle: int, nbytes: int, out: list[TraceEvent]) -> None:
    # A free on the allocating stream is recorded as free_requested then free_completed (§11).
    out.append(TraceEvent("free_requested", handle, nbytes))
    out.append(TraceEvent("free_completed", handle, nbytes))


def training_events(workload: TrainingWorkload = DEFAULT_WORKLOAD) -> Iterator[TraceEvent]:
    """Yield the workload's allocation events, step by step (memory use stays bounded).

    Args:
        workload: the model and loop shape.

    Yields:
        ``alloc`` / ``free_requested`` / ``free_completed`` events whose ``address`` is an opaque id.
    """
    w = workload
    ids = _Ids()
    out: list[TraceEvent] = []
    h = w.hidden
    # Per layer: QKV (3h*h), attention out (h*h), MLP up (4h*h) and down (4h*h), plus 2 norms.
    layer_param_bytes = [3 * h * h, h * h, 4 * h * h, 4 * h * h, h, h]
    param_sizes = [w.vocab * h] + [n * _FP32_BYTES for n in layer_param_bytes] * w.layers
    param_sizes[0] *= _FP32_BYTES
    params = [(_alloc(ids, n, out), n) for n in param_sizes]
    yield from out
    out.clear()
    optimizer_state: list[tuple[int, int]] = []

    for seq in w.seq_lengths():
        tokens = w.batch * seq
        act = tokens * h * _BF16_BYTES
        saved: list[tuple[int, int]] = []
        batch_in = (_alloc(ids, tokens * 8, out), tokens * 8)  # int64 token ids
        embed = (_alloc(ids, act, out), act)
        saved.append(embed)
        # Forward: each layer saves its input, its QKV projection, its attention output and its
        # MLP hidden state; attention scores are a temporary (the math path of attention).
        for _ in range(w.layers):
            for nbytes in (act, 3 * act, act, 4 * act):
                saved.append((_alloc(ids, nbytes, out), nbytes))
            scores_bytes = w.batch * w.heads * seq * seq * _BF16_BYTES
            scores = _alloc(ids, scores_bytes, out)
            _free(scores, scores_bytes, out)
            yield from out
            out.clear()
        logits_bytes = tokens * w.vocab * _FP32_BYTES
        logits = _alloc(ids, logits_bytes, out)
        loss = _alloc(ids, 4, out)
        _free(logits, logits_bytes, out)
        # Backward: gradients of parameters appear, saved activations go in reverse order.
        grads: list[tuple[int, int]] = []
        grad_act = (_alloc(ids, act, out), act)
        for layer in range(w.layers):
            for _ in range(4):
                handle, nbytes = saved.pop()
                tmp = _alloc(ids, nbytes, out)
                _free(tmp, nbytes, out)
                _free(handle, nbytes, out)
            first = 1 + 6 * (w.layers - 1 - layer)
            for _handle, nbytes in params[first : first + 6]:
                grads.append((_alloc(ids, nbytes, out), nbytes))
            yield from out
            out.clear()
        handle, nbytes = saved.pop()
        _free(handle, nbytes, out)
        grads.append((_alloc(ids, params[0][1], out), params[0][1]))
        _free(grad_act[0], grad_act[1], out)
        _free(loss, 4, out)
        _free(batch_in[0], batch_in[1], out)
        # AdamW (foreach): two states per parameter on the first step, and one temporary per
        # parameter for the update.
        if not optimizer_state:
            for _handle, nbytes in params:
                optimizer_state.append((_alloc(ids, nbytes, out), nbytes))
                optimizer_state.append((_alloc(ids, nbytes, out), nbytes))
        temps = [(_alloc(ids, nbytes, out), nbytes) for _handle, nbytes in params]
        for handle, nbytes in temps:
            _free(handle, nbytes, out)
        # zero_grad(set_to_none=True)
        for handle, nbytes in grads:
            _free(handle, nbytes, out)
        yield from out
        out.clear()

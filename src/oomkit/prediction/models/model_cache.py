"""Models built once for a batch search: its probes differ only in the batch, so they share one.

A ``fit`` search (``oomkit.plan.batch_search.max_batch_size``) builds the step at every batch size
it tries. The model itself does not depend on the batch: ``build_preset_step`` and
``build_hf_step`` build it from the preset (or config) and the other ``StepOptions`` fields, then
wrap it (checkpointing, quantization, LoRA). While a ``ModelCache`` is active (``with
cache.active():``, opened around each probe's builder), they build each distinct model once
and hand the same module to every later probe (issue 19 item 6). Within one probe a model is
handed out once: a builder that makes two alike (a DPO policy and its reference) gets two. Only meta-device models are shared: a meta parameter holds no data, so
the optimizer steps an earlier probe recorded left nothing in it.

A shared model must start each probe as a fresh build would. The step builder makes a new
optimizer (fresh state), new inputs and sets the train/eval mode each time; the cache sets every
parameter's ``.grad`` to ``None``. It also keeps a signature of the model as built (each module's
attributes, parameters, buffers and hooks, and each tensor's identity, storage, shape, dtype and
``requires_grad``): a model whose signature changed since (a step that cached a tensor on a
module, a builder that added a hook) is built afresh instead, so what a probe records never
depends on what an earlier probe did (tests/prediction/test_model_cache.py compares every probe's
recording with an uncached one, event for event).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

__all__ = ["ModelCache", "active_model_cache", "cached_model", "model_cache_key"]

T = TypeVar("T")

_ACTIVE: contextvars.ContextVar[ModelCache | None] = contextvars.ContextVar(
    "oomkit_model_cache", default=None
)


@dataclass
class _Entry:
    model: torch.nn.Module
    extra: Any
    signature: tuple[Any, ...]


class ModelCache:
    """Built models by what built them (``model_cache_key``), for the probes of one search.

    Attributes:
        builds: models built (a first build, or a rebuild after a changed signature).
        reuses: builds saved: a probe given the model an earlier one built.
    """

    def __init__(self) -> None:
        # Per key, the models built for it: a builder that makes two alike (a DPO policy and
        # its reference model) gets two, the first and the second, in every probe.
        self._entries: dict[Hashable, list[_Entry]] = {}
        self._taken: dict[Hashable, int] = {}  # per key, models handed out since active()
        self.builds = 0
        self.reuses = 0

    @contextlib.contextmanager
    def active(self) -> Iterator[ModelCache]:
        """While open (around one probe's builder), ``build_preset_step`` and ``build_hf_step``
        share models through this cache (``cached_model``); within one opening a model is
        handed out once."""
        self._taken.clear()
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    def clear(self) -> None:
        """Forget every model (they are freed when nothing else holds them)."""
        self._entries.clear()
        self._taken.clear()

    def get(self, key: Hashable, build: Callable[[], tuple[torch.nn.Module, T]]) -> tuple[torch.nn.Module, T]:
        """The model (and what ``build`` returned beside it) built for ``key``: built now when
        there is none not yet handed out since ``active()``, or when the one held changed since
        it was built; else the one held, with every ``.grad`` set to ``None``."""
        index = self._taken.get(key, 0)
        self._taken[key] = index + 1
        entries = self._entries.setdefault(key, [])
        if index < len(entries) and _signature(entries[index].model) == entries[index].signature:
            entry = entries[index]
            for parameter in entry.model.parameters():
                parameter.grad = None
            self.reuses += 1
            return entry.model, entry.extra
        model, extra = build()
        self.builds += 1
        entry = _Entry(model, extra, _signature(model))
        if index < len(entries):
            entries[index] = entry
        else:
            entries.append(entry)
        return model, extra


def active_model_cache() -> ModelCache | None:
    """The cache opened by ``ModelCache.active`` around this call, if any."""
    return _ACTIVE.get()


def model_cache_key(kind: str, name: Any, options: Any, device: str, *extra: Any) -> Hashable | None:
    """What a model depends on: everything that builds it but the batch and the sequence length
    (they size the inputs: neither a preset's build nor ``from_config`` reads them, so the runs of
    ``--lengths`` share one model too); ``None`` (do not share) off the meta device, under
    ``torch.compile`` (dynamo keeps per-module guards and may recompile a shared module with a
    dynamic batch) or when a part cannot be hashed."""
    if device != "meta" or getattr(options, "compile", False):
        return None
    key = (kind, name, dataclasses.replace(options, batch_size=1, seq_len=None), device, *extra)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def cached_model(key: Hashable | None, build: Callable[[], tuple[torch.nn.Module, T]]) -> tuple[torch.nn.Module, T]:
    """``build()``, or the active cache's model for ``key`` (``None``: always ``build()``)."""
    cache = _ACTIVE.get()
    if cache is None or key is None:
        return build()
    return cache.get(key, build)


def _tensor_signature(tensor: Any) -> Any:
    if not isinstance(tensor, torch.Tensor):
        return (id(tensor), type(tensor))
    return (
        id(tensor),
        type(tensor),
        tensor.untyped_storage()._cdata,
        tuple(tensor.shape),
        tensor.stride(),
        tensor.storage_offset(),
        tensor.dtype,
        tensor.device,
        tensor.requires_grad,
        tuple(sorted(getattr(tensor, "__dict__", {}))),
    )


def _signature(model: torch.nn.Module) -> tuple[Any, ...]:
    """What a step could change in a model that would change a later recording."""
    parts: list[Any] = []
    for module in model.modules():
        state = vars(module)
        parts.append(
            (
                id(module),
                type(module),
                tuple(sorted(state)),
                tuple((name, _tensor_signature(t)) for name, t in module._parameters.items()),
                tuple((name, _tensor_signature(t)) for name, t in module._buffers.items()),
                tuple(
                    (name, _tensor_signature(value))
                    for name, value in state.items()
                    if isinstance(value, torch.Tensor)
                ),
                tuple(
                    len(hooks)
                    for name, hooks in state.items()
                    if name.endswith("hooks") and isinstance(hooks, dict)
                ),
            )
        )
    return tuple(parts)

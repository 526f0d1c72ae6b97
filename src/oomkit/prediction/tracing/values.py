"""Known values of meta tensors: a CPU copy for each meta storage whose contents are determined.

A meta tensor has a shape but no values, so a library check that reads one (transformers'
``_ignore_causal_mask_sdpa`` asks whether the padding mask is all ones; torch's
``_detect_is_causal_mask`` whether a mask is causal) cannot run. Yet many such values are fixed by
what the user passed: ``torch.ones`` for a padding mask, ``torch.arange`` for positions,
``torch.triu(torch.full(..., -inf), 1)`` for a causal mask. :class:`KnownValues` follows them:

- a deterministic op whose tensor inputs are all known (or real CPU tensors) is run a second
  time on the CPU copies, and its meta outputs get the results as their copies. Factories with
  no tensor input (``ones``, ``full``, ``arange``) are known from their arguments.
- random ops (``Tag.nondeterministic_seeded``: ``randn``, ``uniform_``, ``dropout``...) and
  uninitialised ones (``empty``) are not known; neither is anything computed from them, so model
  weights, activations and the loss stay unknown.
- the copy belongs to the *storage* (an attribute of the preserved ``UntypedStorage`` object), so
  views alias it as they alias the storage, and an in-place op on one view updates the others. An
  in-place op with an unknown input makes the storage unknown.
- ``torch.tensor(data)`` on meta is known from ``data`` (``value_reads.ValueReads`` sees the
  call: torch copies the data to meta below the dispatcher).
- an op with no meta kernel or a data-dependent output shape (``aten.equal``, ``nonzero``,
  ``_local_scalar_dense``) whose inputs are known runs on the copies; its tensor outputs become
  meta tensors of the same size and strides, known.

Copies larger than ``MAX_KNOWN_BYTES``, or that would take all copies past
``MAX_TOTAL_KNOWN_BYTES``, are not kept (the value is then unknown), so memory and time stay
bounded.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from oomkit.prediction.tracing._leaves import leaves, tensor_leaves
from oomkit.prediction.tracing.meta_memo import SHARED_MEMO

__all__ = [
    "MAX_KNOWN_BYTES",
    "MAX_TOTAL_KNOWN_BYTES",
    "KnownValue",
    "KnownValues",
    "known_bytes",
    "known_value",
    "remember_value",
]

# A storage's CPU copy is kept up to this size (a 4096 x 4096 fp32 causal mask is 64 MiB).
MAX_KNOWN_BYTES = 64 << 20
# All live copies together stay under this (optimizer state starts as zeros_like of every
# parameter: known zeros until the first update, gigabytes for a large model).
MAX_TOTAL_KNOWN_BYTES = 256 << 20

# Bytes of the live copies, by meta storage (``_cdata``); a finalizer drops a storage's entry.
_live_bytes: dict[int, int] = {}


def known_bytes() -> int:
    """Bytes held by the CPU copies of known values now."""
    return sum(_live_bytes.values())


def _fits(extra_bytes: int) -> bool:
    return known_bytes() + extra_bytes <= MAX_TOTAL_KNOWN_BYTES


def _account(storage: torch.UntypedStorage, nbytes: int) -> None:
    key = storage._cdata
    if key not in _live_bytes:
        weakref.finalize(storage, _live_bytes.pop, key, None).atexit = False
    _live_bytes[key] = nbytes

_ATTR = "_oomkit_known_value"
_aten = torch.ops.aten

# Ops whose outputs are uninitialised memory: their values are not known.
_UNINITIALISED = frozenset(
    {
        "aten::empty",
        "aten::empty_like",
        "aten::empty_strided",
        "aten::new_empty",
        "aten::new_empty_strided",
        "aten::empty_permuted",
        "aten::resize_",
        "aten::set_",
    }
)
# GradScaler's check for inf/nan gradients: writes found_inf (its second argument).
_INF_CHECK = "aten::_amp_foreach_non_finite_check_and_unscale_"
# In-place ops that overwrite every element of their first argument whatever it held.
_OVERWRITES = frozenset({"aten::fill_", "aten::zero_", "aten::copy_"})
# Factories whose tensor argument gives only its layout (shape, dtype, strides), not values:
# torch.ones_like(input_ids) is all ones whatever input_ids holds.
_LAYOUT_ONLY = frozenset({"aten::ones_like", "aten::zeros_like", "aten::full_like"})
# Ops whose first tensor gives only its shape to a check of the second's values:
# nn.TransformerEncoder's test of a padding mask for its nested-tensor fast path
# (torch/nn/modules/transformer.py: _nested_tensor_from_mask_left_aligned(src, mask)).
_SHAPE_ONLY = frozenset({"aten::_nested_tensor_from_mask_left_aligned"})


# Tensor types whose values are their storage's (subclasses such as DTensor wrap others).
_PLAIN_TENSORS = tuple(
    t for t in (torch.Tensor, torch.nn.Parameter, getattr(torch.nn, "Buffer", None)) if t
)


@dataclass(frozen=True)
class _Copy:
    """The CPU copy of one meta storage and the factories its values come from."""

    storage: torch.UntypedStorage
    origins: frozenset[str]


@dataclass(frozen=True)
class KnownValue:
    """A meta tensor's values: ``tensor`` is a CPU tensor equal to what CUDA would hold.

    Attributes:
        tensor: the values (a view of the storage's CPU copy).
        origins: the factories they were computed from (``{"torch.ones", "torch.arange"}``);
            ``"a CPU tensor"`` for real CPU inputs, ``"assumed finite"`` for answered tests.
    """

    tensor: torch.Tensor
    origins: frozenset[str]


def _copy_of(tensor: torch.Tensor) -> _Copy | None:
    storage = tensor.untyped_storage()
    copy = getattr(storage, _ATTR, None)
    if copy is None or copy.storage.nbytes() != storage.nbytes():
        return None
    assert isinstance(copy, _Copy)
    return copy


def known_value(tensor: Any) -> KnownValue | None:
    """The values of ``tensor`` if they are known: real CPU tensors always, meta ones when
    :class:`KnownValues` could follow them; ``None`` otherwise."""
    if not isinstance(tensor, torch.Tensor) or tensor.is_sparse or tensor.is_nested:
        return None
    if type(tensor) not in _PLAIN_TENSORS:
        return None
    device = tensor.device.type
    if device == "cpu":
        return KnownValue(tensor.detach(), frozenset({"a CPU tensor"}))
    if device != "meta":
        return None
    copy = _copy_of(tensor)
    if copy is None:
        return None
    with torch._C.DisableTorchFunction():
        view = torch.empty((0,), dtype=tensor.dtype).set_(
            copy.storage, tensor.storage_offset(), tensor.size(), tensor.stride()
        )
    return KnownValue(view, copy.origins)


def _set_known(tensor: torch.Tensor, value: torch.Tensor, origins: frozenset[str]) -> None:
    """Make ``value`` (CPU, same size) the values of meta ``tensor``; unknown if they differ."""
    storage = tensor.untyped_storage()
    nbytes = storage.nbytes()
    layout_matches = (
        value.dtype == tensor.dtype
        and value.size() == tensor.size()
        and value.stride() == tensor.stride()
        and value.storage_offset() == tensor.storage_offset()
        and value.untyped_storage().nbytes() == nbytes
    )
    held = _live_bytes.get(storage._cdata, 0)
    if nbytes > MAX_KNOWN_BYTES or not _fits(nbytes - held):
        _forget(tensor)
        return
    if layout_matches:
        cpu_storage = value.untyped_storage()
    else:
        # Lay the values out as the meta tensor is laid out (its own strides and offset).
        with torch._C.DisableTorchFunction():
            cpu_storage = torch.UntypedStorage(nbytes)
            target = torch.empty((0,), dtype=tensor.dtype).set_(
                cpu_storage, tensor.storage_offset(), tensor.size(), tensor.stride()
            )
            target.copy_(value)
    setattr(storage, _ATTR, _Copy(cpu_storage, origins))
    _account(storage, nbytes)


def remember_value(tensor: torch.Tensor, value: torch.Tensor, origin: str) -> None:
    """Record that meta ``tensor`` holds ``value`` (a CPU tensor of its size), made by ``origin``.

    For values given from Python data (``torch.tensor([...], device="meta")``), which torch
    copies to the meta device below the dispatcher, where no mode sees them.
    """
    if tensor.is_meta and value.device.type == "cpu" and value.size() == tensor.size():
        _set_known(tensor, value.to(tensor.dtype), frozenset({origin}))


# Logical ops one known operand decides alone, with the value that does it: ``x | True`` is
# True and ``x & 0`` is 0 whatever ``x`` holds. transformers' generate stops this way: at its
# length limit ``MaxLengthCriteria`` is ``torch.full(..., True)``, OR-ed with the EOS check of
# unknown tokens (generation/stopping_criteria.py ``StoppingCriteriaList.__call__``), and
# ``unfinished_sequences & ~is_done`` is then all 0 (generation/utils.py ``_sample``).
_ABSORBING = {
    **dict.fromkeys(
        ("aten::bitwise_or", "aten::bitwise_or_", "aten::logical_or", "aten::logical_or_"), True
    ),
    **dict.fromkeys(
        ("aten::bitwise_and", "aten::bitwise_and_", "aten::logical_and", "aten::logical_and_"),
        False,
    ),
}


def _absorbed(value: bool, flat: list[Any], out: Any) -> tuple[torch.Tensor, frozenset[str]] | None:
    """``out``'s values and origins when a known operand holds only ``value`` (``_ABSORBING``):
    all True for an OR of booleans, all zero for an AND of any dtype; else None."""
    if not isinstance(out, torch.Tensor) or not out.is_meta or (value and out.dtype != torch.bool):
        return None
    if out.untyped_storage().nbytes() != out.numel() * out.element_size():
        return None  # part of a larger storage (an in-place op on a view): the rest is unknown
    for leaf in flat:
        known = known_value(leaf) if isinstance(leaf, torch.Tensor) else None
        if known is None or known.tensor.numel() == 0:
            continue
        if value and known.tensor.dtype != torch.bool:
            continue
        with torch._C.DisableTorchFunction():
            if bool((known.tensor != 0).all() if value else (known.tensor == 0).all()):
                return torch.full(out.shape, value, dtype=out.dtype), known.origins
    return None


def _forget(tensor: Any) -> None:
    if isinstance(tensor, torch.Tensor) and tensor.device.type == "meta":
        storage = tensor.untyped_storage()
        if hasattr(storage, _ATTR):
            delattr(storage, _ATTR)
            _live_bytes.pop(storage._cdata, None)


def _factory_name(func: Any) -> str:
    return "torch." + func.__name__.split(".")[0]


def _to_cpu_args(tree: Any) -> Any:
    """Devices named in an op's arguments, as the CPU (where the copies live)."""

    def swap(leaf: Any) -> Any:
        if isinstance(leaf, torch.device) and leaf.type == "meta":
            return torch.device("cpu")
        return leaf

    return tree_map(swap, tree)


class KnownValues(TorchDispatchMode):
    """While active, follows the values of meta tensors that are determined (module docstring).

    Attributes:
        assumed_finite: GradScaler's inf checks of unknown gradients answered "none found"
            (``found_inf`` stays 0, as in a run whose gradients are finite), by op.
        nested_fast_paths: nn.TransformerEncoder calls whose padding mask qualified for the
            nested-tensor fast path, which the meta device does not take (``_SHAPE_ONLY``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.assumed_finite: Counter[str] = Counter()
        self.nested_fast_paths = 0

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        schema = getattr(func, "_schema", None)
        if schema is None:  # not an aten overload (a higher-order op): values not followed
            return func(*args, **kwargs)
        name = schema.name
        # pytree's leaves, in its order; its spec is built only when every input is known and
        # the arguments are rebuilt around their values (issue 19 item 6: per-op cost).
        tree = (args, kwargs)
        flat = leaves(tree)
        metas = [leaf for leaf in flat if isinstance(leaf, torch.Tensor) and leaf.is_meta]
        if not metas and not any(isinstance(leaf, torch.Tensor) for leaf in flat):
            out = func(*args, **kwargs)
            self._after(func, name, flat, tree, out)
            return out
        if not metas:
            return func(*args, **kwargs)
        try:
            # A repeat of an op on the same metadata gets its outputs' layout from memory
            # instead of running the meta kernel again (meta_memo.py; issue 19 item 6).
            out = SHARED_MEMO.run(func, args, kwargs, lambda: func(*args, **kwargs))
        except Exception:
            known = self._inputs_known(func, flat, tree, name)
            if known is None or not self._deterministic(func, name):
                raise
            # No meta kernel, or a data-dependent shape: the copies answer it.
            answer = self._run_on_copies(func, known, name)
            self.nested_fast_paths += name in _SHAPE_ONLY and answer is True
            return answer
        if name == _INF_CHECK and len(args) > 1 and isinstance(args[1], torch.Tensor):
            # GradScaler.unscale_ (torch/amp/grad_scaler.py _unscale_grads_): found_inf is
            # set to 1 only by a non-finite gradient; the scaler then reads it to skip the step.
            found_inf = args[1]
            unknown_grads = self._inputs_known(func, flat, tree, name) is None
            if known_value(found_inf) is not None and unknown_grads:
                self.assumed_finite["torch._amp_foreach_non_finite_check_and_unscale_"] += 1
                for grad in _tensors(args[0]):  # unscaled in place: unknown now
                    _forget(grad)
                return out  # found_inf keeps its (known) value
        self._after(func, name, flat, tree, out)
        return out

    def follow(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Follow the values through ``func``, which ran outside this mode: a kernel of a
        compiled graph (``compile_backend.PlannedGraph`` runs them with the modes off)."""
        schema = getattr(func, "_schema", None)
        if schema is not None:  # an aten overload (not operator.getitem or a size)
            tree = (args, kwargs)
            self._after(func, schema.name, leaves(tree), tree, out)

    def _after(self, func: Any, name: str, flat: list[Any], tree: Any, out: Any) -> None:
        """``out`` is known if ``func`` is deterministic and its inputs are known (a factory
        from its arguments); otherwise what it wrote to is unknown now."""
        args, kwargs = tree
        if self._deterministic(func, name):
            if not any(isinstance(leaf, torch.Tensor) for leaf in flat):
                self._follow(func, args, kwargs, out, frozenset({_factory_name(func)}))
                return
            inputs = self._inputs_known(func, flat, tree, name)
            if inputs is not None:
                self._follow(func, *inputs[0], out, inputs[1])
                return
        decided = _absorbed(_ABSORBING[name], flat, out) if name in _ABSORBING else None
        self._forget_mutated(func, args, kwargs)
        if decided is not None:  # after: an in-place op's own operand may be the deciding one
            _set_known(out, *decided)

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _deterministic(func: Any, name: str) -> bool:
        return torch.Tag.nondeterministic_seeded not in func.tags and name not in _UNINITIALISED

    @staticmethod
    def _inputs_known(
        func: Any, flat: list[Any], tree: Any, name: str
    ) -> tuple[tuple[Any, Any], frozenset[str]] | None:
        """The op's arguments with every tensor replaced by its CPU values, or None."""
        origins: set[str] = set()
        replaced: list[Any] = []
        # fill_/zero_/copy_ overwrite their first argument: what it held does not matter.
        overwritten = flat[0] if name in _OVERWRITES and flat else None
        layout_only = flat[0] if name in _LAYOUT_ONLY and flat else None
        shape_only = flat[0] if name in _SHAPE_ONLY and flat else None
        for leaf in flat:
            if not isinstance(leaf, torch.Tensor):
                replaced.append(leaf)
                continue
            known = known_value(leaf)
            if known is not None:
                origins |= known.origins
                replaced.append(known.tensor)
                continue
            if id(leaf) == id(shape_only):
                with torch._C.DisableTorchFunction():  # its shape, in no memory
                    replaced.append(torch.zeros((), dtype=leaf.dtype).expand(leaf.shape))
                continue
            whole = id(leaf) == id(overwritten) or id(leaf) == id(layout_only)
            fresh = _fresh(leaf) if whole and leaf.is_meta else None
            if fresh is None:
                return None
            if id(leaf) == id(layout_only):
                origins.add(_factory_name(func))
            replaced.append(fresh)
        _, spec = tree_flatten(tree)
        cpu_args, cpu_kwargs = tree_unflatten(replaced, spec)
        return (tuple(_to_cpu_args(cpu_args)), _to_cpu_args(cpu_kwargs)), frozenset(origins)

    def _follow(
        self,
        func: Any,
        cpu_args: Any,
        cpu_kwargs: Any,
        out: Any,
        origins: frozenset[str],
    ) -> None:
        """Run ``func`` on the copies and make the results the values of ``out``'s tensors."""
        outs = [t for t in _tensors(out) if t.is_meta]
        sizes = [t.untyped_storage().nbytes() for t in outs]
        if any(n > MAX_KNOWN_BYTES for n in sizes) or not _fits(sum(sizes)):
            self._forget_mutated(func, cpu_args, cpu_kwargs, also=outs)
            return
        cpu_args = _to_cpu_args(cpu_args)
        cpu_kwargs = _to_cpu_args(cpu_kwargs)
        try:
            with torch._C.DisableTorchFunction():
                result = func(*cpu_args, **cpu_kwargs)
        except Exception:
            # The CPU has no kernel for it (a dtype, say): the values are not known.
            for t in outs:
                _forget(t)
            return
        metas, cpus = _tensors(out), _tensors(result)
        if len(metas) != len(cpus):
            for t in outs:
                _forget(t)
            return
        for meta, cpu in zip(metas, cpus, strict=True):
            if meta.is_meta and isinstance(cpu, torch.Tensor) and cpu.device.type == "cpu":
                _set_known(meta, cpu, origins)

    def _run_on_copies(
        self, func: Any, known: tuple[tuple[Any, Any], frozenset[str]], name: str
    ) -> Any:
        (cpu_args, cpu_kwargs), origins = known
        with torch._C.DisableTorchFunction():
            result = func(*cpu_args, **cpu_kwargs)

        def to_meta(leaf: Any) -> Any:
            if not isinstance(leaf, torch.Tensor):
                return leaf
            meta = torch.empty_strided(
                leaf.size(), leaf.stride(), dtype=leaf.dtype, device="meta"
            )
            _set_known(meta, leaf, origins)
            return meta

        return tree_map(to_meta, result)

    def _forget_mutated(
        self, func: Any, args: Any, kwargs: Any, also: Iterable[torch.Tensor] = ()
    ) -> None:
        """An op with an unknown input wrote to its arguments: they are unknown now."""
        for t in also:
            _forget(t)
        schema_args = func._schema.arguments
        for i, argument in enumerate(schema_args):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(argument.name)
            for t in _tensors(value):
                _forget(t)


def _tensors(tree: Any) -> list[torch.Tensor]:
    return tensor_leaves(tree)


def _fresh(tensor: torch.Tensor) -> torch.Tensor | None:
    """A CPU stand-in for a meta tensor an op overwrites whole: zeros laid out as it is, when it
    covers its storage (else the rest of the storage would stay unknown)."""
    storage = tensor.untyped_storage()
    covers = tensor.storage_offset() == 0 and tensor.is_contiguous() and (
        tensor.numel() * tensor.element_size() == storage.nbytes()
    )
    if not covers or storage.nbytes() > MAX_KNOWN_BYTES:
        return None
    with torch._C.DisableTorchFunction():
        return torch.zeros(tensor.size(), dtype=tensor.dtype)

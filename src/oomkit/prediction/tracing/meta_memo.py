"""Meta-kernel results remembered by what the kernel reads: an op's shapes, strides and dtypes.

On the meta device an op's kernel computes only its outputs' metadata (sizes, strides, dtype)
from its inputs' metadata and its other arguments; many of these kernels are Python (torch's
``_refs``, ``_prims`` and decompositions) and they were most of the recorder's time. A training
step repeats them: every step after the first runs the same ops on the same shapes, the layers of
a transformer repeat one another, and a ``fit`` search's probes repeat the optimizer's ops on the
same parameter shapes. ``MetaMemo.run`` answers a repeat with new empty meta tensors of the
remembered layout instead of running the kernel again (issue 19 item 6).

Only what the kernel's result cannot depend on anything but the key is remembered:
- the op is an ATen overload with no mutated argument, no output that aliases an input (no
  ``alias_info`` in its schema), and no data-dependent output (``Tag.dynamic_output_shape``,
  ``Tag.data_dependent_output``);
- every tensor argument is a plain (not subclassed) strided meta tensor, keyed by its sizes,
  strides, storage offset, dtype and conjugate/negative bits; every other argument is keyed by
  its value (ints, floats, bools, strings, None, dtypes, devices, layouts, memory formats, and
  lists or tuples of them); any other argument means the op is not remembered;
- the outputs are a tensor or a tuple/list of tensors (or None), each a fresh, strided, contiguous
  storage of exactly its extent (offset 0, not shared with an input or another output); a
  result that is not like this is never remembered, and its op key is then always run.

An in-place op (``add_``, ``copy_``, the optimizers' ``_foreach_addcdiv_``, ...) is remembered too
when its meta kernel only checks its arguments: the schema writes only its first argument (a
tensor or a list of them; no ``out=``, no ``inplace_view`` tag) and returns that argument or
nothing, and the call returned exactly that (``self``, or None) with every written tensor's
sizes, strides, offset, dtype and storage unchanged (``resize_`` to another size is not). A
repeat returns ``self`` (or None) without running the kernel: on meta such a kernel allocates
nothing the recorder sees, and the version counter is bumped above it (ADInplaceOrView). These
were the optimizer step's costliest kernels: torch's meta ``_foreach_*_`` ops run the Python
out-of-place kernel of every parameter (torch/_meta_registrations.py ``_register_inplace_meta``)
and throw the results away.
What a kernel raises is never remembered: the op runs again and raises again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["MAX_ENTRIES", "SHARED_MEMO", "MetaMemo"]

# A GPT-2 training step has under 100 distinct (op, metadata) keys and a whole `fit` search about
# 1,000; an entry is a few hundred bytes of small tuples, so the cap keeps a long session that
# predicts many models under ~25 MB. Past it, new keys are run, not remembered.
MAX_ENTRIES = 50_000

_VALUE_TYPES = frozenset(
    {int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
     torch.memory_format}
)
_PLAIN_TENSOR_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})
_SKIP_TAGS = tuple(
    tag
    for tag in (
        getattr(torch.Tag, "dynamic_output_shape", None),
        getattr(torch.Tag, "data_dependent_output", None),
        getattr(torch.Tag, "inplace_view", None),
    )
    if tag is not None
)
_NOT_REMEMBERED = object()
# What a remembered in-place op returned: its first argument, or nothing.
_RETURNS_SELF = ("returns self",)
_RETURNS_NONE = ("returns none",)


class _Unkeyable(Exception):
    """An argument the key cannot describe."""


def _tensor_key(tensor: torch.Tensor) -> tuple[Any, ...]:
    if (
        type(tensor) not in _PLAIN_TENSOR_TYPES
        or not tensor.is_meta
        or tensor.layout != torch.strided
    ):
        raise _Unkeyable
    return (
        tuple(tensor.shape),
        tensor.stride(),
        tensor.storage_offset(),
        tensor.dtype,
        tensor.is_conj(),
        tensor.is_neg(),
    )


def _key(value: Any) -> Any:
    kind = type(value)
    if kind in _VALUE_TYPES:
        return (kind, value)
    if kind in _PLAIN_TENSOR_TYPES or isinstance(value, torch.Tensor):
        return _tensor_key(value)
    if kind is list or kind is tuple:
        return (kind, tuple(_key(item) for item in value))
    raise _Unkeyable


# How an op may be remembered: its outputs' layouts, or (in place) what it returned.
_OUT_OF_PLACE = "out of place"
_IN_PLACE = "in place"


def _rememberable(func: Any) -> str | None:
    """``_OUT_OF_PLACE``, ``_IN_PLACE`` (writes only its first argument and returns it or
    nothing), or None (never remembered)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return None
    tags = getattr(func, "tags", ())
    if any(tag in tags for tag in _SKIP_TAGS):
        return None
    if not schema.is_mutable:
        if any(r.alias_info is not None for r in schema.returns):
            return None
        return _OUT_OF_PLACE
    written = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    first = schema.arguments[0] if schema.arguments else None
    if first is None or written != [first] or first.kwarg_only:
        return None
    returns = schema.returns
    if not returns:
        return _IN_PLACE
    if len(returns) == 1 and returns[0].alias_info is not None and returns[0].alias_info.is_write:
        return _IN_PLACE
    return None


def _written_layout(value: Any) -> Any:
    """What an in-place kernel must leave as it was: each written tensor's metadata and storage."""
    tensors = value if type(value) in (list, tuple) else (value,)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return None
    return tuple(
        (
            tuple(t.shape),
            t.stride(),
            t.storage_offset(),
            t.dtype,
            t.untyped_storage()._cdata,
            t.untyped_storage().nbytes(),
        )
        for t in tensors
    )


def _layout(out: Any, inputs: set[int]) -> Any:
    """The outputs' layout to remake them from, or ``_NOT_REMEMBERED``."""
    if out is None:
        return None
    if type(out) is torch.Tensor:
        layout = _fresh_layout(out, inputs)
        if layout is None:
            return _NOT_REMEMBERED
        return layout
    if type(out) in (tuple, list):
        parts = []
        for item in out:
            if type(item) is not torch.Tensor:
                return _NOT_REMEMBERED
            layout = _fresh_layout(item, inputs)
            if layout is None:
                return _NOT_REMEMBERED
            parts.append(layout)
        return (type(out), tuple(parts))
    return _NOT_REMEMBERED


def _fresh_layout(tensor: torch.Tensor, seen: set[int]) -> tuple[Any, ...] | None:
    if (
        not tensor.is_meta
        or tensor.layout != torch.strided
        or tensor.storage_offset() != 0
        or tensor.is_conj()
        or tensor.is_neg()
        or tensor.requires_grad
    ):
        return None
    storage = tensor.untyped_storage()
    if storage._cdata in seen:
        return None  # aliases an input or another output
    seen.add(storage._cdata)
    size, stride = tuple(tensor.shape), tensor.stride()
    if storage.nbytes() != _extent_bytes(size, stride, tensor.element_size()):
        return None  # a larger buffer than the tensor's extent: remade, it would differ
    return (size, stride, tensor.dtype)


def _extent_bytes(size: tuple[int, ...], stride: tuple[int, ...], itemsize: int) -> int:
    """The storage ``empty_strided(size, stride)`` allocates (c10/core/EmptyTensor.cpp
    computeStorageNbytes: 0 for no elements, else the furthest element's offset plus one)."""
    if 0 in size:
        return 0
    return (1 + sum((n - 1) * step for n, step in zip(size, stride, strict=True))) * itemsize


def _remake(layout: Any) -> Any:
    if layout is None:
        return None
    if type(layout[0]) is type:
        kind, parts = layout
        return kind(_remake(part) for part in parts)
    size, stride, dtype = layout
    return torch.empty_strided(size, stride, dtype=dtype, device="meta")


class MetaMemo:
    """Remembers meta-kernel results by op and argument metadata (module docstring).

    Attributes:
        enabled: False runs every op (the plain path, to compare against).
        hits: ops answered from memory.
        misses: ops run (and, when they qualify, remembered).
    """

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.enabled = True
        self._max_entries = max_entries
        self._results: dict[Any, Any] = {}
        self._ops: dict[Any, str | None] = {}  # op: _rememberable's answer
        self.hits = 0
        self.misses = 0

    def clear(self) -> None:
        """Forget every result."""
        self._results.clear()
        self._ops.clear()

    def run(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
            run: Callable[[], Any]) -> Any:
        """``run()`` (which calls ``func(*args, **kwargs)`` below the caller's mode), or new
        meta tensors laid out as the remembered result of the same op on the same metadata."""
        if not self.enabled:
            return run()
        kind = self._ops.get(func, False)
        if kind is False:
            kind = self._ops[func] = _rememberable(func)
        if kind is None or (kind == _IN_PLACE and not args):
            return run()
        try:
            key = (func, _key(args), _key(tuple(kwargs.items())) if kwargs else None)
        except (_Unkeyable, TypeError):
            return run()
        layout = self._results.get(key)
        if layout is not None and layout is not _NOT_REMEMBERED:
            self.hits += 1
            if layout is _RETURNS_SELF:
                return args[0]
            if layout is _RETURNS_NONE:
                return None
            # Made with no torch-function mode watching (the caller's dispatch mode is already
            # off the stack): the engine accounts the outputs when they are returned.
            with torch._C.DisableTorchFunction():
                return _remake(layout)
        remember = layout is None and len(self._results) < self._max_entries
        if kind == _IN_PLACE:
            before = _written_layout(args[0]) if remember else None
            remember = remember and before is not None
            out = run()
            self.misses += 1
            if remember:
                self._results[key] = _in_place_result(out, args[0], before)
            return out
        out = run()
        self.misses += 1
        if remember:
            inputs = {t.untyped_storage()._cdata for t in _input_tensors(args, kwargs)}
            self._results[key] = _layout(out, inputs)
        return out


def _in_place_result(out: Any, written: Any, before: Any) -> Any:
    """What to answer a repeat of an in-place op with, or ``_NOT_REMEMBERED`` when the kernel
    returned something else or changed what it wrote to (its layout or storage)."""
    if out is written:
        returned = _RETURNS_SELF
    elif out is None:
        returned = _RETURNS_NONE
    else:
        return _NOT_REMEMBERED
    return returned if _written_layout(written) == before else _NOT_REMEMBERED


# One memo for the process: results depend only on the key, so predictions and a fit search's
# probes share it.
SHARED_MEMO = MetaMemo()


def _input_tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif type(value) in (list, tuple):
            found.extend(item for item in value if isinstance(item, torch.Tensor))
    return found

"""Reads of tensor values during a trace: answered, stated by the user, or given a stand-in.

:func:`value_tracking` opens :class:`~oomkit.prediction.tracing.values.KnownValues` (what values
are determined) and :class:`ValueReads`, a ``TorchFunctionMode`` that sees every read of a meta
tensor's value: ``Tensor.item``, ``__bool__``, ``__float__``, ``__int__``, ``__index__``,
``__format__``, ``tolist`` and ``torch.equal``. Each read is, in this order:

1. stated: the user gave its value for a line on the stack (``--value file.py:42=1024``,
   ``oomkit.predict(..., values={"file.py:42": 1024})``);
2. answered: the tensor's values are known (a mask made with ``torch.ones``); the read returns
   what CUDA would return;
   ``float()`` gets a plain ``STAND_IN_VALUE``: Python does not keep a float subclass through
   ``float()``, so its later use cannot be checked (its warning says so: use ``.item()``);
3. ``isnan`` / ``isinf`` / ``isfinite`` of an unknown tensor answer as for finite values
   (counted in ``assumed_finite``), and transformers' generate asking whether its sequences
   have all ended answers "not yet" (counted in ``generation_goes_on``), and its beam search's
   output is as long as it ran (``_generation_answer``);
4. otherwise ``item`` / ``float`` / ``format`` / ``tolist`` get a :class:`StandIn` that
   raises if it is later used as a size or a condition; ``bool`` / ``int`` / ``index`` /
   ``torch.equal`` are such uses themselves and raise ``DataDependentValueError`` at once.

Every read is recorded by site (:class:`ReadRecord`) for the prediction's assumptions and warnings.
"""

from __future__ import annotations

import contextlib
import linecache
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from oomkit.errors import ConfigError
from oomkit.prediction.tracing._from_data import (
    DATA_CONSTRUCTORS,
    MAX_DATA_VALUE_BYTES,
    from_python_data,
    made_on,
)
from oomkit.prediction.tracing.stand_ins import (
    STAND_IN_VALUE,
    ReadSite,
    StandIn,
    read_site,
    refuse_unknown,
    stack_frames,
)
from oomkit.prediction.tracing.values import (
    KnownValue,
    KnownValues,
    known_value,
    remember_value,
)

__all__ = [
    "ReadRecord",
    "ValueReads",
    "active_known_values",
    "parse_stated_values",
    "value_tracking",
]

Outcome = Literal["answered", "stated", "stand-in"]
# tolist() of an unknown tensor gives one stand-in per element, up to this many.
_MAX_STAND_IN_ELEMENTS = 1 << 16


@dataclass
class ReadRecord:
    """The reads at one site with one outcome.

    Attributes:
        site: where (file, line, function; library or the user's own).
        kind: the read (``Tensor.item()``, ``bool()``...).
        outcome: ``answered`` (known values), ``stated`` (given by the user) or ``stand-in``.
        value: the value returned (last one), as text; ``nan`` for stand-ins.
        origins: for ``answered``, the factories the values came from.
        count: how many times.
    """

    site: ReadSite
    kind: str
    outcome: Outcome
    value: str
    origins: frozenset[str]
    count: int = 1


_READS = {
    torch.Tensor.item: "Tensor.item()",
    torch.Tensor.__float__: "float()",
    torch.Tensor.__format__: "format()",
    torch.Tensor.tolist: "Tensor.tolist()",
    torch.Tensor.__bool__: "bool()",
    torch.Tensor.__int__: "int()",
    torch.Tensor.__index__: "an index",
    torch.equal: "torch.equal()",
}
# Reads whose result is itself a size or a branch: an unknown value cannot be stood in for.
_DECIDING = {
    torch.Tensor.__bool__: "a condition",
    torch.Tensor.__int__: "an integer (a size, an index or a loop bound)",
    torch.Tensor.__index__: "an integer (a size, an index or a loop bound)",
    torch.equal: "a condition",
}


def parse_stated_values(values: Mapping[str, Any] | None) -> dict[tuple[str, int], float]:
    """``{"file.py:42": 1024}`` -> ``{("file.py", 42): 1024}``, checked.

    Raises:
        ConfigError: a key is not ``FILE:LINE`` or a value is not a number.
    """
    parsed: dict[tuple[str, int], float] = {}
    for key, value in (values or {}).items():
        path, sep, line = str(key).rpartition(":")
        if not sep or not path or not line.isdigit() or int(line) < 1:
            raise ConfigError(
                f"a stated value is named FILE:LINE, the line that reads it; got {key!r}. "
                "Example: --value train.py:42=1024 (values={'train.py:42': 1024})"
            )
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(
                f"the value stated for {key} must be a number; got {value!r}. "
                "Example: --value train.py:42=1024"
            )
        parsed[(path.replace("\\", "/"), int(line))] = value
    return parsed


def _matches(path: str, filename: str) -> bool:
    wanted = Path(path).parts
    have = Path(filename).parts
    return len(wanted) <= len(have) and have[len(have) - len(wanted) :] == wanted


class ValueReads(TorchFunctionMode):
    """Answers reads of meta tensors' values (module docstring); records them by site."""

    def __init__(self, stated: Mapping[tuple[str, int], float]) -> None:
        super().__init__()
        self.stated = dict(stated)
        self.used_stated: set[tuple[str, int]] = set()
        self.records: dict[tuple[str, int, str, Outcome], ReadRecord] = {}
        # Finiteness tests of unknown tensors answered as for finite values, by function.
        self.assumed_finite: Counter[str] = Counter()
        # transformers' generate asked whether its sequences had all ended: "not yet".
        self.generation_goes_on = 0
        # Answered finiteness tests of fake tensors (meta ones are values.py's), by identity (a
        # tensor's == is elementwise), going with the tensor.
        self._fake_values: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in DATA_CONSTRUCTORS and from_python_data(func, args, kwargs):
            return _from_data(func, args, kwargs)
        if func in _FINITE_ANSWERS:
            return self._finiteness(func, args, kwargs)
        if func in _INDEXING and len(args) > 1 and _has_tensor_bound(args[1]):
            # torch reads a slice's tensor bounds in C++ (no __index__ call to see): each is
            # read here as __index__ is, and the indexing runs with the numbers.
            def read(bound: torch.Tensor) -> Any:
                return self.__torch_function__(torch.Tensor.__index__, (), (bound,))

            return func(args[0], _bounds_read(args[1], read), *args[2:], **kwargs)
        kind = _READS.get(func)
        tensors = [a for a in args[:2] if isinstance(a, torch.Tensor)]
        if kind is None or not any(_valueless(t) for t in tensors):
            return func(*args, **kwargs)
        frames = stack_frames(2)
        site = read_site(frames)
        if site is None:  # oomkit's own read
            return func(*args, **kwargs)
        stated = self._stated(frames)
        if stated is not None and func is not torch.equal:
            return self._record(site, kind, "stated", _convert(func, args, kwargs, stated), ())
        known = [self._known(t) for t in tensors]
        if all(k is not None for k in known):
            values = [k.tensor for k in known if k is not None]
            origins = frozenset().union(*(k.origins for k in known if k is not None))
            with torch._C.DisableTorchFunction(), unset_fake_temporarily():  # real values
                result = func(*values, *args[len(values) :], **kwargs)
            return self._record(site, kind, "answered", result, origins)
        checked = _generate_check(func, frames)
        if checked is not None:
            return checked
        if _inferred_mask_check(func, frames):
            return self._record(site, kind, "answered", True, {_INFERRED_MASK})
        answer = _generation_answer(func, tensors[0], frames)
        if answer is not None:
            self.generation_goes_on += func is torch.Tensor.__bool__
            return answer
        deciding = _DECIDING.get(func)
        if deciding is not None:
            refuse_unknown(kind, deciding, site)
        tensor = tensors[0]
        if func is torch.Tensor.tolist:
            if tensor.numel() > _MAX_STAND_IN_ELEMENTS:
                refuse_unknown(kind, f"a list of {tensor.numel()} numbers", site)
            result = _nested(StandIn(site), list(tensor.shape))
        elif func is torch.Tensor.__format__ and tensor.dim() != 0:
            return func(*args, **kwargs)  # a meta tensor's own text: no value read
        elif func is torch.Tensor.__format__:
            result = format(StandIn(site), *args[1:2])
        elif func is torch.Tensor.__float__:
            # float() turns a float subclass into a plain float (and warns that returning one
            # is deprecated): the value cannot stay checked. The warning says so.
            result = STAND_IN_VALUE
        else:
            result = StandIn(site)
        return self._record(site, kind, "stand-in", result, ())

    def _finiteness(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """isnan/isinf/isfinite of an unknown tensor: as for finite values (and counted)."""
        result = func(*args, **kwargs)
        tensor = args[0] if args else None
        if (
            isinstance(result, torch.Tensor)
            and _valueless(result)
            and isinstance(tensor, torch.Tensor)
            and self._known(tensor) is None
        ):
            name = f"torch.{func.__name__}"
            self.assumed_finite[name] += 1
            with torch._C.DisableTorchFunction(), unset_fake_temporarily():  # a real CPU value
                value = torch.full(result.shape, _FINITE_ANSWERS[func], dtype=result.dtype)
            if result.is_meta:
                remember_value(result, value, "assumed finite")
            else:  # a fake tensor (a distributed recording's): kept here, by the tensor
                self._fake_values[result] = value
        return result

    def _known(self, tensor: torch.Tensor) -> KnownValue | None:
        """``known_value``, or a fake tensor's answered finiteness test (``_finiteness``)."""
        known = known_value(tensor)
        if known is None and isinstance(tensor, FakeTensor):
            value = self._fake_values.get(tensor)
            if value is not None:
                return KnownValue(value, frozenset({"assumed finite"}))
        return known

    def _stated(self, frames: list[Any]) -> float | None:
        if not self.stated:
            return None
        for frame in frames:
            for (path, line), value in self.stated.items():
                if frame.f_lineno == line and _matches(path, frame.f_code.co_filename):
                    self.used_stated.add((path, line))
                    return value
        return None

    def _record(
        self, site: ReadSite, kind: str, outcome: Outcome, result: Any, origins: Any
    ) -> Any:
        key = (site.filename, site.line, kind, outcome)
        record = self.records.get(key)
        shown = "nan" if outcome == "stand-in" else _short(result)
        if record is None:
            self.records[key] = ReadRecord(site, kind, outcome, shown, frozenset(origins))
        else:
            record.count += 1
            record.value = shown
        return result

    def unused_stated(self) -> list[str]:
        """Stated values no read used (``file.py:42``), in the order given."""
        return [f"{path}:{line}" for path, line in self.stated if (path, line) not in self.used_stated]


# transformers' generate asks after each new token whether every sequence has ended:
# ``StopCheck.__call__``'s ``bool(unfinished_sequences.max() == 0)`` (transformers 5), or
# ``_has_unfinished_sequences``'s ``elif this_peer_finished`` before it (generation/utils.py).
# The new tokens are unknown, so no end-of-sequence token can be seen: the answer is "not yet",
# and generation runs to its length limit (max_new_tokens), where the stop is known
# (values.py ``_ABSORBING``). That is the most memory the call can take.
# Beam search (transformers 5 ``GenerationMixin._beam_search``) asks the other way round,
# ``not self._beam_search_has_unfinished_sequences(...)``: "yes, a beam is unfinished", until
# the length limit's known False ends it. It then crops its output to the longest beam
# generated, ``(beam_indices + 1).bool().sum(dim=1).max()`` (``max_generated_length``) and
# ``decoder_prompt_len`` plus that (``output_length``): with no end-of-sequence token, every
# position was generated, so they are ``cur_len - decoder_prompt_len`` and ``cur_len``.
_GENERATION_MODULE = ("transformers", "generation", "utils.py")
_ALL_ENDED = frozenset({"__call__", "_has_unfinished_sequences"})
_BEAM_SEARCH = "_beam_search"


def _generation_answer(func: Any, tensor: torch.Tensor, frames: list[Any]) -> int | None:
    """transformers' generate asking whether its sequences ended, or beam search the length
    it generated (above): the answer for no end-of-sequence token; ``None`` for other reads."""
    if not frames or Path(frames[0].f_code.co_filename).parts[-3:] != _GENERATION_MODULE:
        return None
    name = frames[0].f_code.co_name
    if func is torch.Tensor.__bool__:
        if name in _ALL_ENDED:
            return False
        return True if name == _BEAM_SEARCH else None
    if name != _BEAM_SEARCH or func not in (torch.Tensor.__index__, torch.Tensor.__int__):
        return None
    local = frames[0].f_locals
    length, prompt = local.get("cur_len"), local.get("decoder_prompt_len")
    if not isinstance(length, int) or not isinstance(prompt, int):
        return None
    if tensor is local.get("output_length"):
        return length
    if tensor is local.get("max_generated_length"):
        return length - prompt
    return None


# transformers' generate reads token ids for options not asked for (generation/utils.py),
# answered as for a tokenizer's batch: _get_logits_processor's ``not (encoder_input_ids <
# 0).any()``, whether the ids are a dummy filled with -100, read for the encoder repetition
# penalty and n-gram options: token ids are never negative, "no". (Its other reads of the ids
# decide the attention mask: a mask the script passes, known, answers them.)
# generate's check for right padding in a batch of prompts (``has_right_padding``: the last id
# of a row is the pad token, or the mask's last column holds a 0) only decides whether to log
# a warning (generation/utils.py ``generate``, "right-padding was detected"): either answer
# allocates the same, and "no" is a tokenizer's left-padded batch.
# (function, text on its line) -> the answer.
_GENERATE_CHECKS = {
    ("_get_logits_processor", "encoder_input_ids < 0"): False,
    ("generate", "if has_right_padding"): False,
    ("generate", "has_right_padding = torch.any(attention_mask[:, -1] == 0).item()"): False,
}


# generate drops an attention mask of all ones ((model_kwargs["attention_mask"] == 1).all() in
# generate): the attention then runs without one. A mask the code passed must be known to be
# answered; one generate inferred from unknown token ids (no mask passed:
# _prepare_attention_mask_for_generation, ones unless the pad token is among the ids) is
# answered "all ones", a batch without padding, as generate's own warning asks for ("Please
# pass your input's `attention_mask`"). Where the ids hold the pad token, the GPU keeps the
# mask and the attention takes its masked path.
_INFERRED_MASK = (
    "assumed: the attention mask generate inferred from token ids oomkit cannot know is all "
    "ones (no padding), so generate drops it; pass attention_mask to generate to state it"
)


def _inferred_mask_check(func: Any, frames: list[Any]) -> bool:
    """Whether this read is generate's all-ones test of a mask it inferred (above)."""
    if func is not torch.Tensor.__bool__ or not frames:
        return False
    frame = frames[0]
    if frame.f_code.co_name != "generate":
        return False
    if Path(frame.f_code.co_filename).parts[-3:] != _GENERATION_MODULE:
        return False
    # The test is the last part of a condition over several lines, which Python 3.11 reads at
    # the line of its ``if (``.
    lines = [
        linecache.getline(frame.f_code.co_filename, frame.f_lineno + n) for n in range(6)
    ]
    inferred = frame.f_locals.get("kwargs_has_attention_mask") is False
    return inferred and '(model_kwargs["attention_mask"] == 1).all()' in "".join(lines)


def _generate_check(func: Any, frames: list[Any]) -> bool | None:
    """The answer to one of generate's checks above; ``None``: not one of them."""
    if func not in (torch.Tensor.__bool__, torch.Tensor.item) or not frames:
        return None
    frame = frames[0]
    if Path(frame.f_code.co_filename).parts[-3:] != _GENERATION_MODULE:
        return None
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
    for (function, text), answer in _GENERATE_CHECKS.items():
        if frame.f_code.co_name == function and text in line:
            return answer
    return None


# Finiteness tests answered for unknown tensors as for finite values (a training run that
# proceeds has a finite loss; the HF Trainer skips logging a nan/inf loss this way).
_FINITE_ANSWERS = {
    torch.isnan: False,
    torch.Tensor.isnan: False,
    torch.isinf: False,
    torch.Tensor.isinf: False,
    torch.isposinf: False,
    torch.isneginf: False,
    torch.isfinite: True,
    torch.Tensor.isfinite: True,
}


def _from_data(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A tensor made from Python data (``_from_data.py``): its values are the data's."""
    result = func(*args, **kwargs)
    if isinstance(result, torch.Tensor) and result.is_meta:
        with torch._C.DisableTorchFunction():
            value = made_on(func, args, kwargs, "cpu")
        if value.numel() * value.element_size() <= MAX_DATA_VALUE_BYTES:
            owner = "Tensor" if func is torch.Tensor.new_tensor else "torch"
            remember_value(result, value, f"{owner}.{func.__name__}")
    return result


# Tensor indexing, where a slice's bounds may be 0-dim tensors (``x[:, :n]``).
_INDEXING = (torch.Tensor.__getitem__, torch.Tensor.__setitem__)


def _valueless(tensor: torch.Tensor) -> bool:
    """A tensor without values: a meta tensor, or a fake one (a distributed recording's,
    ``distributed.py``: ``FakeTensorMode`` on the fake process group) that is not a constant
    (FakeTensorMode keeps the value of a small tensor made from Python numbers, such as an
    optimizer's step count, and answers its reads itself: fake_tensor.py ``constant``)."""
    return tensor.is_meta or (isinstance(tensor, FakeTensor) and tensor.constant is None)


def _valueless_scalar(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and _valueless(value) and value.dim() == 0


def _has_tensor_bound(index: Any) -> bool:
    """Whether a slice in ``index`` (one, or a tuple's) has a 0-dim valueless tensor as a
    bound."""
    if isinstance(index, slice):
        return any(_valueless_scalar(b) for b in (index.start, index.stop, index.step))
    return isinstance(index, tuple) and any(_has_tensor_bound(part) for part in index)


def _bounds_read(index: Any, read: Callable[[torch.Tensor], Any]) -> Any:
    """``index`` with ``read`` of each slice bound that is a 0-dim valueless tensor."""
    if isinstance(index, slice):
        bounds = (index.start, index.stop, index.step)
        return slice(*(read(b) if _valueless_scalar(b) else b for b in bounds))
    if isinstance(index, tuple):
        return tuple(_bounds_read(part, read) for part in index)
    return index


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _nested(value: Any, shape: list[int]) -> Any:
    if not shape:
        return value
    return [_nested(value, shape[1:]) for _ in range(shape[0])]


def _convert(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], value: float) -> Any:
    """The stated ``value`` as the read returns it (an int for an integer tensor's item)."""
    tensor = args[0]
    if func is torch.Tensor.__bool__:
        return bool(value)
    if func in (torch.Tensor.__int__, torch.Tensor.__index__):
        return int(value)
    if func is torch.Tensor.__float__:
        return float(value)
    if tensor.dtype == torch.bool:
        scalar: Any = bool(value)
    elif tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        scalar = float(value)
    else:
        scalar = int(value)
    if func is torch.Tensor.tolist:
        return _nested(scalar, list(tensor.shape))
    if func is torch.Tensor.__format__:
        return format(scalar, *args[1:2])
    return scalar


_active: list[tuple[KnownValues, ValueReads]] = []


def active_known_values() -> KnownValues | None:
    """The known values of the open :func:`value_tracking`, or None when none is open."""
    return _active[-1][0] if _active else None


@contextlib.contextmanager
def value_tracking(
    values: Mapping[str, Any] | None = None,
) -> Iterator[tuple[KnownValues, ValueReads]]:
    """While open, meta tensors' determined values are followed and value reads answered.

    Open it around code that builds inputs before a trace (``oomkit predict file.py:function``
    opens it around the import, the builder and the trace), so that a mask made there with
    ``torch.ones`` is known when the step reads it. Nested, the outer one is used.

    Args:
        values: stated values by ``FILE:LINE`` (the line that reads them).

    Raises:
        ConfigError: a stated value is malformed (see :func:`parse_stated_values`).
    """
    stated = parse_stated_values(values)
    if _active:
        known, reads = _active[-1]
        reads.stated.update(stated)
        yield known, reads
        return
    known, reads = KnownValues(), ValueReads(stated)
    _active.append((known, reads))
    try:
        with known, reads:
            yield known, reads
    finally:
        _active.pop()

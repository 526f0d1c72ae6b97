"""Calls that build a tensor from Python data, read alike by value tracking and compiled code.

The four are ``torch.tensor``, ``as_tensor``, ``asarray`` and ``Tensor.new_tensor``.
torch/csrc/utils/tensor_new.cpp builds all four from ``data`` with ``internal_new_from_data``
(``asarray`` for data that is not a tensor, an array or a buffer), whose meta-device shortcut
makes a plain meta tensor below the dispatcher ("If the device is Meta, take the shortcut").
Their parsers take the data positionally and ``dtype``/``device`` by keyword only
(``"as_tensor(PyObject* data, *, ScalarType dtype=None, Device? device=None)"``, likewise
``tensor``, ``asarray(PyObject* obj, *, ...)`` and ``new_tensor``), so ``torch.as_tensor(x,
"meta")`` is torch's own TypeError and never reaches here. ``new_tensor`` builds on its
tensor's device unless ``device=`` says otherwise.

The functions here are traced by dynamo inside compiled code (``compiled.py``), so they keep to
plain comparisons and indexing.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["DATA_CONSTRUCTORS", "MAX_DATA_VALUE_BYTES", "built_on", "from_python_data", "made_on"]

# A tensor made from Python data keeps its values (values.py) up to this size: masks, ids and
# lengths are small; a table of data is not a value a step reads.
MAX_DATA_VALUE_BYTES = 1 << 20

# The four, for a membership test before the call to from_python_data: dynamo traces the
# compiled-code recorder's modes for every torch call, and a test of one tuple is a few steps
# where inlining a call is dozens.
DATA_CONSTRUCTORS = (torch.tensor, torch.as_tensor, torch.asarray, torch.Tensor.new_tensor)


def from_python_data(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``func(*args, **kwargs)`` builds a tensor from Python data (not from a tensor)."""
    if func is torch.Tensor.new_tensor:
        data = args[1] if len(args) > 1 else kwargs.get("data")
    elif func is torch.tensor or func is torch.as_tensor:
        data = args[0] if args else kwargs.get("data")
    elif func is torch.asarray:
        data = args[0] if args else kwargs.get("obj")
    else:
        return False
    return not isinstance(data, torch.Tensor)


def built_on(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device | None:
    """The device a :func:`from_python_data` call names: ``device=``, or for ``new_tensor`` its
    tensor's device; ``None`` when none is named (torch's default device)."""
    device = kwargs.get("device")
    if device is not None:
        return torch.device(device)
    if func is torch.Tensor.new_tensor and args and isinstance(args[0], torch.Tensor):
        return args[0].device
    return None


def made_on(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> Any:
    """The same call, building on ``device`` instead (the CPU, where the data's values live)."""
    return func(*args, **{**kwargs, "device": device})

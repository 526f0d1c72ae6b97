"""A script's ``torch.save`` writes nothing, and ``torch.load`` of what it saved gets it back.

While a script is recorded its checkpoints are not written: its tensors are the emulated GPU's
(meta, or fakes of a distributed recording), which hold no values, and a prediction must not
replace a user's real checkpoint with one. Each call is counted (``ScriptRun.saves_skipped``).

Some scripts load in the same run what they saved: Lightning's ``Tuner.scale_batch_size`` saves
the trainer's state before its trials and restores it after them (lightning/pytorch/tuner/
batch_size_scaling.py ``__scale_batch_dump_params`` / ``_reset_params``), a script reloads its
best model for a final evaluation. So :func:`saves_skipped` remembers what each save would have
written, as its layout (each tensor's shape, strides, dtype and device; a host tensor itself;
other objects as they were), and ``torch.load`` of it gives back a new object of that
layout, as a real load does: each tensor saved from the GPU is a new device tensor (made on
CUDA, so the recorder records the allocation the load makes on a GPU) unless ``map_location``
sends it to the CPU, where it is host memory (a tensor that is not recorded).

Which load is of which save: a save to a path is remembered by the path (nothing is written);
a save to a file object (an open file, ``io.BytesIO`` whose bytes Lightning writes to the file
itself) gets a short marker written into it, which ``torch.load`` of that file or buffer, or of
a copy of its bytes, recognises. Any other load is torch's own.

Where it may differ: a callable ``map_location`` is taken to leave each storage where it was
saved (Lightning's ``lambda storage, loc: storage``); the loaded tensors' values are unknown, as
every device tensor's are here; a host tensor is copied at the load, not at the save, and
non-tensor objects are the same objects the script saved, so a change the script made to them
after the save shows in the load (nothing is copied at a save, so a save costs no memory).
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_map

from oomkit.prediction.tracing.fake_storages import host_tensor, stands_for_cuda

__all__ = ["saves_skipped"]

# What a skipped save writes into a file object: the marker and the save's number.
_MARKER = b"oomkit: a torch.save skipped while predicting, number "
# The most bytes read from a file to look for the marker (the marker and a number).
_MARKER_READ = len(_MARKER) + 24


@dataclass(frozen=True)
class _SavedTensor:
    """A tensor as a save would have written it: its layout; a host tensor itself too."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    values: torch.Tensor | None  # a host tensor (its values are copied at the load); None: GPU


def _kept(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    return _SavedTensor(
        tuple(value.shape),
        tuple(value.stride()),
        value.dtype,
        None if stands_for_cuda(value) else value.detach(),
    )


def _lands_on_host(map_location: Any) -> bool:
    """Whether ``map_location`` sends a storage saved from CUDA to the CPU."""
    if isinstance(map_location, dict):
        map_location = map_location.get("cuda:0", map_location.get("cuda"))
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location).type == "cpu"
    return False  # None, or a callable taken to keep the saved device


def _loaded(saved: Any, map_location: Any) -> Any:
    host = _lands_on_host(map_location)

    def load(value: Any) -> Any:
        if not isinstance(value, _SavedTensor):
            return value
        if value.values is not None:
            return value.values.clone()
        if host:
            return host_tensor(
                lambda: torch.empty_strided(value.size, value.stride, dtype=value.dtype, device="meta")
            )
        # Made on CUDA: on the emulated GPU's device, recorded as the load's allocation.
        return torch.empty_strided(value.size, value.stride, dtype=value.dtype, device="cuda")

    return tree_map(load, saved)


def _number_in(head: bytes) -> int | None:
    if not head.startswith(_MARKER):
        return None
    digits = head[len(_MARKER) :].split(b"\n", 1)[0]
    return int(digits) if digits.isdigit() else None


def _marked(source: Any) -> int | None:
    """The number of the skipped save whose marker ``source`` (a path, a file object) holds."""
    if isinstance(source, (str, os.PathLike)):
        try:
            with open(source, "rb") as file:
                return _number_in(file.read(_MARKER_READ))
        except OSError:
            return None
    if not (hasattr(source, "read") and hasattr(source, "seek") and hasattr(source, "tell")):
        return None
    try:
        start = source.tell()
        head = source.read(_MARKER_READ)
        source.seek(start)
    except (OSError, io.UnsupportedOperation):
        return None
    return _number_in(head) if isinstance(head, bytes) else None


@contextlib.contextmanager
def saves_skipped(counter: list[int]) -> Iterator[None]:
    """While open, ``torch.save`` writes nothing but a marker into a file object, each call
    counted in ``counter[0]``, and ``torch.load`` of a save made here gives back its layout
    (module docstring)."""
    saved: dict[int, Any] = {}
    by_path: dict[str, int] = {}
    numbers = itertools.count(1)
    own_save, own_load = torch.save, torch.load

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        counter[0] += 1
        number = next(numbers)
        saved[number] = tree_map(_kept, obj)
        if isinstance(f, (str, os.PathLike)):
            by_path[os.path.abspath(os.fspath(f))] = number
        elif hasattr(f, "write"):
            f.write(_MARKER + str(number).encode() + b"\n")

    def load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
        number = None
        if isinstance(f, (str, os.PathLike)):
            number = by_path.get(os.path.abspath(os.fspath(f)))
        if number is None:
            number = _marked(f)
        if number is None or number not in saved:
            return own_load(f, map_location, *args, **kwargs)
        return _loaded(saved[number], map_location)

    torch.save, torch.load = save, load
    try:
        yield
    finally:
        torch.save, torch.load = own_save, own_load
